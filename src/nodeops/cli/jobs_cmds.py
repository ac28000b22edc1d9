"""`nodeops status`, `nodeops logs`, `nodeops stop`: find a launched run again by its id."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from nodeops.cli.app import app, err, errors
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
