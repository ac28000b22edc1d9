"""The ssh backend: every host's job started over ssh (or the launch.yml playbook), one
supervisor on the chief that fails the run fast and keeps its verdict, logs followed live.

The run's story, top to bottom: :meth:`SshBackend.launch` -> :func:`run_job` (record, ship,
start, supervisor, follow, verdict); ``status``/``logs``/``stop`` find the run by its record.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from nodeops import transport
from nodeops.backends import starter, store
from nodeops.backends.base import Backend, Capabilities, DryRun, LaunchRequest, RunState, Sink
from nodeops.backends.ssh import run as ssh_run
from nodeops.backends.starter import RunFile
from nodeops.check import preflight as check
from nodeops.errors import EXIT_FAILURE, ExitWith
from nodeops.interrupts import ignoring_interrupts, sigterm_as_interrupt
from nodeops.launch import launchers
from nodeops.launch import plan as _launch_plan
from nodeops.launch.launchers import HostLaunch
from nodeops.node import failures, mpi_split
from nodeops.node import protocol as P
from nodeops.node import recovery as R
from nodeops.node import stacks as S
from nodeops.node import stall as ST
from nodeops.node.fabric import FabricError
from nodeops.quoting import sh_word
from nodeops.setup.render import inventory, ssh_config
from nodeops.setup.runner import run_playbook
from nodeops.spec import timeouts
from nodeops.spec.model import LoadedSpec, ResourceSpec

Emit = Callable[[str, str], None]


def emitter(rank_hosts: list[str], pdsh_hosts: dict[str, str] | None, emit_line: Emit) -> Emit:
    """``emit_line``, plus: for mpirun (all output arrives on the chief, tagged `[job,rank]<stdout>:`)
    the rank's own host and a `[rankN]:` prefix, like torchrun's lines; for deepspeed (pdsh
    prefixes each node's lines with `ADDRESS: `) the node's own host name."""
    if not rank_hosts and not pdsh_hosts:
        return emit_line
    lines = mpi_split.Lines()

    def emit(host: str, line: str) -> None:
        if rank_hosts and mpi_split.TAG.search(line):  # one physical line: pieces of several ranks' lines
            for rank, text in lines.feed(line):
                if rank is None:
                    emit_line(host, text)
                    continue
                text, mark = mpi_split.exited(text)  # the MPI shim's exit mark: for the verdict only
                if text or mark is None:
                    emit_line(rank_hosts[rank] if rank < len(rank_hosts) else host, f"[rank{rank}]:{text}")
            return
        prefixed = failures.pdsh_split(line, pdsh_hosts or {})
        if prefixed is not None:
            emit_line((pdsh_hosts or {})[prefixed[0]], prefixed[1])
            return
        emit_line(host, line)

    return emit


def running_summary(job: store.Job, states: Mapping[str, str], now: float | None = None) -> str:
    """`status`'s line for a run without a verdict yet: how many of its hosts run it, and since when."""
    running = sum(1 for st in states.values() if st.startswith("running"))
    since = ""
    if job.started:
        m, sec = divmod(max(0, int((time.time() if now is None else now) - job.started)), 60)
        h, m = divmod(m, 60)
        took = f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"
        since = f", started {time.strftime('%H:%M:%S', time.localtime(job.started))} ({took} ago)"
    if running:
        return f"run {job.run_id}: running on {running} of {len(states)} host(s){since}"
    return f"run {job.run_id}: no verdict yet, and no host runs it{since}; `nodeops logs {job.run_id}` has its end"


def teardown_summary(problems: dict[str, str]) -> str:
    """What a teardown achieved, from kill.sh's own confirmations (never assumed)."""
    bad = {h: why for h, why in problems.items() if why}
    if not bad:
        return "nothing of the run is left running"
    return "NOT confirmed clean on " + "; ".join(f"{h} ({why})" for h, why in bad.items())


def forwarded_env(spec: ResourceSpec) -> list[str]:
    """Names mpirun forwards to remote ranks with -x: what env.sh and the spec set on the chief."""
    names = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", *spec.network.nccl, *spec.env}
    if spec.network.ib == "off":
        names.add("NCCL_IB_DISABLE")
    names.update(spec.group(spec.chief).shared_envs)
    return sorted(names)


def supervised_hosts(spec: ResourceSpec, started: list[str]) -> list[dict[str, object]]:
    """How the chief's supervisor reaches each host (the chief itself locally): every host of the
    spec gets a guard; ``job`` says whether it runs a job.sh (mpirun/deepspeed ranks elsewhere)."""
    out: list[dict[str, object]] = []
    for node in spec.ranked_nodes():
        name = spec.alias(node)
        group = spec.group(node)
        h: dict[str, object] = {"name": name, "address": node.address, "port": group.port,
                                "user": group.username or "", "local": node is spec.chief,
                                "job": name in started}  # fmt: skip
        if spec.launch.restarts:
            h.update(spare=node.spare, nproc=spec.nproc(node))
        out.append(h)
    return out


def recovery(spec: ResourceSpec) -> dict[str, object] | None:
    """The supervisor's restart rules from the spec (None: restarts off)."""
    lc = spec.launch
    if not lc.restarts:
        return None
    return {"restarts": lc.restarts, "restart_on": lc.restart_on, "min_nodes": spec.min_nodes(),
            "backoff": lc.restart_backoff}  # fmt: skip


def supervisor_config(spec: ResourceSpec, run_id: str, started: list[str]) -> dict[str, Any]:
    return _launch_plan.run_config(run_id, supervised_hosts(spec, started), spec.launch.runner,
                                   spec.launch.max_restarts, timeouts.hard(spec)[0], recovery(spec))  # fmt: skip


def launch_plan(loaded: LoadedSpec, user_argv: list[str], run_id: str, script: str | None) -> list[HostLaunch]:
    """Every host's launch: its command line, node rank and the env launch adds."""
    s = loaded.spec
    ifname = s.network.socket_ifname if s.network.socket_ifname != "auto" else None
    return launchers.plan(
        s, user_argv, run_id, socket_ifname=ifname, env_names=forwarded_env(s), script=script,
        shim_path=f"@@HOME@@/{store.remote_dir(run_id)}/mpi_shim.sh",
        hostfile_path=f"@@HOME@@/.nodeops/{loaded.cluster_name}/hostfile",
    )  # fmt: skip


def dry_run(loaded: LoadedSpec, user_argv: list[str], script: str | None, sync: bool = False) -> DryRun:
    """`launch --dry-run`: what each host would run, from the same plan and files a launch ships;
    nothing is started and no host is reached (so no preflight)."""
    s = loaded.spec
    out = DryRun()
    for w in loaded.warnings:
        out.note(str(w))
    run_id = store.new_run_id()
    plan = launch_plan(loaded, user_argv, run_id, script)
    started = [h.host for h in plan if h.argv and h.node_rank >= 0]  # spares start nothing yet
    files = starter.host_files(loaded, plan, run_id, supervisor_config(s, run_id, started))

    def home(text: str) -> str:
        return text.replace("@@HOME@@", "~")

    rdir = starter.run_dir(run_id)
    spec_env = [(n, "******" if v.secret else (v.value if v.value is not None else f"${v.from_env} at setup"))
                for n, v in s.env.items()]  # fmt: skip
    nodes = {s.alias(n): n for n in s.nodes}
    out.note(f"==> dry run of {s.launch.runner} on {len(plan)} host(s); run id would be like {run_id}; "
             "nothing is started")  # fmt: skip
    if sync:
        out.note("==> --sync would first copy the workdir source to the nodes that differ")
    out.note("==> a launch would first run the preflight (ssh, ports, versions, workdir, script; --no-check skips it)")
    if s.launch.restarts:
        spares = ", ".join(s.alias(n) for n in s.spares()) or "none"
        out.note(f"==> on a {'failure' if s.launch.restart_on == 'any' else 'lost node, hang or killed rank'}: up to "
                 f"{s.launch.restarts} restart(s) without the failed node (spares: {spares}; min_nodes "
                 f"{s.min_nodes()}); the script sees NODEOPS_RESTART_COUNT")  # fmt: skip
    for h in plan:
        node = nodes[h.host]
        if h.node_rank < 0:
            out.out(f"{h.host} ({h.address}, spare, {h.nproc} process(es)): runs nothing until a restart gives it "
                    "a failed node's rank")  # fmt: skip
        else:
            out.out(f"{h.host} ({h.address}, node rank {h.node_rank}, {h.nproc} process(es))")
        if not h.argv:
            out.out(f"  command:  none here; the chief's {s.launch.runner} starts its ranks")
        else:
            out.out(f"  workdir:  {home(starter.job_workdir(loaded, run_id))}")
            out.out(f"  command:  {home(' '.join(sh_word(a) for a in h.argv))}")
            out.out("  env (launch):")
            for k, v in sorted(starter.job_env(s.launch.runner, h, rdir).items()):
                out.out(f"    {k}={home(v)}")
            shared = s.group(node).shared_envs
            if shared or spec_env:
                out.out(f"  env (setup wrote these to ~/.nodeops/{loaded.cluster_name}/env.sh, secrets to "
                        "secrets.env, beside the NCCL/Gloo settings):")  # fmt: skip
                for k, v in [*spec_env, *((k, str(v)) for k, v in shared.items())]:
                    out.out(f"    {k}={v}")
        shipped = ", ".join(f"{f.name} ({f.mode}, {len(f.content.encode())} B)" for f in files[h.host])
        out.out(f"  files to ~/{store.remote_dir(run_id)}/: {shipped}")
    return out


def report_attempts(result: dict[str, Any], sink: Sink) -> None:
    """After restarts: every attempt in a line (what ended it, what was decided); then each
    fault's timeline and the run's goodput."""
    attempts = result.get("attempts") or []
    lines = R.summary(attempts, int(result.get("attempts_total") or len(attempts)))
    if lines:
        sink.note(f"==> {len(lines)} attempt(s):")
    for line in lines:
        sink.note(f"    {line}")
    report_timeline(result, sink)


def report_timeline(result: dict[str, Any], sink: Sink) -> None:
    """Each fault as offsets from when it happened, and the run's goodput (a run with no
    timeline, from an older release, shows neither)."""
    for line in store.timeline_lines(result):
        sink.note(f"    {line}")


def report_hang(job: store.Job, hang: dict[str, Any], sink: Sink) -> None:
    """What the hang watchdog found: the ranks whose stack differs from the others', then the
    others; every rank's stack (hang.json) is copied from the chief into the run's record here."""
    sink.note(S.hung_line(job.run_id, hang))
    for line in S.report_lines(hang):
        sink.note(line)
    dest = job.dir / "stacks" / P.HANG
    if ssh_run.fetch_file(job.ssh_config, job.chief, job.run_id, P.HANG, dest):
        sink.note(f"    every rank's stack: {dest}")
    else:
        sink.note(f"    every rank's stack: {P.HANG} in the run dir on {job.chief} (could not copy it here)")


FLIGHT = "flight_recorder"  # in an ssh run's handle: the ranks had PyTorch's NCCL flight recorder on


def report_flight(job: store.Job, sink: Sink) -> None:
    """A failed or hung run's flight-recorder dumps (a collective timeout leaves one per rank),
    copied into its record, and where they are."""
    if job.handle.get(FLIGHT) != "1":
        return
    got = ssh_run.fetch_flight(job)
    if got:
        sink.note(f"    NCCL flight recorder dumps ({sum(got.values())} from {', '.join(got)}): "
                  f"{job.dir / S.FLIGHT_DIR}")  # fmt: skip


RESTARTS = "restarts"  # in an ssh run's handle: launch.restarts (its attempts are followed one by one)


def follow_attempts(job: store.Job, hosts: list[str], emit: Emit, sink: Sink, *, attempt: int,
                    stop_on_interrupt: bool = True, fold: bool = False,
                    addresses: dict[str, str] | None = None) -> ssh_run.JobResult:  # fmt: skip
    """Follow the run's logs to its end: with automatic restarts, attempt after attempt (each on
    the hosts the supervisor chose for it), saying what ended each one and what comes next."""
    while True:
        res = ssh_run.follow(job.ssh_config, hosts, job.run_id, emit, chief=job.chief,
                             stop_on_interrupt=stop_on_interrupt, kill_hosts=job.kill_hosts, addresses=addresses,
                             rank_hosts=job.rank_hosts, fold_after_failure=fold, attempt=attempt)  # fmt: skip
        if res.next_attempts is None:
            return res
        attempts, total = res.next_attempts.get("attempts") or [], int(res.next_attempts.get("total") or 0)
        done: dict[str, Any] = next((a for a in attempts if a.get("attempt") == attempt), {})
        nxt = attempts[-1]
        for a in attempts:  # this one, and any that ended before it could be followed (a failed start)
            if attempt <= int(a.get("attempt") or 0) < int(nxt["attempt"]):
                sink.note(f"==> {R.describe(a, total)}")
                done = a
        sink.note(f"==> attempt {nxt['attempt']}/{total} on {','.join(nxt['hosts'])}"
                  + (f" (after a {done['backoff']:.0f}s back-off)" if done.get("backoff") else ""))  # fmt: skip
        hosts, attempt = list(nxt["hosts"]), int(nxt["attempt"])


def keep_verdict(local: Path, res: ssh_run.JobResult) -> store.Verdict | None:
    """An attached run's verdict, kept in its record: the outcome, the host that started a
    failure (as the follower judged it), the code by the one rule, and the supervisor's own
    result. Nothing is kept without the supervisor's result (a later `runs` asks the chief)."""
    if res.supervisor is None and not res.interrupted:
        return None
    rc = res.root_cause
    if res.interrupted:
        outcome = "stopped"
    elif res.hang is not None:
        outcome = "hung"
    elif rc is not None:
        outcome = "failed"
    else:
        outcome = str((res.supervisor or {}).get("outcome") or "unknown")
    code = failures.failure_code(rc) if rc is not None else None
    first = None if rc is None else {"host": rc.host, "code": code,
                                     "why": rc.lost_reason or (f"exit code {code}" if code else "failed")}  # fmt: skip
    if res.supervisor and res.supervisor.get("outcome") == outcome:
        detail = store.describe(res.supervisor)
    elif first is not None:
        detail = f"failed: first failure on {first['host']} ({first['why']})"
    else:
        detail = "stopped on request" if res.stopped_elsewhere else "interrupted (Ctrl-C)"
    kind = str(((res.supervisor or {}).get("first_failure") or {}).get("kind") or "")
    v = store.Verdict(outcome, detail, failures.exit_code_for(outcome, code, kind), first_failure=first,
                      teardown_seconds=res.teardown_seconds,
                      hosts={h: {"exit_code": st.exit_code, "lost": st.lost_reason} for h, st in res.hosts.items()},
                      raw=res.supervisor or {})  # fmt: skip
    v.save(local)
    return v


def run_job(
    loaded: LoadedSpec,
    spec_path: Path,
    user_argv: list[str],
    sink: Sink,
    *,
    script: str | None = None,
    via: str = "ssh",
    detach: bool = False,
    verbose: bool = False,
    extra_files: Sequence[RunFile] = (),
    extra_env: Mapping[str, str] | None = None,
    emit: Emit | None = None,
    run_id: str | None = None,
) -> None:
    """Start a run on every host and, unless ``detach``, follow it to its end: returns when every
    host exited 0, else raises ExitWith the run's exit code (after naming the first failing
    host). ``extra_files`` go into each job host's run dir (ssh transport only: the launch role
    renders its own files), ``extra_env`` into each job's env (after env.sh); `check --fabric`
    ships its probe so. ``emit`` replaces ``sink.line`` for each log line; ``run_id`` is a
    fresh one (store.new_run_id) chosen by the caller, when its argv must name the run dir."""
    if extra_files and via != "ssh":
        raise ValueError("extra_files need the ssh transport")
    s = loaded.spec
    run_id = run_id or store.new_run_id()
    local = store.jobs_dir() / run_id
    local.mkdir(mode=0o700)
    (local / "ssh_config").write_text(ssh_config(loaded))
    plan = launch_plan(loaded, user_argv, run_id, script)
    if extra_env:
        plan = [dataclasses.replace(h, env={**h.env, **extra_env}) if h.argv else h for h in plan]
    started = [h.host for h in plan if h.argv and h.node_rank >= 0]  # spares start nothing yet
    all_hosts = [h.host for h in plan]
    addresses = {n.address: s.alias(n) for n in s.nodes}
    rank_hosts = launchers.rank_hosts(s) if s.launch.runner == "mpirun" else []  # mpirun's tagged lines
    pdsh_hosts = addresses if s.launch.runner == "deepspeed" else {}  # pdsh's address prefixes
    chief = s.alias(s.chief)
    job = store.Job(run_id=run_id, dir=local, hosts=started, argv=user_argv, runner=s.launch.runner, chief=chief,
                   spec=str(spec_path.resolve()), started=time.time(), rank_hosts=rank_hosts,
                   all_hosts=all_hosts, pdsh_hosts=pdsh_hosts,
                   handle={**({FLIGHT: "1"} if s.flight_recorder() else {}),
                           **({RESTARTS: str(s.launch.restarts)} if s.launch.restarts else {})})  # fmt: skip
    # `nodeops clean` leaves a run alone while this process starts it (until the supervisor runs)
    store.mark_starting(local)
    job.save()
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt():
            # announced inside the block: a Ctrl-C right after this line still stops what started
            sink.note(f"==> run {run_id}: starting {s.launch.runner} on {', '.join(started)} (via {via})")
            run = starter.run_vars(loaded, plan, run_id, supervisor_config(s, run_id, started))
            files = starter.files_from_vars(run)
            for h in plan:
                if h.argv:
                    files[h.host] += extra_files
            if via == "ssh":
                bad = {h: e for h, e in starter.start_ssh(local / "ssh_config", run_id, files).items() if e}
            else:
                extravars = starter.ansible_vars(run)
                # Connection data only: launch sends no env values (the ranks read env.sh and
                # secrets.env that setup wrote), so from_env variables need not be exported.
                result = run_playbook("launch.yml", inventory(loaded, None), kind="launch",
                                      extravars=extravars)  # fmt: skip
                bad = {hr.host: "; ".join(hr.errors) or hr.status for hr in result.hosts.values()
                       if hr.status != "ok"}  # fmt: skip
            if not bad:  # every host started: now the supervisor, which attaches to all of them
                why = starter.start_supervisor(local / "ssh_config", run_id, chief)
                bad = {chief: f"supervisor: {why}"} if why else {}
    except KeyboardInterrupt:
        # Every start has returned (the pool waits for them): stop what did start, everywhere.
        with ignoring_interrupts():
            left = ssh_run.teardown(local / "ssh_config", all_hosts, run_id)
        raise ExitWith(130, f"==> run {run_id} interrupted while starting; {teardown_summary(left)}") from None
    if bad:
        for host, why in bad.items():
            sink.note(f"{host}: {why}")
        with ignoring_interrupts():
            left = ssh_run.teardown(local / "ssh_config", all_hosts, run_id)
        raise ExitWith(EXIT_FAILURE, f"launch failed on {', '.join(bad)}; {teardown_summary(left)}")
    store.clear_starting(local)  # the supervisor runs: it has the run's verdict
    if detach:
        sink.note(f"==> started in {time.monotonic() - t0:.1f}s; detached")
        sink.note(f"    nodeops status {run_id}  |  nodeops logs {run_id} -f  |  nodeops stop {run_id}")
        sink.out(run_id)
        return
    sink.note(f"==> started in {time.monotonic() - t0:.1f}s; following logs (Ctrl-C stops every rank)")
    emit = emit or emitter(rank_hosts, pdsh_hosts, sink.line)
    try:
        res = follow_attempts(job, started, emit, sink, attempt=1 if s.launch.restarts else 0, fold=True,
                              addresses=addresses)  # fmt: skip
    except KeyboardInterrupt:  # in the instant before follow() took over Ctrl-C
        with ignoring_interrupts():
            ssh_run.request_stop(local / "ssh_config", chief, run_id)
            left = ssh_run.teardown(local / "ssh_config", all_hosts, run_id)
        raise ExitWith(130, f"==> run {run_id} interrupted; {teardown_summary(left)}") from None
    keep_verdict(local, res)
    if res.interrupted:
        how = "stopped on request (nodeops stop)" if res.stopped_elsewhere else "interrupted"
        raise ExitWith(res.exit_code, f"==> run {run_id} {how}; {teardown_summary(res.teardown_problems)}")
    if res.hang is not None:
        report_hang(job, res.hang, sink)
        report_flight(job, sink)
        report_attempts(res.supervisor or {}, sink)
        took = f" in {res.teardown_seconds:.1f}s" if res.teardown_seconds is not None else ""
        sink.note(f"==> the supervisor stopped every rank{took}; {teardown_summary(res.teardown_problems)}")
        raise ExitWith(res.exit_code)
    if res.root_cause is not None:
        rc = res.root_cause
        code = failures.failure_code(rc)
        why = f"exit code {code}" if code else rc.lost_reason
        own, summary = failures.failure_lines(rc.tail)
        first = (res.supervisor or {}).get("first_failure") or {}
        if first.get("kind") == "teardown":
            sink.note(f"==> run {run_id} finished its work, then crashed in teardown: every rank's script ended, "
                      f"then a rank on {first.get('host')} died ({why}); the results are complete; exit "
                      f"{failures.TEARDOWN_EXIT}. Its last lines:")  # fmt: skip
        else:
            sink.note(f"==> run {run_id} FAILED: first failure on {rc.host} ({why}); its last lines:")
        for line in own + (summary if verbose or not own else []):
            sink.note(f"    {rc.host} {failures.one_prefix(line)}")
        if summary and own and not verbose:
            sink.note(f"    ({len(summary)} more lines of torchrun's failure report: -v shows them, "
                      f"as does `nodeops logs {run_id}`)")  # fmt: skip
        if res.folded:
            sink.note(f"    ({sum(res.folded.values())} lines of the other hosts were not shown ("
                      + ", ".join(f"{h}: {n}" for h, n in res.folded.items())
                      + f"): tracebacks of the lost peer, torchrun's reports, lines printed while stopped; "
                      f"`nodeops logs {run_id}` has them)")  # fmt: skip
        if res.teardown_seconds is not None:
            sink.note(f"==> the supervisor stopped every other rank in {res.teardown_seconds:.1f}s; "
                      f"{teardown_summary(res.teardown_problems)}")  # fmt: skip
        else:
            sink.note(f"==> {teardown_summary(res.teardown_problems)}")
        report_flight(job, sink)
        report_attempts(res.supervisor or {}, sink)
        raise ExitWith(res.exit_code)
    if res.teardown_problems:
        raise ExitWith(EXIT_FAILURE, f"==> run {run_id}: every host exited 0, but "
                       f"{teardown_summary(res.teardown_problems)}")  # fmt: skip
    more = store.faults(res.supervisor or {})
    sink.note(f"==> run {run_id} finished: every host exited 0" + (f" ({more})" if more else ""))
    report_timeline(res.supervisor or {}, sink)


# Shell helpers for the remote checks: `alive ID DIR` is true while a process of the run lives
# on this host (NODEOPS_RUN_ID=ID in its environment, the tag every job process carries) or its
# supervisor runs. Read from /proc directly: no file of the run dir is trusted to say so.
ALIVE = """alive() {
  # -q: status 0 on a match even when some /proc entries could not be read
  grep -qsxzF "NODEOPS_RUN_ID=$1" /proc/[0-9]*/environ 2>/dev/null && return 0
  p=$(cat "$2/supervisor.pid" 2>/dev/null || true)
  [ -n "$p" ] && [ ! -e "$2/result.json" ] && grep -qs supervisor.py "/proc/$p/cmdline"
}
"""

# One ssh to the chief: the verdict if there is one, else whether the run still lives there.
_PROBE = (
    ALIVE
    + """id=@ID@; d=@DIR@
if [ -e "$d/result.json" ]; then echo verdict; cat "$d/result.json"
elif [ ! -d "$d" ]; then echo gone
elif alive "$id" "$d"; then echo running
else echo ended
fi
"""
)


def in_home(script: str) -> str:
    """The run dir is relative to the remote home: make a remote script cd there first."""
    return 'cd "$HOME" || exit 1\n' + script


def torn_down(verdict: dict[str, Any] | None) -> set[str]:
    """The hosts whose ranks the supervisor killed because another host failed (the teardown):
    victims, not failures. Each ended "killed" after the supervisor sent it its stop (a verdict
    from before ``sent_stop`` was recorded names none). A hang's hosts are not: the watchdog
    stops every rank, and its suspect may be only a guess."""
    v = verdict or {}
    culprit = (v.get("first_failure") or {}).get("host") if v.get("outcome") == "failed" else None
    if not culprit or not isinstance(v.get("hosts"), dict):
        return set()
    return {
        h
        for h, r in v["hosts"].items()
        if h != culprit and isinstance(r, dict) and r.get("ended") == "killed" and r.get("sent_stop") is True
    }


def ended_by_stop(state: str) -> bool:
    """A host state that a stop on request leaves (its ranks killed, or exited on the signal);
    a job that had finished (exited 0), processes still alive, or an unreachable host are not."""
    return state == "killed" or (re.fullmatch(r"exited -?\d+", state) is not None and state != "exited 0")


class SshBackend(Backend):
    name: ClassVar[str] = "ssh"
    capabilities: ClassVar[Capabilities] = Capabilities(
        runners=frozenset({"torchrun", "mpirun", "deepspeed"}), detach=True, via_ansible=True, script=True,
        fabric=True, sync=True, preflight=True, hang=True, stacks=True, flight_recorder=True, restarts=True,
        fabric_check=True,
    )  # fmt: skip

    def summary(self, loaded: LoadedSpec) -> str:
        s = loaded.spec
        world = sum(s.nproc(n) for n in s.nodes)
        return f"{len(s.nodes)} node(s), chief {s.chief.address}, {world} process(es), runner {s.launch.runner}"

    def check(self, loaded: LoadedSpec, timeout: float, sink: Sink) -> check.Report:
        sink.note(f"==> checking {len(loaded.spec.nodes)} hosts from the chief {loaded.spec.alias(loaded.spec.chief)}")
        result = check.run(loaded, timeout=timeout)
        return check.evaluate(loaded.spec, result, auto_gpus=loaded.discovered_gpus)

    def dry_run(self, loaded: LoadedSpec, request: LaunchRequest) -> DryRun:
        return dry_run(loaded, request.argv, request.script, request.sync)

    def launch(self, loaded: LoadedSpec, request: LaunchRequest, sink: Sink) -> None:
        run_job(loaded, request.spec_path, request.argv, sink, script=request.script, via=request.via,
                detach=request.detach, verbose=request.verbose)  # fmt: skip

    def status(self, job: store.Job, sink: Sink) -> None:
        states = ssh_run.host_states(job)
        attempts = ssh_run.read_attempts(job) if job.handle.get(RESTARTS) else None
        excluded = {h for a in (attempts or {}).get("attempts") or [] for h in a.get("excluded") or []}
        verdict = ssh_run.fetch_result(job.ssh_config, job.chief, job.run_id, wait=0)
        stopped = (verdict or {}).get("outcome") == "stopped"
        victims = {h for h in torn_down(verdict) if states.get(h) == "killed"}
        for host, state in states.items():
            if stopped and ended_by_stop(state):  # what `nodeops stop` did, not a failure of the host
                state = f"stopped ({state})"
            elif host in victims:  # what the teardown did after another host's failure
                state = f"stopped by the teardown ({state})"
            sink.out(f"{host:12} {state}" + ("  (excluded by a restart)" if host in excluded else ""))
        if attempts:
            for a in attempts.get("attempts") or []:
                sink.note(f"{R.describe(a, int(attempts.get('total') or 0))}")
        for st in ssh_run.read_stalls(job) if verdict is None else []:  # a verdict's: in its timeline
            sink.note(ST.describe(st))
        if job.handle.get(RESTARTS) and states.get(job.chief, "").startswith("unreachable"):
            sink.note(f"the chief {job.chief} is unreachable: its supervisor makes the restarts, so this run "
                      "cannot recover (every other host stops its ranks within seconds of losing it)")  # fmt: skip
        if verdict is None:
            sink.note(running_summary(job, states))
        else:
            sink.note(f"run {job.run_id}: {store.describe(verdict)}")
            report_timeline(verdict, sink)
            if verdict.get("outcome") == "hung" and verdict.get("hang"):
                report_hang(job, verdict["hang"], sink)
            if verdict.get("outcome") in ("failed", "hung"):
                report_flight(job, sink)
        fine = [h for h, st in states.items()
                if st.startswith(("running", "spare (not used)")) or st in ("exited 0", "idle")
                or (stopped and ended_by_stop(st)) or h in victims]  # fmt: skip
        bad = [h for h in states if h not in fine and h not in excluded]
        if bad:
            raise ExitWith(EXIT_FAILURE, f"run {job.run_id}: not ok on {', '.join(bad)}")

    def logs(self, job: store.Job, follow: bool, sink: Sink) -> None:
        emit = emitter(job.rank_hosts, job.pdsh_hosts, sink.line)
        if follow:
            hosts, attempt = job.hosts, 0
            if job.handle.get(RESTARTS):  # the earlier attempts' logs, then the current one's, followed
                for host, lines in ssh_run.read_logs(job, current=False).items():
                    for line in lines:
                        emit(host, line)
                current = ((ssh_run.read_attempts(job) or {}).get("attempts") or [{}])[-1]
                hosts, attempt = list(current.get("hosts") or job.hosts), int(current.get("attempt") or 1)
            res = follow_attempts(job, hosts, emit, sink, attempt=attempt, stop_on_interrupt=False)
            if res.interrupted:
                sink.note(f"==> stopped following; run {job.run_id} goes on (nodeops stop {job.run_id} stops it)")
            raise ExitWith(res.exit_code)
        for host, lines in ssh_run.read_logs(job).items():
            for line in lines:
                emit(host, line)

    def stop(self, job: store.Job, sink: Sink) -> None:
        # The supervisor stops every host and records the run as stopped; its guards confirm that
        # nothing is left where they stopped it. kill on every other host then confirms (and does
        # it alone when the chief cannot be reached). With restarts the supervisor may be between
        # attempts (a preflight, a start): its verdict says when it stopped everything, and only
        # then is the kill below final. The ask and the wait for the verdict are one ssh session.
        wait = 15 + (60 if job.handle.get(RESTARTS) else 0)
        ended, _asked, verdict = ssh_run.verdict_or_stop(job.ssh_config, job.chief, job.run_id, wait=wait)
        if ended is not None:
            sink.note(f"run {job.run_id} had already ended ({store.describe(ended)}); confirming nothing is left")
        confirmed = ssh_run.confirmed_stopped(verdict)  # verdict: None unless asked here
        rest = [h for h in job.kill_hosts if h not in confirmed]
        stopped = ssh_run.stop_hosts(job.ssh_config, rest, job.run_id) if rest else {}
        problems = {h: why for h, (why, _) in stopped.items() if why}
        # each host's state came with its kill's answer; a host that gave none is asked (or named unreachable)
        states = {h: state or (why if why.startswith("unreachable") else "") for h, (why, state) in stopped.items()}
        if not all(states.values()):
            states = ssh_run.host_states(job)
        states = {h: confirmed.get(h) or states.get(h, "") for h in job.kill_hosts}
        for host, state in states.items():
            sink.out(f"{host:12} {state}" + (f"  ({problems[host]})" if host in problems else ""))
        left = [h for h, s in states.items() if s.startswith("running")]
        if left or problems:
            raise ExitWith(EXIT_FAILURE, f"run {job.run_id}: not confirmed stopped on "
                           f"{', '.join(dict.fromkeys([*left, *problems]))}")  # fmt: skip
        sink.note(f"run {job.run_id}: nothing of it is left running on {len(states)} host(s)"
                  + ("" if ended is not None else "; stopped"))  # fmt: skip

    def fabric_nodes(self, loaded: LoadedSpec) -> tuple[list[str] | int, list[int]]:
        s = loaded.spec
        undiscovered = [s.alias(n) for n in s.nodes if n.gpus == "auto"]
        if undiscovered:
            raise FabricError(
                f"gpus: auto is not discovered yet on {', '.join(undiscovered)}: run `nodeops setup` first"
            )
        ranked = s.ranked_nodes()
        return [s.alias(n) for n in ranked], [len(n.gpus) if isinstance(n.gpus, list) else 0 for n in ranked]

    def run_probe(self, loaded: LoadedSpec, spec_path: Path, probe: RunFile, args: Sequence[str], sink: Sink, *,
                  env: Mapping[str, str], emit: Emit, run_id: str, seconds: float) -> None:  # fmt: skip
        # every node is measured, spares too, once: a probe is never restarted
        nodes = [n.model_copy(update={"spare": False}) for n in loaded.spec.nodes]
        every = dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"nodes": nodes}))
        argv = [f"@@HOME@@/{store.remote_dir(run_id)}/{probe.name}", *args]
        run_job(every, spec_path, argv, sink, extra_files=[probe], extra_env=env, emit=emit, run_id=run_id)

    def stacks(self, job: store.Job, native: bool, method: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        return ssh_run.take_stacks(job, native, method)

    def run_state(self, job: store.Job, connect_timeout: int | None = None) -> RunState:
        script = _PROBE.replace("@ID@", sh_word(store.check_run_id(job.run_id))).replace(
            "@DIR@", sh_word(store.remote_dir(job.run_id))
        )
        try:
            argv = transport.ssh_argv(job.ssh_config, job.chief, "bash", "-c", sh_word(in_home(script)),
                                      connect_timeout=connect_timeout)  # fmt: skip
            p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:  # may be the remote side's slowness: not said to be unreached
            return RunState("unreachable", f"{job.chief}: ssh timed out")
        if p.returncode != 0:
            return RunState("unreachable", f"{job.chief}: {transport.last_line(p.stderr, 'ssh failed')}",
                            reached=not (p.returncode == 255 and transport.not_reached(p.stderr)))  # fmt: skip
        head, _, rest = p.stdout.partition("\n")
        if head == "verdict":
            try:
                verdict = json.loads(rest)
            except ValueError:
                return RunState("unknown", "the chief's result.json is not JSON")
            v = store.supervisor_verdict(verdict)
            v.save(job.dir)  # kept here: later listings need no ssh
            return RunState(v.outcome, v.detail, v.exit_code, True)
        if head == "gone":
            return RunState("gone", f"no trace of it on {job.chief} (removed, or it never started)")
        if head == "running":
            return RunState("running", f"its supervisor runs on {job.chief}")
        return RunState("failed", "ended without a verdict (it failed while starting)")
