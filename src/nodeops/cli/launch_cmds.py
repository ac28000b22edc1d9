"""`nodeops launch` and `nodeops runner-prefix`."""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from nodeops.cli.app import CONTEXT, GroupOpt, SpecArg, app, err, errors, fail
from nodeops.errors import EXIT_FAILURE, EXIT_SPEC

if TYPE_CHECKING:
    from nodeops.launchers import HostLaunch
    from nodeops.spec import LoadedSpec, ResourceSpec
    from nodeops.starter import RunFile


class Via(enum.StrEnum):
    ssh = "ssh"
    ansible = "ansible"


class ScriptCommand(TyperCommand):
    """torchrun's and deepspeed's convention: options before the training script are nodeops',
    the script and everything after it are the script's; `--` before the script is optional.
    An unknown option before the script is an error (exit 2), never passed on silently."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # typer vendors its own click: look at the params' kind, not at a click class
        takes_value = {o for p in self.params if p.param_type_name == "option" and not getattr(p, "is_flag", False)
                       for o in p.opts}  # fmt: skip
        head, tail = list(args), []
        positionals, i = 0, 0
        while i < len(args):
            a = args[i]
            if a == "--":
                head, tail = args[:i], args[i + 1 :]
                break
            if a.startswith("-") and a != "-":
                i += 2 if a in takes_value else 1
                continue
            positionals += 1
            if positionals == 2:  # SPEC, then the script
                head, tail = args[:i], args[i:]
                break
            i += 1
        rest = super().parse_args(ctx, head)
        ctx.args = [*rest, *tail]
        return list(ctx.args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[--] SCRIPT [ARGS]..."]


@app.command(
    cls=ScriptCommand,
    context_settings={**CONTEXT, "allow_extra_args": True},
    epilog=(
        "Examples:\n\n    nodeops launch cluster.yaml train.py --lr 1e-3\n\n"
        "    nodeops launch --detach cluster.yaml -- train.py --lr 1e-3   # `--` is optional\n\n"
        "    nodeops launch cluster.yaml --script run.sh -- --epochs 2   # run.sh calls $NODEOPS_RUNNER train.py\n\n"
        "    nodeops launch --dry-run cluster.yaml train.py   # each host's command, env and files; starts nothing\n\n"
        "    nodeops launch --fabric-check cluster.yaml train.py   # measure the links first; a slow node stops it\n\n"
        "    nodeops launch aws_ec2.yml --group gpu -- train.py   # an Ansible inventory (here a plugin config)\n\n"
        "    nodeops launch slurm.yaml --attach -- train.py   # backend: slurm: sbatch, then follow the job"
    ),
)
def launch(
    ctx: typer.Context,
    spec: SpecArg,
    script: Annotated[
        str | None, typer.Option(help="A bash script (in the workdir) that calls $NODEOPS_RUNNER train.py ...")
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Return once every host has started; see `nodeops status/logs/stop`.")
    ] = False,
    via: Annotated[
        Via, typer.Option(help="How to start the jobs: one ssh per host (like pdsh), or the launch.yml playbook.")
    ] = Via.ssh,
    no_check: Annotated[
        bool, typer.Option("--no-check", help="Skip the preflight (ssh from the chief, ports, version parity).")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print each host's command line, environment (secrets masked), working dir and the "
            "files that would be shipped; start nothing, reach no host.",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="On a failure, also print torchrun's failure report.")
    ] = False,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync",
            help="First copy the workdir source to the nodes that differ (setup's "
            "shared_path role; outputs on the nodes are kept).",
        ),
    ] = False,
    fabric_check: Annotated[
        bool,
        typer.Option(
            "--fabric-check",
            help="Before starting, run `check --fabric`'s measurement (30 s budget); start nothing if a "
            "node is slow or a network.fabric threshold fails.",
        ),
    ] = False,
    attach: Annotated[
        bool,
        typer.Option(
            "--attach",
            help="Slurm: follow the job's logs until it ends (Ctrl-C cancels it); "
            "without it, launch returns once sbatch has taken the job.",
        ),
    ] = False,
    group: GroupOpt = None,
) -> None:
    """Start training on every host: torchrun per host, or mpirun/deepspeed from the chief.

    Every line of every rank is streamed live as `host [rankN]: ...`. If any rank fails, every
    rank on every host is stopped (SIGTERM to the job's process group, then SIGKILL to whatever
    still carries the run's id) and the exit code is the failing rank's; the first failing
    host is named with its last lines. Ctrl-C stops everything and exits 130. Options before
    the script are nodeops'; the script and every argument after it reach the script literally.
    """
    from nodeops import gpus
    from nodeops.render import require_controller_files
    from nodeops.spec import load_spec

    user_argv = list(ctx.args)
    if user_argv[:1] == ["--"]:
        user_argv = user_argv[1:]
    with errors():
        loaded = gpus.resolved(load_spec(spec, group), required=not dry_run)  # gpus: auto, as setup found them
        require_controller_files(loaded)
        if not user_argv and script is None:
            fail("error: nothing to run; give the training script, e.g. train.py", EXIT_SPEC)
        if loaded.spec.on_slurm:
            from nodeops.cli import slurm_cmds

            # --detach is what a Slurm launch does anyway; --attach follows the job
            slurm_cmds.refuse_options(**{"--script": script is not None, "--via ansible": via != Via.ssh,
                                         "--fabric-check": fabric_check,
                                         "--detach with --attach": detach and attach})  # fmt: skip
            if dry_run:
                slurm_cmds.dry_run(loaded, user_argv)
                return
            if sync:
                sync_workdir(loaded)
            slurm_cmds.launch(loaded, spec, user_argv, attach=attach)
            return
        if attach:
            fail("error: --attach is for backend: slurm (an ssh launch follows its logs unless --detach)", EXIT_SPEC)
        if dry_run:
            for w in loaded.warnings:
                err(str(w))
            show_dry_run(loaded, user_argv, script, sync)
            return
        if sync:
            sync_workdir(loaded)
        if not no_check:
            preflight(loaded, script_file(user_argv, script))
        if fabric_check:
            fabric_gate(loaded, spec)
        run_job(loaded, spec, user_argv, script=script, via=via, detach=detach, verbose=verbose)


def run_job(
    loaded: LoadedSpec,
    spec_path: Path,
    user_argv: list[str],
    *,
    script: str | None = None,
    via: Via = Via.ssh,
    detach: bool = False,
    verbose: bool = False,
    extra_files: Sequence[RunFile] = (),
    extra_env: Mapping[str, str] | None = None,
    emit: Callable[[str, str], None] | None = None,
    run_id: str | None = None,
) -> None:
    """Start a run on every host and, unless ``detach``, follow it to its end: returns when every
    host exited 0, else raises typer.Exit with the run's exit code (after naming the first
    failing host). ``extra_files`` go into each job host's run dir (ssh transport only: the
    launch role renders its own files), ``extra_env`` into each job's env (after env.sh);
    `check --fabric` ships its probe so. ``emit`` replaces the prefixed printing of each log
    line; ``run_id`` is a fresh one (jobs.new_run_id) chosen by the caller, when its argv must
    name the run dir."""
    import dataclasses

    from nodeops import _launch_plan, jobs, launchers, starter
    from nodeops.cli.jobs_cmds import emitter
    from nodeops.render import inventory, ssh_config
    from nodeops.runner import run_playbook

    if extra_files and via != Via.ssh:
        raise ValueError("extra_files need the ssh transport")
    s = loaded.spec
    run_id = run_id or jobs.new_run_id()
    local = jobs.jobs_dir() / run_id
    local.mkdir(mode=0o700)
    (local / "ssh_config").write_text(ssh_config(loaded))
    plan = launch_plan(loaded, user_argv, run_id, script)
    if extra_env:
        plan = [dataclasses.replace(h, env={**h.env, **extra_env}) if h.argv else h for h in plan]
    started = [h.host for h in plan if h.argv]
    all_hosts = [h.host for h in plan]
    addresses = {n.address: s.alias(n) for n in s.nodes}
    rank_hosts = launchers.rank_hosts(s) if s.launch.runner == "mpirun" else []  # mpirun's tagged lines
    pdsh_hosts = addresses if s.launch.runner == "deepspeed" else {}  # pdsh's address prefixes
    chief = s.alias(s.chief)
    job = jobs.Job(run_id=run_id, dir=local, hosts=started, argv=user_argv, runner=s.launch.runner, chief=chief,
                   spec=str(spec_path.resolve()), started=time.time(), rank_hosts=rank_hosts,
                   all_hosts=all_hosts, pdsh_hosts=pdsh_hosts)  # fmt: skip
    # `nodeops clean` leaves a run alone while this process starts it (until the supervisor runs)
    (local / "starting").write_text(f"{os.getpid()}\n")
    job.save()
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt():
            # announced inside the block: a Ctrl-C right after this line still stops what started
            err(f"==> run {run_id}: starting {s.launch.runner} on {', '.join(started)} (via {via.value})")
            run_config = _launch_plan.run_config(run_id, supervised_hosts(s, started), s.launch.runner,
                                                 s.launch.max_restarts)  # fmt: skip
            run = starter.run_vars(loaded, plan, run_id, run_config)
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
        with jobs.ignoring_interrupts():
            left = jobs.teardown(local / "ssh_config", all_hosts, run_id)
        fail(f"==> run {run_id} interrupted while starting; {teardown_summary(left)}", 130)
    if bad:
        for host, why in bad.items():
            err(f"{host}: {why}")
        with jobs.ignoring_interrupts():
            left = jobs.teardown(local / "ssh_config", all_hosts, run_id)
        fail(f"launch failed on {', '.join(bad)}; {teardown_summary(left)}", EXIT_FAILURE)
    (local / "starting").unlink(missing_ok=True)  # the supervisor runs: it has the run's verdict
    if detach:
        err(f"==> started in {time.monotonic() - t0:.1f}s; detached")
        err(f"    nodeops status {run_id}  |  nodeops logs {run_id} -f  |  nodeops stop {run_id}")
        typer.echo(run_id)
        return
    err(f"==> started in {time.monotonic() - t0:.1f}s; following logs (Ctrl-C stops every rank)")
    emit = emit or emitter(rank_hosts, pdsh_hosts)
    try:
        res = jobs.follow(local / "ssh_config", started, run_id, emit, chief=chief, kill_hosts=all_hosts,
                          addresses=addresses, rank_hosts=rank_hosts)  # fmt: skip
    except KeyboardInterrupt:  # in the instant before follow() took over Ctrl-C
        with jobs.ignoring_interrupts():
            jobs.request_stop(local / "ssh_config", chief, run_id)
            left = jobs.teardown(local / "ssh_config", all_hosts, run_id)
        fail(f"==> run {run_id} interrupted; {teardown_summary(left)}", 130)
    (local / "result.json").write_text(json.dumps({
        "hosts": {h: {"exit_code": st.exit_code, "lost": st.lost_reason} for h, st in res.hosts.items()},
        "supervisor": res.supervisor,
    }))  # fmt: skip
    if res.interrupted:
        how = "stopped on request (nodeops stop)" if res.stopped_elsewhere else "interrupted"
        fail(f"==> run {run_id} {how}; {teardown_summary(res.teardown_problems)}", res.exit_code)
    if res.root_cause is not None:
        rc = res.root_cause
        code = jobs.failure_code(rc)
        why = f"exit code {code}" if code else rc.lost_reason
        own, summary = jobs.failure_lines(rc.tail)
        err(f"==> run {run_id} FAILED: first failure on {rc.host} ({why}); its last lines:")
        for line in own + (summary if verbose or not own else []):
            err(f"    {rc.host} {line}")
        if summary and own and not verbose:
            err(f"    ({len(summary)} more lines of torchrun's failure report: -v shows them, "
                f"as does `nodeops logs {run_id}`)")  # fmt: skip
        if res.teardown_seconds is not None:
            err(f"==> the supervisor stopped every other rank in {res.teardown_seconds:.1f}s; "
                f"{teardown_summary(res.teardown_problems)}")  # fmt: skip
        else:
            err(f"==> {teardown_summary(res.teardown_problems)}")
        raise typer.Exit(res.exit_code)
    if res.teardown_problems:
        fail(f"==> run {run_id}: every host exited 0, but {teardown_summary(res.teardown_problems)}", EXIT_FAILURE)
    err(f"==> run {run_id} finished: every host exited 0")


def fabric_gate(loaded: LoadedSpec, spec_path: Path) -> None:
    """`launch --fabric-check`: the fabric measurement first; nothing starts unless it passes."""
    from nodeops.cli.check_cmds import FabricError, run_fabric
    from nodeops.fabric import print_report

    try:
        report = run_fabric(loaded, spec_path, 30)
    except FabricError as e:
        fail(f"--fabric-check: {e}; nothing was started", EXIT_FAILURE)
    print_report(report, stderr=True)  # stdout is the job's (and, detached, the run id)
    if not report.ok:
        fail(f"--fabric-check failed ({'; '.join(report.problems)}); nothing was started "
             "(see network.fabric in the README to change the thresholds)", EXIT_FAILURE)  # fmt: skip


def teardown_summary(problems: dict[str, str]) -> str:
    """What a teardown achieved, from kill.sh's own confirmations (never assumed)."""
    bad = {h: why for h, why in problems.items() if why}
    if not bad:
        return "nothing of the run is left running"
    return "NOT confirmed clean on " + "; ".join(f"{h} ({why})" for h, why in bad.items())


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (KeyboardInterrupt) inside the block."""

    def on_term(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_plan(loaded: LoadedSpec, user_argv: list[str], run_id: str, script: str | None) -> list[HostLaunch]:
    """Every host's launch: its command line, node rank and the env launch adds."""
    from nodeops import jobs, launchers

    s = loaded.spec
    ifname = s.network.socket_ifname if s.network.socket_ifname != "auto" else None
    return launchers.plan(
        s, user_argv, run_id, socket_ifname=ifname, env_names=forwarded_env(s), script=script,
        shim_path=f"@@HOME@@/{jobs.remote_dir(run_id)}/mpi_shim.sh",
        hostfile_path=f"@@HOME@@/.nodeops/{loaded.cluster_name}/hostfile",
    )  # fmt: skip


def show_dry_run(loaded: LoadedSpec, user_argv: list[str], script: str | None, sync: bool = False) -> None:
    """`launch --dry-run`: what each host would run, from the same plan and files a launch ships;
    nothing is started and no host is reached (so no preflight)."""
    from nodeops import _launch_plan, jobs, starter
    from nodeops.quoting import sh_word

    s = loaded.spec
    run_id = jobs.new_run_id()
    plan = launch_plan(loaded, user_argv, run_id, script)
    started = [h.host for h in plan if h.argv]
    run_config = _launch_plan.run_config(run_id, supervised_hosts(s, started), s.launch.runner, s.launch.max_restarts)
    files = starter.host_files(loaded, plan, run_id, run_config)

    def home(text: str) -> str:
        return text.replace("@@HOME@@", "~")

    rdir = starter.run_dir(run_id)
    spec_env = [(n, "******" if v.secret else (v.value if v.value is not None else f"${v.from_env} at setup"))
                for n, v in s.env.items()]  # fmt: skip
    nodes = {s.alias(n): n for n in s.nodes}
    err(f"==> dry run of {s.launch.runner} on {len(plan)} host(s); run id would be like {run_id}; nothing is started")
    if sync:
        err("==> --sync would first copy the workdir source to the nodes that differ")
    err("==> a launch would first run the preflight (ssh, ports, versions, workdir, script; --no-check skips it)")
    for h in plan:
        node = nodes[h.host]
        typer.echo(f"{h.host} ({h.address}, node rank {h.node_rank}, {h.nproc} process(es))")
        if not h.argv:
            typer.echo(f"  command:  none here; the chief's {s.launch.runner} starts its ranks")
        else:
            typer.echo(f"  workdir:  {home(starter.job_workdir(loaded, run_id))}")
            typer.echo(f"  command:  {home(' '.join(sh_word(a) for a in h.argv))}")
            typer.echo("  env (launch):")
            for k, v in sorted(starter.job_env(s.launch.runner, h, rdir).items()):
                typer.echo(f"    {k}={home(v)}")
            shared = s.group(node).shared_envs
            if shared or spec_env:
                typer.echo(f"  env (setup wrote these to ~/.nodeops/{loaded.cluster_name}/env.sh, secrets to "
                           "secrets.env, beside the NCCL/Gloo settings):")  # fmt: skip
                for k, v in [*spec_env, *((k, str(v)) for k, v in shared.items())]:
                    typer.echo(f"    {k}={v}")
        shipped = ", ".join(f"{f.name} ({f.mode}, {len(f.content.encode())} B)" for f in files[h.host])
        typer.echo(f"  files to ~/{jobs.remote_dir(run_id)}/: {shipped}")


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
        out.append({"name": name, "address": node.address, "port": group.port, "user": group.username or "",
                    "local": node is spec.chief, "job": name in started})  # fmt: skip
    return out


def sync_workdir(loaded: LoadedSpec) -> None:
    """`launch --sync`: setup's shared_path role alone, on every host."""
    from nodeops.render import inventory
    from nodeops.runner import run_playbook

    wd = loaded.spec.workdir
    if wd is None or wd.sync != "rsync":
        fail("error: --sync copies an rsync workdir; the spec has " + ("no workdir" if wd is None else
             f"workdir.sync: {wd.sync}"), EXIT_SPEC)  # fmt: skip
    t0 = time.monotonic()
    # Connection data only, as for --via ansible: the copy needs no env values.
    result = run_playbook("setup.yml", inventory(loaded, None), kind="sync", tags=["shared_path"])
    if not result.ok:
        for hr in result.hosts.values():
            for e in hr.errors:
                err(f"{hr.host}: {e}")
        fail(f"--sync failed on {', '.join(result.bad_hosts) or 'the controller'}; nothing was started "
             f"(artifacts: {result.private_data_dir})", EXIT_FAILURE)  # fmt: skip
    copied = [h.host for h in result.hosts.values() if h.changed]
    err(
        f"==> workdir synced in {time.monotonic() - t0:.1f}s ("
        + (f"copied to {', '.join(copied)}" if copied else "every node already had the source")
        + ")"
    )


def script_file(user_argv: list[str], script: str | None) -> str | None:
    """The file launch will run in the workdir: --script's, else the training script (not `-m mod`)."""
    if script is not None:
        return script
    return user_argv[0] if user_argv and not user_argv[0].startswith("-") else None


def preflight(loaded: LoadedSpec, script: str | None = None) -> None:
    """`nodeops check`'s fast subset: ssh from the chief, the job's ports, version parity, the
    workdir against the source, and the script present on every node."""
    from nodeops import check

    t0 = time.monotonic()
    report = check.evaluate(
        loaded.spec,
        check.run(loaded, fast=True, timeout=60, script=script),
        fast=True,
        auto_gpus=loaded.discovered_gpus,
    )
    failed = [r for r in report.rows if r.status == "fail"]
    if failed:
        for r in failed:
            err(f"{r.host}: {r.check}: {r.detail}")
        fail(f"preflight failed on {', '.join(dict.fromkeys(r.host for r in failed))}; nothing was started "
             f"(details: nodeops check {loaded.file}; skip with --no-check)", EXIT_FAILURE)  # fmt: skip
    err(f"==> preflight ok in {time.monotonic() - t0:.1f}s (ssh, ports, versions on {len(report.hosts)} hosts)")


@app.command("runner-prefix", epilog="Example:\n\n    nodeops runner-prefix cluster.yaml --host node2")
def runner_prefix(
    spec: SpecArg,
    host: Annotated[str, typer.Option(help="Host name or address from the spec.")],
    run_id: Annotated[str, typer.Option(help="Rendezvous id for c10d.")] = "nodeops",
    group: GroupOpt = None,
) -> None:
    """Print the torchrun launcher prefix for one host (madengine's MAD_MULTI_NODE_RUNNER style).

    Append your script: `$(nodeops runner-prefix c.yaml --host node2) train.py --lr 1e-3`.
    """
    import shlex

    from nodeops import gpus
    from nodeops.launchers import runner_prefix as prefix
    from nodeops.spec import load_spec

    with errors():
        s = gpus.resolved(load_spec(spec, group)).spec
        node = next((n for n in s.nodes if host in (n.address, n.name)), None)
        if node is None:
            names = ", ".join(s.alias(n) for n in s.nodes)
            fail(f"error: --host {host} is not in the spec (hosts: {names})", EXIT_SPEC)
        typer.echo(shlex.join(prefix(s, node, run_id)))
