"""The Slurm backend: one batch script submitted through the login node (``nodeops.backends.slurm.job``
builds it and speaks sbatch/squeue/scontrol/scancel); status, logs and stop by the job's id."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from nodeops import errors, transport
from nodeops.backends import store
from nodeops.backends.base import Backend, Capabilities, DryRun, LaunchRequest, RunState, Sink
from nodeops.backends.slurm import job as slurm
from nodeops.backends.starter import RunFile
from nodeops.check import preflight as check
from nodeops.errors import EXIT_FAILURE, ExitWith
from nodeops.interrupts import deferred_interrupts, ignoring_interrupts, sigterm_as_interrupt
from nodeops.launch import launchers
from nodeops.node import check_rules, fabric, fabric_probe, failures, mpi_split, probe
from nodeops.node import protocol as P
from nodeops.node import recovery as R
from nodeops.node import slurm_failures as SF
from nodeops.node import slurm_watch as W
from nodeops.node import stacks as S
from nodeops.node import stall as ST
from nodeops.quoting import sh_word
from nodeops.setup.render import ssh_config
from nodeops.spec import timeouts
from nodeops.spec.model import LoadedSpec, Node, ResourceSpec
from nodeops.transport import last_line

STACKS_STEP = 60  # seconds `nodeops stacks` gives its srun step
NO_LOG_WARN = 20.0  # seconds RUNNING without a batch log before `follow` says the run dir may not be shared

# A live Slurm job's state, as `nodeops runs` names states
_RUN_STATES = {s: "running" for s in slurm.LIVE}  # a final state's name is slurm.outcome's


def launcher(runner: str) -> str:
    """What the training step runs on each node, as a verdict names it."""
    return {"deepspeed": "DeepSpeed's launcher"}.get(runner, runner)


def login_of(loaded: LoadedSpec, cfg: Path) -> slurm.Login:
    node = loaded.spec.login_node()
    return slurm.Login(loaded.spec.alias(node) if node is not None else None, cfg)


def slurm_id(job: store.Job) -> str:
    """The run's Slurm job id (its record's handle)."""
    return job.handle.get("job_id", "")


def last_state_of(job: store.Job) -> str:
    """The last state Slurm gave for the job, kept in the record (Slurm forgets a job MinJobAge
    after its end)."""
    return job.handle.get("state", "")


def login_for(job: store.Job, connect_timeout: int | None = None) -> slurm.Login:
    return slurm.Login(job.handle.get("login") or None, job.ssh_config, connect_timeout)


def remember(job: store.Job, st: slurm.Poll) -> None:
    """Keep the last state Slurm gave (it forgets a job MinJobAge after its end)."""
    if st.state and st.state != last_state_of(job):
        job.with_handle(state=st.state).save()


def cancel(job: store.Job) -> tuple[slurm.Poll, str]:
    """scancel; wait KillWait for the job to end; then SIGKILL whatever is left (--full)."""
    login = login_for(job)
    why = slurm.cancel(login, slurm_id(job))
    if why:
        return slurm.poll(login, job.run_id, slurm_id(job), {}, max_bytes=0), f"scancel failed: {why}"
    st = slurm.wait_gone(login, job.run_id, slurm_id(job), timeout=slurm.KILL_WAIT_MAX)
    how = "ended after scancel"
    if st.error and not st.state:
        return st, f"not confirmed: {slurm.describe(st)}"
    if st.state not in slurm.TERMINAL and st.state:
        slurm.cancel(login, slurm_id(job), kill=True)
        st = slurm.wait_gone(login, job.run_id, slurm_id(job), timeout=30)
        how = "killed (scancel --signal=KILL --full)"
    remember(job, st)
    return st, f"{how}: {slurm.describe(st)}"


def follow(job: store.Job, sink: Sink, *, cancel_on_interrupt: bool) -> slurm.Poll:
    """Stream the job's logs until it ends. Ctrl-C: cancel it (attached launch) or only stop
    following (`logs -f`), as the caller says."""
    login = login_for(job)
    fol = slurm.Follower(login, job.run_id, slurm_id(job), sink.line)
    last_state = ""
    running_since: float | None = None
    warned = False

    def on_poll(st: slurm.Poll) -> None:
        nonlocal last_state, running_since, warned
        if st.state and st.state != last_state:
            last_state = st.state
            sink.note(f"==> job {slurm_id(job)}: {slurm.describe(st)}")
            remember(job, st)
        if st.state == "RUNNING" and slurm.BATCH_LOG not in st.files and not warned:
            running_since = running_since or time.monotonic()
            if time.monotonic() - running_since > NO_LOG_WARN:
                warned = True
                sink.note(
                    f"warning: job {slurm_id(job)} has run {NO_LOG_WARN:.0f}s and its batch log is not in "
                    f"~/.nodeops/runs/{job.run_id} on {login.where}: is that dir on a filesystem the nodes share?"
                )

    try:
        st = fol.until_end(on_poll=on_poll)
        last = last_state or last_state_of(job)
        if st.forgotten and st.result is None and last in slurm.TERMINAL:
            st.state = last  # Slurm forgot it before we looked again: the last state seen
        return st
    except slurm.SlurmError as e:
        raise ExitWith(EXIT_FAILURE, f"==> lost track of job {slurm_id(job)}: {e}; see `nodeops status "
                       f"{job.run_id}`, `nodeops stop {job.run_id}` cancels it") from None  # fmt: skip
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            sink.note(f"==> stopped following; job {slurm_id(job)} goes on (nodeops stop {job.run_id} cancels it)")
            raise ExitWith(130) from None
        with ignoring_interrupts():
            _st, how = cancel(job)
        raise ExitWith(130, f"==> run {job.run_id} interrupted: job {slurm_id(job)} cancelled; {how}") from None


def logs_tail(job: store.Job) -> dict[str, list[str]]:
    """Each host's last lines (the batch log's as ``batch``), read at the end of the job."""
    st = slurm.poll(login_for(job), job.run_id, slurm_id(job), {}, max_bytes=256 << 10, whole=True, tail=True)
    return {slurm.host_of(name): SF.last_run(P.log_lines(text))[-SF.TAIL_LINES :]
            for name, (_, _, text) in st.files.items()}  # fmt: skip


def keep_verdict(job: store.Job, st: slurm.Poll, code: int, first: dict[str, Any] | None = None,
                 sink: Sink | None = None) -> None:  # fmt: skip
    """The finished job's verdict, kept in its record (``result.json``, as for an ssh run), with
    its timeline in the ssh supervisor's form (`runs` reads its goodput there); the timeline
    said to ``sink``. Not when Slurm forgot the job with no final state or result seen (`runs`
    says gone), nor when the record was removed meanwhile (`clean` in another shell)."""
    if not st.state and st.result is None:
        return
    outcome = slurm.outcome(st)
    raw = {"state": st.state, "exit": st.exit, "result": st.result, **slurm.timeline_result(st, first)}
    v = store.Verdict(outcome, f"Slurm job {slurm_id(job)}: {slurm.describe(st)}", code,
                      first_failure=first, raw=raw, backend="slurm")  # fmt: skip
    with contextlib.suppress(OSError):
        v.save(job.dir)
    if sink is not None:
        for line in store.timeline_lines(raw):
            sink.note(f"    {line}")


def keep_found(job: store.Job, st: slurm.Poll, code: int) -> None:
    """`runs` found the job over and no verdict kept here (a detached launch nobody followed):
    keep one with what the batch node named (no logs are read), so later listings, `status`
    and `runs`' goodput need not ask Slurm (as an ssh run's verdict is kept)."""
    if store.read_verdict(job.dir) is None:
        keep_verdict(job, st, code, slurm.fault_of(st))


def report_hang(job: store.Job, st: slurm.Poll, hang: dict[str, Any], sink: Sink) -> None:
    """What the hang watchdog found (as over ssh), its verdict kept here, and hang.json (every
    rank's stack) copied from the run dir into the run's record."""
    host = str(hang.get("host") or "")
    first = {"host": host or (job.hosts[0] if job.hosts else ""), "code": None, "kind": "hang",
             "why": str(hang.get("why") or "hung")}  # fmt: skip
    keep_verdict(job, st, failures.HUNG_EXIT, first, sink)
    where = f"~/.nodeops/runs/{job.run_id}/{W.HANG} on {login_for(job).where}"
    if not hang:
        sink.note(f"==> run {job.run_id} HUNG: the hang watchdog stopped it, but its report ({where}) "
                  "could not be read")  # fmt: skip
        return
    sink.note(S.hung_line(job.run_id, hang))
    for line in S.report_lines(hang):
        sink.note(line)
    dest = job.dir / "stacks" / W.HANG
    try:
        p = login_for(job).run(f"cat {slurm.run_dir_sh(job.run_id)}/{W.HANG}", timeout=120)
    except slurm.SlurmError:
        p = None
    if p is not None and p.returncode == 0 and p.stdout.strip():
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(p.stdout)
        sink.note(f"    every rank's stack: {dest}")
    else:
        sink.note(f"    every rank's stack: {where} (could not copy it here)")


def note_batch(sink: Sink, lines: list[str]) -> None:
    """The batch log's last lines, where a verdict has no node to blame."""
    for line in lines[-10:]:
        sink.note(f"    batch | {line}")


def verdict(job: store.Job, st: slurm.Poll, sink: Sink) -> None:
    """Report a finished job like an ssh run: the node whose failure started it and its last lines."""
    for lines, why in ((slurm.attempt_lines(st), "slurm.max_requeues"), (slurm.restart_lines(st), "launch.restarts")):
        if lines:
            sink.note(f"==> {len(lines)} attempt(s) of job {slurm_id(job)} ({why}):")
        for line in lines:
            sink.note(f"    {line}")
    if slurm.outcome(st) == "ok":
        keep_verdict(job, st, 0, sink=sink)
        sink.note(f"==> run {job.run_id} finished: job {slurm_id(job)} {slurm.describe(st)}")
        return
    if slurm.outcome(st) == "stopped":
        keep_verdict(job, st, 130, sink=sink)
        raise ExitWith(130, f"==> run {job.run_id}: job {slurm_id(job)} was cancelled")
    pre_rows = (st.result or {}).get("preflight_rows")
    if (st.result or {}).get("preflight") == "error":
        keep_verdict(job, st, EXIT_FAILURE)
        note_batch(sink, logs_tail(job).get("batch", []))
        raise ExitWith(EXIT_FAILURE, f"==> run {job.run_id}: job {slurm_id(job)}: {slurm.preflight_failure(st)}")
    if (st.result or {}).get("preflight"):
        keep_verdict(job, st, EXIT_FAILURE)
        for r in pre_rows or []:
            sink.note(f"{r.get('host')}: {r.get('check')}: {r.get('detail')}")
        hosts = ", ".join(dict.fromkeys(str(r.get("host")) for r in pre_rows or [])) or "a node"
        raise ExitWith(EXIT_FAILURE, f"==> run {job.run_id}: preflight failed on {hosts} in job {slurm_id(job)}'s "
                       f"first step; no training rank was started (skip with --no-check)")  # fmt: skip
    if (st.result or {}).get("fabric"):
        keep_verdict(job, st, EXIT_FAILURE)
        if (st.result or {}).get("fabric") == "error":  # no verdict: what the batch log said
            note_batch(sink, logs_tail(job).get("batch", []))
            raise ExitWith(EXIT_FAILURE, f"==> run {job.run_id}: job {slurm_id(job)}: {slurm.fabric_failure(st)}")
        report = (st.result or {}).get("fabric_report")
        if isinstance(report, dict):
            with contextlib.suppress(KeyError, TypeError, ValueError):  # a report that does not read: said below
                sink.report(fabric.FabricReport.from_json(report))
        raise ExitWith(EXIT_FAILURE, f"==> run {job.run_id}: job {slurm_id(job)}: {slurm.fabric_failure(st)} "
                       "(network.fabric in the spec changes the thresholds: docs/reference/spec.md)")  # fmt: skip
    hang = slurm.hang_of(st)
    if hang is not None:
        report_hang(job, st, hang, sink)
        ended = launcher(job.runner)
        how = "mpirun ended every rank" if job.runner == "mpirun" else f"srun ended {ended} on every node"
        raise ExitWith(failures.HUNG_EXIT, f"==> the hang watchdog stopped job {slurm_id(job)}'s training step "
                       f"(SIGTERM; {how}): {slurm.describe(st)}")  # fmt: skip
    tails = logs_tail(job)
    batch = tails.pop("batch", [])
    code = slurm.exit_code(st, batch, tails)
    first = SF.first_failure(batch, tails)
    # the batch node's own finding (a node whose heartbeats stopped; with launch.restarts, the last
    # attempt's culprit) beats srun's lines: a lost node reports no failure of its own, srun names
    # only the nodes whose ranks lost it
    fault = slurm.fault_of(st)
    if fault is not None and fault["host"] and (first is None or first[0] != fault["host"]):
        first = (fault["host"], code)
    why = fault["why"] if fault is not None and first is not None and fault["host"] == first[0] else ""
    finished = slurm.teardown(st)
    kind = "teardown" if finished else fault["kind"] if why and fault else None
    kept = None if first is None else {"host": first[0], "code": first[1], "why": why or f"exit code {first[1]}",
                                       **({"kind": kind} if kind else {})}  # fmt: skip
    keep_verdict(job, st, code, kept, sink)
    sig = (st.result or {}).get("signal")
    if sig:
        raise ExitWith(code, f"==> run {job.run_id}: job {slurm_id(job)} got {sig} before its time limit; it was "
                       f"forwarded to every rank, and torchrun then ended them: {slurm.describe(st)}")  # fmt: skip
    if first is None:
        if not batch:
            sink.note(f"    no batch log in ~/.nodeops/runs/{job.run_id} on the login node: the job could not "
                      "write there (is that dir on a filesystem every node shares?)")  # fmt: skip
        note_batch(sink, batch)
        raise ExitWith(code, f"==> run {job.run_id} {slurm.describe(st)}: no task's failure was reported")
    host, rc = first
    own, summary = failures.failure_lines(tails.get(host, []))
    what = f"{fault['kind']}: {why}" if why and fault is not None else f"exit code {rc}"
    if finished:  # as over ssh: the results are complete, the exit code says so
        sink.note(f"==> run {job.run_id} finished its work, then crashed in teardown: every rank's script ended, "
                  f"then a rank on {host} died ({what}); the results are complete; exit {failures.TEARDOWN_EXIT}. "
                  "Its last lines:")  # fmt: skip
    else:
        sink.note(f"==> run {job.run_id} FAILED: job {slurm_id(job)} {st.state}; first failure on {host} "
                  f"({what}); its last lines:")  # fmt: skip
    for line in own or summary:
        sink.note(f"    {host} {line}")
    who = (
        "mpirun stopped every other rank"
        if job.runner == "mpirun"
        else "srun stopped every other node's ranks (--kill-on-bad-exit)"
    )
    raise ExitWith(code, f"==> {who}; `nodeops logs {job.run_id}` has it all")


# --------------------------------------------------------------------------- the preflight: one srun step
def srun_options(spec: ResourceSpec) -> list[str]:
    """What the check's srun step asks for: the job's shape (nodes, partition, GPUs...), one
    task per node, a short time limit."""
    s = spec.slurm
    assert s is not None
    reservation = [f"--reservation={s.sbatch_extra['reservation']}"] if "reservation" in s.sbatch_extra else []
    return [f"--nodes={slurm.allocated(spec)}", "--ntasks-per-node=1", "--time=10", *slurm.shape_options(spec),
            *reservation]  # fmt: skip


def node_plan(loaded: LoadedSpec, fast: bool, timeout: float, script: str | None = None) -> dict[str, Any]:
    """What the probe does on each node Slurm gives: what chief_main hands a node, made from the
    login node's plan (the spec's only node); no ports (a job's port comes from its id)."""
    login = loaded.spec.login_node()
    chief_plan = check.plan(loaded, fast=fast, timeout=timeout, script=script)
    return dict(chief_plan["nodes"][0]["plan"], mode="node", name="", nonce="", ports=[],
                chief_address=login.address if login is not None else "127.0.0.1",
                commands=check_rules.slurm_runner_commands(loaded.spec.launch.runner),
                manifest=chief_plan.get("manifest"))  # fmt: skip


def preflight_input(loaded: LoadedSpec, script: str | None) -> str:
    """The batch script's preflight step's input (``slurm.PREFLIGHT_IN``): the probe and the
    rules' source, the fast plan (``script``: the training script, relative to the workdir)."""
    spec = loaded.spec
    return json.dumps({
        "source": Path(probe.__file__).read_text(), "rules": Path(check_rules.__file__).read_text(),
        "plan": node_plan(loaded, True, slurm.PREFLIGHT_TIMEOUT, script),
        "expect": {"runner": spec.launch.runner, "workdir": spec.workdir.path if spec.workdir else ""},
    })  # fmt: skip


def run_files(loaded: LoadedSpec) -> dict[str, str]:
    """What `nodeops stacks` and the hang watchdog need in the run dir (the batch script uses
    each only where it is there): stacks.py, the ranks' stack hook, and with a hang timeout the
    watchdog and its config; for runner mpirun, the MPI shim and mpirun's output splitter (with
    the protocol module it reads)."""
    files = {"stacks.py": Path(S.__file__).read_text(), f"{S.HOOK_DIR}/sitecustomize.py": S.HOOK}
    if loaded.spec.launch.runner == "mpirun":
        files[slurm.MPI_SPLIT] = Path(mpi_split.__file__).read_text()
        files[slurm.MPI_SHIM] = launchers.mpi_shim()
        files[slurm.MPI_PROTOCOL] = Path(P.__file__).read_text()
    timeout = timeouts.hard(loaded.spec)[0]
    if timeout:
        files["watch.py"] = Path(W.__file__).read_text()
        files["stall.py"] = Path(ST.__file__).read_text()  # the stall watch's rules (watch.py imports them)
        files[W.CONFIG] = json.dumps({"hang_timeout": timeout})
    if loaded.spec.launch.restarts:
        files.update(recover_files(loaded.spec))
    return files


def recover_files(spec: ResourceSpec) -> dict[str, str]:
    """launch.restarts: the restart rules the batch script asks after each failed attempt
    (nodeops.node.slurm_failures with what it imports, as a package of its own in the run dir) and
    the spec's rules for them (``slurm_failures.CONFIG``)."""
    lc, s = spec.launch, spec.slurm
    assert s is not None
    files = package_files(SF.PACKAGE_DIR, (SF, failures, mpi_split, P, R))
    files[SF.CONFIG] = json.dumps({"nodes": s.nodes, "restarts": lc.restarts, "restart_on": lc.restart_on,
                                   "min_nodes": spec.min_nodes(), "backoff": lc.restart_backoff})  # fmt: skip
    return files


def fabric_files(loaded: LoadedSpec, count: int, gpus: list[int]) -> dict[str, str]:
    """launch --fabric-check's step before training: the probe, its arguments, the thresholds,
    and the gate that judges them on the batch node (nodeops.node.fabric with what it imports, as a
    package of its own in the run dir)."""
    thresholds = loaded.spec.network.fabric
    args = fabric.probe_args(count, fabric.GATE_SECONDS, thresholds.max_pair_spread, fabric.backend(gpus))
    return {
        "fabric.py": Path(fabric_probe.__file__).read_text(),
        slurm.FABRIC_ARGS: "".join(f"{a}\n" for a in args),
        slurm.FABRIC_CONFIG: json.dumps({"spread": thresholds.max_pair_spread, "min_busbw": thresholds.min_busbw_gbps}),
        **package_files(slurm.FABRIC_GATE_DIR, (errors, fabric, fabric_probe)),
    }


def package_files(root: str, modules: Sequence[ModuleType]) -> dict[str, str]:
    """``modules`` as a package of their own under ``root`` in the run dir (run there with
    ``python3 -m``): each at its module path (nodeops/node/recovery.py), with an empty
    ``__init__.py`` in every package dir (not the real ones: they import what is not shipped)."""
    files: dict[str, str] = {}
    for m in modules:
        parts = m.__name__.split(".")
        for i in range(1, len(parts)):
            files.setdefault(f"{root}/{'/'.join(parts[:i])}/__init__.py", "")
        files[f"{root}/{'/'.join(parts)}.py"] = Path(str(m.__file__)).read_text()
    return files


def take_stacks(job: store.Job, native: bool, method: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's stack of a running job: stacks.py in one ``srun --overlap`` task per node of
    the job (from the login node), each node's answer in a file of the shared run dir, run by the
    job's own python3 (the login shell's may be older than 3.8). Every node of the job that gave
    no answer is named, with srun's exit and last message. srun's stdin is /dev/null: it would
    otherwise forward the rest of this ``bash -s`` script to a task. The answers are read into
    a variable and the files removed before anything is printed, so a caller gone early (Ctrl-C)
    leaves no file behind."""
    d, jid = slurm.run_dir_sh(job.run_id), sh_word(slurm_id(job))
    args = " ".join(sh_word(a) for a in ["--method", method] + (["--native"] if native else []))
    none_mark = sh_word(S.NONE_MARK)
    script = (
        "trap '' PIPE\n"
        f"d={d}\n"
        f'test -r "$d/stacks.py" || {{ echo {none_mark}"no stacks.py in its run dir (not started by '
        f'nodeops launch?)"; exit 0; }}\n'
        f"if ! row=$(squeue -h -j {jid} -o '%T %D %N' 2>&1); then\n"
        f'  echo {none_mark}"squeue failed on the login node: $(printf %s "$row" | tail -n 1)"; exit 0\nfi\n'
        'read -r state count nodelist <<<"$row" || true\n'
        f'[ "${{state:-}}" = RUNNING ] || {{ echo {none_mark}"Slurm job "{jid}" is ${{state:-no longer known to '
        f'Slurm}}"; exit 0; }}\n'
        f'py=$(cat "$d/{slurm.PYTHON_PATH}" 2>/dev/null) || py=python3\n'
        'out="$d/stacks-out.$$"\nmkdir -p "$out"\n'
        f'timeout --kill-after=10 {STACKS_STEP} srun --jobid={jid} --overlap --nodes="$count" --ntasks-per-node=1 '
        '--kill-on-bad-exit=0 --job-name=nodeops-stacks --output="$out/%N.out" '
        f'"$py" "$d/stacks.py" "$d" {args} </dev/null >/dev/null 2>"$out.err"\n'
        "rc=$?\n"
        'res=$(echo "@@nodes $(scontrol show hostnames "$nodelist" | tr "\\n" " ")"\n'
        '  for f in "$out"/*.out; do [ -e "$f" ] || continue; n=${f##*/}; echo "@@node ${n%.out}"; cat "$f"; done\n'
        '  echo "@@srun $rc $(grep -v "^$" "$out.err" | tail -n 1)")\n'
        'rm -rf "$out" "$out.err"\n'
        'printf "%s\\n" "$res"\n'
    )
    where = f"job {slurm_id(job)}"
    try:
        p = login_for(job).run(script, timeout=STACKS_STEP + 30)
    except slurm.SlurmError as e:
        return [], {where: str(e)}
    if p.returncode != 0:
        return [], {where: f"{login_for(job).where}: {last_line(p.stderr, f'exit {p.returncode}')}"}
    return parse_stacks(p.stdout, where)


def parse_stacks(text: str, where: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """take_stacks' answer: the dumps (each with its node), and node -> why none came from it
    (every node of the job that printed neither a stack nor why it has none is named)."""
    nodes: list[str] = []
    srun = ""
    chunks: dict[str, list[str]] = {}
    node = where
    for line in text.splitlines():
        if line.startswith("@@nodes "):
            nodes = line.split()[1:]
        elif line.startswith("@@node "):
            node = line.split(" ", 1)[1]
        elif line.startswith("@@srun "):
            rc, _, err = line[len("@@srun ") :].partition(" ")
            srun = "" if rc == "0" else f"the stacks step (srun --overlap) exited {rc}: {err or 'no message'}"
        else:
            chunks.setdefault(node, []).append(line)
    dumps: list[dict[str, Any]] = []
    none: dict[str, str] = {}
    for n, lines in chunks.items():
        got, why = S.read_answer("\n".join(lines), n)
        dumps += got
        if not got and why:
            none[n] = why
    for n in nodes:
        if n not in none and not any(d["host"] == n for d in dumps):
            none[n] = f"no answer ({srun or 'its task printed nothing'})"
    if not nodes and srun and not dumps:
        none.setdefault(where, srun)
    return dumps, none


def run_slurm(loaded: LoadedSpec, *, fast: bool = False, timeout: float = 120) -> tuple[ResourceSpec, dict[str, Any]]:
    """The probe in one srun step on the login node, one task per node Slurm gives; returns a
    spec listing those nodes (for :func:`evaluate`) and the probe's document. No port rows: a
    Slurm job's port comes from its job id, so there is none to test before it runs."""
    spec = loaded.spec
    login = spec.login_node()
    payload = json.dumps({"source": Path(probe.__file__).read_text(), "plan": node_plan(loaded, fast, timeout)})
    name = f"nodeops-check-{secrets.token_hex(4)}"  # to scancel it by, should this end before srun does
    opts = " ".join(sh_word(o) for o in [*srun_options(spec), f"--job-name={name}"])
    script = (
        f"exec srun --input=all {opts} python3 -c {sh_word(probe.BOOT)} <<'NODEOPS_PAYLOAD'\n"
        f"{payload}\nNODEOPS_PAYLOAD\n"
    )
    with tempfile.TemporaryDirectory(prefix="nodeops-check-") as tmp:
        cfg = Path(tmp) / "ssh_config"
        cfg.write_text(ssh_config(loaded))
        os.chmod(cfg, 0o600)
        where = slurm.Login(spec.alias(login) if login is not None else None, cfg)
        try:
            p = where.run(script, timeout=timeout + 30)
        except BaseException:  # a timeout or Ctrl-C ends our ssh, not the srun step behind it
            with contextlib.suppress(Exception):
                where.run(f'scancel --name={sh_word(name)} --user="$(id -un)"', timeout=30)
            raise
    facts = probe.documents(p.stdout)
    if not facts:
        raise check.CheckError(f"the srun step on {where.where} gave no node's facts (exit {p.returncode}): "
                         f"{last_line(p.stderr, 'no output')}")  # fmt: skip
    for f in facts:  # the node as Slurm names it (its hostname may be longer)
        f["hostname"] = str(f.get("slurm_node") or f["hostname"])
    names = sorted(str(f["hostname"]) for f in facts)
    per_node = [] if spec.slurm is None or spec.slurm.gpus_per_node is None else list(range(spec.slurm.gpus_per_node))
    nodes = [Node(address=h, name=h, gpus=per_node, chief=i == 0) for i, h in enumerate(names)]
    doc: dict[str, Any] = {"chief": {}, "listeners": {},
           "nodes": {str(f["hostname"]): {"ssh": {"ok": True, "seconds": 0.0}, "facts": f} for f in facts}}  # fmt: skip
    if spec.slurm is not None and len(facts) < slurm.allocated(spec):
        doc["missing"] = f"{slurm.allocated(spec)} node(s) asked for, {len(facts)} answered: {last_line(p.stderr, '')}"
    return spec.model_copy(update={"nodes": nodes}), doc


def as_srun_rows(report: check.Report, missing: str = "") -> check.Report:
    """The ssh row of each host, said as what it was on Slurm: an srun task on that node."""
    rows = [check.Row(r.host, "srun", r.status, "probed in the check's srun step (one task per node)")
            if r.check == "ssh" else r for r in report.rows]  # fmt: skip
    if missing:
        rows.insert(0, check.Row(report.hosts[0] if report.hosts else "slurm", "srun", check.FAIL, missing))
    return check.Report(rows, report.values, report.hosts)


def submit_run(loaded: LoadedSpec, spec_path: Path, argv: Sequence[str], files: Mapping[str, str], sink: Sink,
               run_id: str, what: str, in_run_dir: bool = False) -> store.Job:  # fmt: skip
    """Write the run's record and submit its batch script with ``files`` (what = how the
    progress line describes it); returns the saved record. Ctrl-C or SIGTERM while sbatch runs
    waits until the record is saved, then cancels the job: a job is never queued without a
    record to stop it by."""
    local = store.jobs_dir() / run_id
    local.mkdir(mode=0o700)
    (local / "ssh_config").write_text(ssh_config(loaded))
    login = login_of(loaded, local / "ssh_config")
    script = slurm.batch_script(loaded)
    (local / slurm.SCRIPT).write_text(script)
    t0 = time.monotonic()
    nodes = slurm.allocated(loaded.spec) if loaded.spec.slurm else 0
    spares = slurm.spares(loaded.spec) if loaded.spec.slurm else 0
    sink.note(
        f"==> run {run_id}: sbatch on {login.where} ({nodes} node(s)"
        + (f", {spares} of them spare" if spares else "")
        + f"; {what})"
    )
    noted = "==> interrupt noted: waiting for sbatch to answer, then the job is cancelled"
    with deferred_interrupts(lambda: sink.note(noted)) as interrupted:
        try:
            job_id = slurm.submit(login, run_id, script, argv, files, in_run_dir=in_run_dir)
        except slurm.SlurmError as e:
            job_id = ""
            why = str(e)
        if job_id:
            job = store.Job(run_id=run_id, dir=local, hosts=[login.host or "localhost"], argv=list(argv),
                            runner=loaded.spec.launch.runner, chief=login.host or "localhost",
                            spec=str(spec_path.resolve()), started=time.time(), backend="slurm",
                            handle={"job_id": job_id, "login": login.host or ""})  # fmt: skip
            job.save()
    if not job_id:
        raise ExitWith(130 if interrupted else EXIT_FAILURE,
                       f"launch failed: {why}" + ("; interrupted" if interrupted else ""))  # fmt: skip
    sink.note(f"==> submitted Slurm job {job_id} in {time.monotonic() - t0:.1f}s")
    if interrupted:
        with ignoring_interrupts():
            _st, how = cancel(job)
        raise ExitWith(130, f"==> run {run_id} interrupted while submitting: job {job_id} cancelled; {how}")
    return job


@dataclasses.dataclass
class Emitting:
    """A sink whose log lines go to ``emit`` (a measurement's reader) instead."""

    sink: Sink
    emit: Callable[[str, str], None]

    def note(self, text: str) -> None:
        self.sink.note(text)

    def out(self, text: str) -> None:
        self.sink.out(text)

    def line(self, host: str, text: str) -> None:
        self.emit(host, text)

    def report(self, report: Any) -> None:
        self.sink.report(report)


class SlurmBackend(Backend):
    name: ClassVar[str] = "slurm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        runners=frozenset({"torchrun", "mpirun", "deepspeed"}), detach=True, via_ansible=False,
        script=False, fabric=True, sync=True, preflight=False, hang=True, stacks=True, fabric_check=True,
        fabric_check_in_job=True, restarts=True,
    )  # fmt: skip
    # On Slurm, setup prepares the shared filesystem through the login node: the Python env, the
    # workdir and the env file. The ssh mesh and DeepSpeed's hostfile are for ssh launches.
    setup_skips: ClassVar[tuple[str, ...]] = ("ssh_mesh", "deepspeed_env")

    def summary(self, loaded: LoadedSpec) -> str:
        s = loaded.spec
        if s.slurm is None:
            raise ValueError("a Slurm spec without its slurm section")
        login = s.login_node()
        gpus = (f"{s.slurm.gpus_per_node} GPU(s) per node" if s.slurm.gpus_per_node is not None
                else f"{s.slurm.gpus} GPU(s) in all" if s.slurm.gpus else "no GPUs asked for")  # fmt: skip
        spares = f" and {slurm.spares(s)} spare(s)" if slurm.spares(s) else ""
        return f"Slurm, {s.slurm.nodes} node(s){spares}, {gpus}, sbatch " + (
            f"on the login node {login.address}" if login is not None else "on this machine"
        )

    def files(self, loaded: LoadedSpec) -> dict[str, str]:
        return {slurm.SCRIPT: slurm.batch_script(loaded)}  # what `launch` submits: `sbatch job.sbatch train.py`

    def check(self, loaded: LoadedSpec, timeout: float, sink: Sink) -> check.Report:
        count = slurm.allocated(loaded.spec) if loaded.spec.slurm else 0
        spares = " (spares included)" if loaded.spec.slurm and slurm.spares(loaded.spec) else ""
        sink.note(f"==> checking the {count} node(s) Slurm gives{spares}, in one srun step")
        nodes_spec, result = run_slurm(loaded, timeout=timeout)
        return as_srun_rows(check.evaluate(nodes_spec, result), result.get("missing", ""))

    def dry_run(self, loaded: LoadedSpec, request: LaunchRequest) -> DryRun:
        out = DryRun()
        node = loaded.spec.login_node()
        where = f"on the login node {loaded.spec.alias(node)}" if node is not None else "on this machine"
        out.out(f"# {slurm.SCRIPT}, submitted {where} as:")
        out.out(f"#   sbatch --parsable --output=RUN_DIR/{slurm.BATCH_LOG} RUN_DIR/{slurm.SCRIPT} "
                + " ".join(sh_word(a) for a in request.argv))  # fmt: skip
        out.out(slurm.batch_script(loaded).removesuffix("\n"))
        hard = timeouts.hard(loaded.spec)[0]
        if hard:
            out.note(
                f"==> the hang watchdog would run beside the training step on the batch node: no progress for "
                f"{hard:.0f}s -> every rank's stack, the stuck rank named, exit 124"
            )
        lc = loaded.spec.launch
        if lc.restarts and loaded.spec.slurm is not None:
            out.note(f"==> on a {'failure' if lc.restart_on == 'any' else 'lost node, hang or killed rank'}: up to "
                     f"{lc.restarts} restart(s) inside the allocation, without the failed node (spare nodes: "
                     f"{loaded.spec.slurm.spare_nodes}; min_nodes {loaded.spec.min_nodes()}); the script sees "
                     "NODEOPS_RESTART_COUNT")  # fmt: skip
        if request.fabric_check:
            out.note(
                f"==> a step before training would measure the fabric of the job's nodes "
                f"(RUN_DIR/{slurm.FABRIC_ARGS}, {fabric.GATE_SECONDS}s budget); a slow node ends the job there"
            )
        if request.check:
            out.note(f"==> the job's first step would be the preflight: RUN_DIR/{slurm.PREFLIGHT_IN} holds the probe "
                     "of `nodeops check` and its rules (python env, runner, workdir, script, parity); "
                     "--no-check leaves it out")  # fmt: skip
        return out

    def launch(self, loaded: LoadedSpec, request: LaunchRequest, sink: Sink) -> None:
        """Submit the batch script; then follow it like `logs -f` (Ctrl-C cancels the job) and exit
        with its code, or (``--detach``) print the run id and return."""
        # the preflight runs as the job's first step (the same probe and rules as `check`)
        files = run_files(loaded)
        if request.check:
            files[slurm.PREFLIGHT_IN] = preflight_input(loaded, request.script_file())
        pre = "its first step the preflight" if request.check else "no preflight (--no-check)"
        if request.fabric_check:  # a step before training, on the nodes the training then gets
            count, gpus = self.fabric_nodes(loaded)
            files.update(fabric_files(loaded, count, gpus))
            pre += ", then the fabric check"
        job = submit_run(loaded, request.spec_path, request.argv, files, sink, store.new_run_id(), pre)
        if request.detach:
            sink.note(f"    nodeops status {job.run_id}  |  nodeops logs {job.run_id} -f  |  nodeops stop {job.run_id}")
            sink.out(job.run_id)
            return
        sink.note("==> following its logs (Ctrl-C cancels the job)")
        with sigterm_as_interrupt():
            st = follow(job, sink, cancel_on_interrupt=True)
        verdict(job, st, sink)

    def fabric_nodes(self, loaded: LoadedSpec) -> tuple[int, list[int]]:
        s = loaded.spec.slurm
        if s is None:
            raise ValueError("a Slurm spec without its slurm section")
        count = slurm.allocated(loaded.spec)  # the spares' links are measured too
        per_node = s.gpus_per_node if s.gpus_per_node is not None else (s.gpus or 0) // max(1, count)
        return count, [per_node] * count  # Slurm names the nodes once the job runs

    def run_probe(self, loaded: LoadedSpec, spec_path: Path, probe: RunFile, args: Sequence[str], sink: Sink, *,
                  env: Mapping[str, str], emit: Callable[[str, str], None], run_id: str,
                  seconds: float) -> None:  # fmt: skip
        """The probe as a job of its own (one allocation, no preflight step): never requeued, no
        time-limit signal, a time limit of its own (start-up and the budget, not the training's
        hours), and none of sbatch_extra's waits (begin, dependency, hold)."""
        s = loaded.spec
        once = None
        if s.slurm is not None:
            waits = ("begin", "dependency", "hold")
            extra = {k: v for k, v in s.slurm.sbatch_extra.items() if k.removeprefix("--") not in waits}
            once = s.slurm.model_copy(update={"max_requeues": 0, "signal": None, "sbatch_extra": extra,
                                              "time": str(max(10, math.ceil((seconds + 300) / 60)))})  # fmt: skip
        job_loaded = dataclasses.replace(loaded, spec=s.model_copy(update={"slurm": once}))
        files = {**run_files(job_loaded), probe.name: probe.content, slurm.RUN_ENV: slurm.env_lines(env)}
        job = submit_run(job_loaded, spec_path, [probe.name, *args], files, sink, run_id, "a measurement",
                         in_run_dir=True)  # fmt: skip
        to_emit = Emitting(sink, emit)
        with sigterm_as_interrupt():
            st = follow(job, to_emit, cancel_on_interrupt=True)
        verdict(job, st, to_emit)

    def status(self, job: store.Job, sink: Sink) -> None:
        st = slurm.poll(login_for(job), job.run_id, slurm_id(job), {}, max_bytes=0)
        remember(job, st)
        if st.forgotten and last_state_of(job) in slurm.TERMINAL and st.result is None:
            st.state = last_state_of(job)  # Slurm has forgotten it: the last (final) state seen here
        sink.out(f"job {slurm_id(job):10} {slurm.describe(st)}")
        for line in [*slurm.attempt_lines(st), *slurm.restart_lines(st)]:
            sink.out(f"  {line}")
        # each fault's timeline and the goodput (the culprit the kept verdict named, where the logs did)
        kept = store.read_verdict(job.dir)
        for line in store.timeline_lines(slurm.timeline_result(st, kept.first_failure if kept else None)):
            sink.out(f"  {line}")
        if st.error or (st.state and st.state not in slurm.LIVE and st.state != "COMPLETED"):
            raise ExitWith(EXIT_FAILURE)
        if not st.state and slurm.exit_code(st) != 0:
            raise ExitWith(EXIT_FAILURE)

    def logs(self, job: store.Job, follow_: bool, sink: Sink) -> None:
        if follow_:
            st = follow(job, sink, cancel_on_interrupt=False)
            verdict(job, st, sink)
            return
        slurm.Follower(login_for(job), job.run_id, slurm_id(job), sink.line).step(whole=True)

    def stop(self, job: store.Job, sink: Sink) -> None:
        t = time.monotonic()
        st, how = cancel(job)
        sink.out(f"job {slurm_id(job):10} {slurm.describe(st)}")
        if st.error or (st.state and st.state not in slurm.TERMINAL):
            raise ExitWith(EXIT_FAILURE, f"run {job.run_id}: job {slurm_id(job)} not confirmed stopped ({how})")
        sink.note(f"run {job.run_id}: job {slurm_id(job)} {how} in {time.monotonic() - t:.1f}s")

    def stacks(self, job: store.Job, native: bool, method: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        return take_stacks(job, native, method)

    def run_state(self, job: store.Job, connect_timeout: int | None = None) -> RunState:
        """A Slurm run's state from squeue/scontrol on its login node (or the last one seen there)."""
        try:
            st = slurm.poll(login_for(job, connect_timeout), job.run_id, slurm_id(job), {}, max_bytes=0)
        except slurm.SlurmError as e:  # ssh's words are in it: a login node never reached says so
            return RunState("unreachable", str(e), reached=not transport.not_reached(str(e)))
        if st.error:
            return RunState("unreachable", f"Slurm job {slurm_id(job)}: {st.error}")
        if st.forgotten and st.result is not None and not st.result.get("requeued"):
            # Slurm forgot it (MinJobAge); the batch script's own result says how it ended
            keep_found(job, st, slurm.exit_code(st))
            return RunState(slurm.outcome(st), f"Slurm job {slurm_id(job)}: {slurm.describe(st)}",
                            slurm.exit_code(st), True)  # fmt: skip
        state = st.state or (last_state_of(job) if last_state_of(job) in slurm.TERMINAL else "")
        if not state:  # forgotten, with neither a final state seen nor a result: it ended, how is lost
            return RunState("gone", f"Slurm job {slurm_id(job)}: ended; Slurm has forgotten how (no result.json)")
        final = slurm.outcome(dataclasses.replace(st, state=state)) if state in slurm.TERMINAL or st.settled else ""
        out = RunState(final or _RUN_STATES.get(state, "failed"),
                       f"Slurm job {slurm_id(job)}: {slurm.describe(st) if st.state else state}")  # fmt: skip
        if out.state in ("ok", "failed", "stopped", "hung"):
            out.exit_code = slurm.exit_code(dataclasses.replace(st, state=state))
            out.verdict = True
            keep_found(job, dataclasses.replace(st, state=state), out.exit_code)
        return out
