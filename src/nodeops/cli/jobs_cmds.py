"""`nodeops status`, `nodeops logs`, `nodeops stop`: find a launched run again by its id."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from nodeops.cli.app import app, err, errors
from nodeops.errors import EXIT_FAILURE

RunArg = Annotated[
    str | None, typer.Argument(help="Run id printed by `nodeops launch` (default: the latest run).", show_default=False)
]


def emit_line(host: str, line: str) -> None:
    """One log line as `host [rankN]:...` (torchrun's rank lines) or `host | ...` (anything else)."""
    sys.stdout.write(f"{host} {line}\n" if line.startswith("[") else f"{host} | {line}\n")
    sys.stdout.flush()


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
        bad = [h for h, s in states.items() if s not in ("running", "exited 0")]
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
        if follow:
            res = jobs.follow(job.ssh_config, job.hosts, job.run_id, emit_line, stop_on_failure=False)
            raise typer.Exit(res.exit_code)
        for host, lines in jobs.read_logs(job).items():
            for line in lines:
                emit_line(host, line)


@app.command(epilog="Example:\n\n    nodeops stop 20261122-101500-ab12")
def stop(run_id: RunArg = None) -> None:
    """Stop every rank of a run on every host (SIGTERM to its process group, then SIGKILL)."""
    from nodeops import jobs

    with errors():
        job = jobs.find(run_id)
        jobs.teardown(job.ssh_config, job.hosts, job.run_id)
        states = jobs.host_states(job)
        for host, state in states.items():
            typer.echo(f"{host:12} {state}")
        left = [h for h, s in states.items() if s == "running"]
        if left:
            err(f"still running on {', '.join(left)}")
            raise typer.Exit(EXIT_FAILURE)
        err(f"run {job.run_id} stopped on {len(states)} host(s)")
