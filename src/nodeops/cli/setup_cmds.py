"""`nodeops setup`: render the spec, then run the roles through ansible-runner with live progress."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated

import typer

from nodeops.cli.app import ConsoleSink, GroupOpt, SpecArg, app, err, errors, fail
from nodeops.errors import EXIT_FAILURE
from nodeops.lifecycle.setup import PHASE_TAGS, ROLE_TAGS, SetupRequest
from nodeops.lifecycle.setup import setup as run_setup

if TYPE_CHECKING:
    from nodeops.setup.runner import HostResult, RunResult


def _progress_table(results: dict[str, HostResult]) -> object:
    from rich.table import Table

    table = Table(title="nodeops setup", title_justify="left", expand=False)
    for col in ("host", "ok", "changed", "failed", "current task"):
        table.add_column(col)
    for hr in results.values():
        state = "[red]failed[/]" if hr.errors else ""
        table.add_row(hr.host, str(hr.ok), str(hr.changed), state, hr.task)
    return table


def print_summary(result: RunResult, title: str, verbose: int = 0) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if verbose:  # Ansible's own output (its verbosity follows -v)
        for out in sorted(result.private_data_dir.glob("artifacts/*/stdout")):
            console.print(out.read_text(errors="replace"), highlight=False, markup=False, end="")
    for hr in result.hosts.values():
        for d in hr.diffs:
            console.print(f"[bold]{hr.host}[/]: {d}", highlight=False, end="")
    table = Table(title=f"{title}: {result.seconds:.1f}s", title_justify="left")
    for col in ("host", "ok", "changed", "failed", "unreachable", "skipped", "status"):
        table.add_column(col)
    for hr in result.hosts.values():
        if not hr.in_play:
            continue
        color = {"ok": "green", "failed": "red", "unreachable": "red"}[hr.status]
        table.add_row(hr.host, str(hr.ok), str(hr.changed), str(hr.failed), str(hr.unreachable), str(hr.skipped),
                      f"[{color}]{hr.status}[/]")  # fmt: skip
    console.print(table)
    for hr in result.hosts.values():
        for w in hr.warnings:
            console.print(f"[yellow]{hr.host}[/]: warning: {w}", highlight=False)
        for e in hr.errors:
            console.print(f"[red]{hr.host}[/]: {e}", highlight=False)
    left_out = [hr.host for hr in result.hosts.values() if not hr.in_play]
    if left_out:
        console.print(f"not run on (--limit): {', '.join(left_out)}", highlight=False)
    if not result.ansible:
        console.print("no Ansible play ran: every role on every node is as setup left it (ok: the roles the probe "
                      "read); `setup --full` runs them anyway", highlight=False)  # fmt: skip
        return
    console.print(f"artifacts: {result.private_data_dir}", highlight=False)


@app.command(
    epilog=(
        "Examples:\n\n    nodeops setup cluster.yaml\n\n    nodeops setup cluster.yaml --check --diff\n\n"
        "    nodeops setup cluster.yaml --limit node2 --tags python_env\n\n"
        "    nodeops setup cluster.yaml --full   # every role on every node, even where nothing differs\n\n"
        "    nodeops setup inventories/prod/hosts.yml --group gpu_nodes   # an Ansible inventory"
    )
)
def setup(
    spec: SpecArg,
    check: Annotated[
        bool, typer.Option("--check", help="Dry run: report what would change (Ansible check mode).")
    ] = False,
    diff: Annotated[bool, typer.Option("--diff", help="Show file changes.")] = False,
    limit: Annotated[
        str | None, typer.Option(metavar="HOSTS", help="Only these hosts (comma-separated spec names or addresses).")
    ] = None,
    tags: Annotated[
        list[str] | None,
        typer.Option(
            "--tags",
            metavar="TAG",
            help=f"Only these roles: {', '.join(ROLE_TAGS)}; or phases: {', '.join(PHASE_TAGS)} "
            "(repeat the option, or comma-separate).",
        ),
    ] = None,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="Run every role on every node. Without it, a plain setup first probes every node (one read-only "
            "ssh each) and runs only the roles, on only the nodes, that differ from what the last setup recorded.",
        ),
    ] = False,
    verbose: Annotated[int, typer.Option("-v", count=True, help="Ansible verbosity (repeat for more).")] = 0,
    group: GroupOpt = None,
) -> None:
    """Prepare every node: ssh mesh, Python env, shared workdir, NCCL/Gloo env, DeepSpeed files.

    Renders the spec, then runs the roles through ansible-runner, showing each host's current
    task, then a summary. Exit 0 only if no host failed or was unreachable; the other hosts
    still complete, and re-running converges. A second run reports changed=0.

    After a successful setup, each node's state is recorded per role. A later plain setup
    probes every node at once and runs Ansible only for what differs (a changed spec, env file,
    key line, package or workdir file); with nothing to do it runs no play at all. --check,
    --diff, --tags, --limit and --full always run Ansible.
    """
    from rich.console import Console
    from rich.live import Live

    with errors():
        request = SetupRequest(spec, group, [t for item in (tags or []) for t in item.split(",") if t], limit, check,
                               diff, verbose, full)  # fmt: skip
        cancel = threading.Event()
        with Live(console=Console(stderr=True), refresh_per_second=4, transient=True) as live:

            def update(results: dict[str, HostResult]) -> None:
                live.update(_progress_table(results))  # type: ignore[arg-type]

            try:
                result = run_setup(request, ConsoleSink(), on_update=update, cancel=cancel)
            except KeyboardInterrupt:
                cancel.set()
                raise
        print_summary(result, "setup (check mode)" if check else "setup", verbose)
        if not result.ok:
            where = ", ".join(result.bad_hosts) or "the controller"
            fail(f"setup failed on {where} (ansible status {result.status}, rc {result.rc})", EXIT_FAILURE)
        ran = [h for h in result.hosts.values() if h.in_play]
        err(
            f"setup ok: {len(ran)} host(s), {result.changed} change(s)"
            + (" (check mode: none made)" if check else "")
            + (f" ({len(result.hosts) - len(ran)} left out by --limit)" if len(ran) < len(result.hosts) else "")
        )
