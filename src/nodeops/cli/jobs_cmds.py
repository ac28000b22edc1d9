"""`nodeops status`, `nodeops logs`, `nodeops stop`: find a launched run again by its id."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Annotated

import typer

from nodeops.cli.app import app, err, errors, fail
from nodeops.errors import EXIT_FAILURE

RunArg = Annotated[
    str | None, typer.Argument(help="Run id printed by `nodeops launch` (default: the latest run).", show_default=False)
]


_RANK_PREFIX = re.compile(r"\[rank\d+\]:")


def emit_line(host: str, line: str) -> None:
    """One log line as `host [rankN]:...` (torchrun's rank lines) or `host | ...` (anything else)."""
    sys.stdout.write(f"{host} {line}\n" if _RANK_PREFIX.match(line) else f"{host} | {line}\n")
    sys.stdout.flush()


def emitter(rank_hosts: list[str], pdsh_hosts: dict[str, str] | None = None) -> Callable[[str, str], None]:
    """emit_line, plus: for mpirun (all output arrives on the chief, tagged `[job,rank]<stdout>:`)
    the rank's own host and a `[rankN]:` prefix, like torchrun's lines; for deepspeed (pdsh
    prefixes each node's lines with `ADDRESS: `) the node's own host name."""
    from nodeops.jobs import mpi_pieces, pdsh_split

    if not rank_hosts and not pdsh_hosts:
        return emit_line
    pending: dict[int, str] = {}

    def emit(host: str, line: str) -> None:
        head, pieces = mpi_pieces(line) if rank_hosts else ("", [])
        if pieces:
            # Open MPI tags every chunk a rank writes, so one physical line can hold the pieces of
            # several ranks' lines ("[1,1]<stdout>:a[1,0]<stdout>:b"); the newline that ends the
            # physical line belongs to its last piece. Reassemble each rank's lines.
            if head:
                emit_line(host, head)
            for n, (rank, text) in enumerate(pieces):
                pending[rank] = pending.get(rank, "") + text
                if n == len(pieces) - 1:
                    out = pending.pop(rank)
                    emit_line(rank_hosts[rank] if rank < len(rank_hosts) else host, f"[rank{rank}]:{out}")
            return
        prefixed = pdsh_split(line, pdsh_hosts or {})
        if prefixed is not None:
            emit_line((pdsh_hosts or {})[prefixed[0]], prefixed[1])
            return
        emit_line(host, line)

    return emit


@app.command(epilog="Example:\n\n    nodeops status 20261122-101500-ab12")
def status(run_id: RunArg = None) -> None:
    """Show each host's job state: running, exited CODE, killed or unreachable.

    Exit 0 while every host is running or exited 0; 1 when any host failed, was killed or
    cannot be reached.
    """
    from nodeops import jobs

    with errors():
        job = jobs.find(run_id)
        if job.backend == "slurm":
            from nodeops.cli import slurm_cmds

            slurm_cmds.status(job)
            return
        states = jobs.host_states(job)
        for host, state in states.items():
            typer.echo(f"{host:12} {state}")
        verdict = jobs.fetch_result(job.ssh_config, job.chief, job.run_id, wait=0)
        if verdict is not None:
            err(f"run {job.run_id}: {jobs.describe(verdict)}")
        bad = [h for h, s in states.items() if not (s.startswith("running") or s in ("exited 0", "idle"))]
        if bad:
            err(f"run {job.run_id}: not ok on {', '.join(bad)}")
            raise typer.Exit(EXIT_FAILURE)


@app.command(epilog="Examples:\n\n    nodeops logs 20261122-101500-ab12\n\n    nodeops logs -f")
def logs(
    run_id: RunArg = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep streaming until the job ends.")] = False,
) -> None:
    """Print every host's log, each line prefixed with host and rank; `-f` streams until the end."""
    from nodeops import jobs

    with errors():
        job = jobs.find(run_id)
        if job.backend == "slurm":
            from nodeops.cli import slurm_cmds

            slurm_cmds.logs(job, follow)
            return
        emit = emitter(job.rank_hosts, job.pdsh_hosts)
        if follow:
            res = jobs.follow(job.ssh_config, job.hosts, job.run_id, emit, chief=job.chief, stop_on_interrupt=False,
                              kill_hosts=job.kill_hosts, rank_hosts=job.rank_hosts)  # fmt: skip
            if res.interrupted:
                err(f"==> stopped following; run {job.run_id} goes on (nodeops stop {job.run_id} stops it)")
            raise typer.Exit(res.exit_code)
        for host, lines in jobs.read_logs(job).items():
            for line in lines:
                emit(host, line)


@app.command(epilog="Example:\n\n    nodeops stop 20261122-101500-ab12")
def stop(run_id: RunArg = None) -> None:
    """Stop every rank of a run on every host (SIGTERM to its process group, then SIGKILL)."""
    from nodeops import jobs

    with errors():
        job = jobs.find(run_id)
        if job.backend == "slurm":
            from nodeops.cli import slurm_cmds

            slurm_cmds.stop(job)
            return
        ended = jobs.fetch_result(job.ssh_config, job.chief, job.run_id, wait=0)
        if ended is not None:
            err(f"run {job.run_id} had already ended ({jobs.describe(ended)}); confirming nothing is left")
        # The supervisor stops every host and records the run as stopped; kill on every host then
        # confirms (and does it alone when the chief cannot be reached).
        elif jobs.request_stop(job.ssh_config, job.chief, job.run_id):
            jobs.fetch_result(job.ssh_config, job.chief, job.run_id, wait=15)
        problems = {h: why for h, why in jobs.teardown(job.ssh_config, job.kill_hosts, job.run_id).items() if why}
        states = jobs.host_states(job)
        for host, state in states.items():
            typer.echo(f"{host:12} {state}" + (f"  ({problems[host]})" if host in problems else ""))
        left = [h for h, s in states.items() if s.startswith("running")]
        if left or problems:
            err(f"run {job.run_id}: not confirmed stopped on {', '.join(dict.fromkeys([*left, *problems]))}")
            raise typer.Exit(EXIT_FAILURE)
        err(f"run {job.run_id}: nothing of it is left running on {len(states)} host(s)"
            + ("" if ended is not None else "; stopped"))  # fmt: skip


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "?"


@app.command(
    epilog="Examples:\n\n    nodeops runs\n\n    nodeops runs --json | jq '.[] | select(.state==\"failed\")'"
    "\n\n    nodeops runs --local   # no ssh: only what this machine recorded"
)
def runs(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="No ssh: runs without a verdict here show as unknown.")
    ] = False,
) -> None:
    """List the runs launched from this machine, newest first: id, state, exit code, runner,
    hosts, start time and spec.

    A run's state comes from its supervisor's verdict (ok, failed, stopped), kept here once known;
    for the others one ssh to each run's chief says whether it still runs. `gone`: the chief has
    no trace of it; `unreachable`: its chief did not answer.
    """
    import json

    from nodeops import runs as R

    with errors():
        found = R.local_runs()
        if not local:
            R.refresh(found)
        if as_json:
            typer.echo(json.dumps([r.row() for r in found], indent=2))
            return
        if not found:
            err("no runs launched from this machine yet (nodeops launch SPEC train.py starts one)")
            return
        typer.echo(f"{'RUN ID':20} {'STATE':11} {'EXIT':>4}  {'RUNNER':9} {'HOSTS':>5}  {'STARTED':16}  SPEC")
        for r in found:
            j = r.job
            code = "" if r.exit_code is None else str(r.exit_code)
            typer.echo(f"{j.run_id:20} {r.state:11} {code:>4}  {j.runner:9} {len(j.kill_hosts):>5}  "
                       f"{_when(j.started):16}  {j.spec}")  # fmt: skip


@app.command(
    epilog="Examples:\n\n    nodeops clean --older-than 7d --dry-run\n\n    nodeops clean --keep 20"
    "\n\n    nodeops clean --all"
)
def clean(
    older_than: Annotated[
        str | None, typer.Option(metavar="AGE", help="Only runs started longer ago than AGE: 30m, 12h, 7d, 2w.")
    ] = None,
    keep: Annotated[
        int | None,
        typer.Option(metavar="N", min=0, help="Keep the newest N runs (running ones count), and N artifact dirs."),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every finished run.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Say what would be removed; remove nothing (it still asks chiefs for states)."),
    ] = False,
    forget_unreachable: Annotated[
        bool,
        typer.Option(
            "--forget-unreachable",
            help="Also drop the records here of chosen runs whose hosts do not answer (a cluster that "
            "is gone): runs with a verdict, and runs without one started over a day ago. Their dirs on "
            "those hosts are not touched.",
        ),
    ] = False,
) -> None:
    """Remove finished runs: their dirs on every host of the run, their records here, and the
    playbook artifacts of setup/check runs (~/.nodeops/runs).

    A run that is running, or whose chief cannot be reached, is never touched; on each host a
    run dir is removed only when no process of that run is alive there. A run whose dirs could
    not all be removed keeps its record here, so a later clean retries it.
    """
    from nodeops import runs as R
    from nodeops.runner import runs_dir

    with errors():
        if older_than is None and keep is None and not all_:
            fail("error: say what to remove: --older-than AGE, --keep N or --all (add --dry-run to preview)", 2)
        age = R.parse_duration(older_than) if older_than is not None else None
        found = R.local_runs()
        R.refresh(found)
        chosen = R.choose(found, older_than=age, keep=keep)
        forget = [r for r in R.choose(found, older_than=max(age or 0, 86400), keep=keep, states=("unreachable",))
                  if forget_unreachable]  # fmt: skip
        arts = R.choose_artifacts(R.artifact_dirs(runs_dir()), older_than=age, keep=keep)
        for r in found:  # what is kept whatever the criteria, and why
            if r in chosen or r in forget or r.state == "unreachable":
                continue
            if r.state not in R.FINISHED:
                err(f"keep   {r.job.run_id}  {r.state}: {r.detail or 'no verdict'}")
            elif not r.verdict and time.time() - r.job.started < R.INFERRED_MIN_AGE:
                err(f"keep   {r.job.run_id}  {r.state}: no verdict, and started under "
                    f"{R.INFERRED_MIN_AGE / 60:.0f} min ago (a launch may still be starting it)")  # fmt: skip
        unreachable = [r for r in found if r.state == "unreachable" and r not in forget]
        if unreachable:
            err(f"keep   {len(unreachable)} run(s) whose chief did not answer (e.g. {unreachable[0].detail}); "
                "--forget-unreachable drops their records here")  # fmt: skip
        verb = "would remove" if dry_run else "remove"
        for r in chosen:
            err(f"{verb} {r.job.run_id}  {r.state:8} {_when(r.job.started)}  {R.human_size(r.size)} here, "
                f"and its dir on {', '.join(r.job.kill_hosts)}")  # fmt: skip
        if forget:
            err(f"{'would forget' if dry_run else 'forget'} {len(forget)} unreachable run(s) (records here only)")
        art_size = sum(a.size for a in arts)
        if arts:
            err(f"{verb} {len(arts)} playbook artifact dir(s) in {runs_dir()} ({R.human_size(art_size)})")
        if dry_run:
            err(f"dry run: {len(chosen) + len(forget)} run(s) and {len(arts)} artifact dir(s) would be removed; "
                "nothing was")  # fmt: skip
            return
        done = R.remove(chosen, forget_unreachable)
        freed = done.freed + art_size + R.forget(forget)
        for a in arts:
            R.rmtree(a.path)
        for run_id, why in done.problems.items():
            err(f"kept   {run_id}: " + "; ".join(why))
        err(f"removed {len(done.removed_local) + len(forget)} run(s) and {len(arts)} artifact dir(s); "
            f"freed {R.human_size(freed)} here")  # fmt: skip
        if done.problems:
            raise typer.Exit(EXIT_FAILURE)
