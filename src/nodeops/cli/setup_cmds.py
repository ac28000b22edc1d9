"""`nodeops setup`: render the spec, then run the roles through ansible-runner with live progress."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Annotated

import typer

from nodeops import backends, gpus, setup_state
from nodeops.cli.app import GroupOpt, SpecArg, app, err, errors, fail
from nodeops.errors import EXIT_FAILURE, EXIT_SPEC
from nodeops.loading import load_spec
from nodeops.render import inventory, require_controller_files, resolve_secrets
from nodeops.runner import run_playbook

if TYPE_CHECKING:
    from nodeops.runner import HostResult, RunResult

ROLE_TAGS = ("ssh_mesh", "python_env", "shared_path", "nccl_env", "deepspeed_env", "packages")
PHASE_TAGS = ("install", "configure", "verify")
# Each role's own input checks (one assert task per role): nodeops has checked the same rules
# on the spec, with line numbers, and the controller's files (render.controller_issues), before
# any host is touched. Infra repos running the roles keep them.
ROLE_INPUT_CHECKS = tuple(f"{r}_preflight" for r in ROLE_TAGS if r != "packages")


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
    console.print(f"artifacts: {result.private_data_dir}", highlight=False)


def resolve_limit(by_name: dict[str, str], limit: str | None) -> list[str] | None:
    """--limit's names or addresses as spec host names (exit 2 naming any unknown one)."""
    if limit is None:
        return None
    by_address = {addr: name for name, addr in by_name.items()}
    out, unknown = [], []
    for item in (i.strip() for i in limit.split(",")):
        name = item if item in by_name else by_address.get(item)
        if name is None:
            unknown.append(item or "''")
        elif name not in out:
            out.append(name)
    if unknown or not out:
        known = ", ".join(f"{n} ({a})" for n, a in by_name.items())
        fail(f"error: --limit: {', '.join(unknown) or 'nothing given'} not in the spec; hosts: {known}", EXIT_SPEC)
    return out


def check_targets(tags: list[str]) -> None:
    bad = [t for t in tags if t not in ROLE_TAGS + PHASE_TAGS]
    if bad:
        fail(f"error: --tags: unknown {', '.join(bad)}; use {', '.join(ROLE_TAGS + PHASE_TAGS)}", EXIT_SPEC)


@app.command(
    epilog=(
        "Examples:\n\n    nodeops setup cluster.yaml\n\n    nodeops setup cluster.yaml --check --diff\n\n"
        "    nodeops setup cluster.yaml --limit node2 --tags python_env\n\n"
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
    verbose: Annotated[int, typer.Option("-v", count=True, help="Ansible verbosity (repeat for more).")] = 0,
    group: GroupOpt = None,
) -> None:
    """Prepare every node: ssh mesh, Python env, shared workdir, NCCL/Gloo env, DeepSpeed files.

    Renders the spec, then runs the roles through ansible-runner, showing each host's current
    task, then a summary. Exit 0 only if no host failed or was unreachable; the other hosts
    still complete, and re-running converges. A second run reports changed=0.
    """
    from rich.console import Console
    from rich.live import Live

    with errors():
        loaded = load_spec(spec, group)
        for w in loaded.warnings:
            err(str(w))
        by_name = {loaded.spec.alias(n): n.address for n in loaded.spec.ranked_nodes()}
        hosts = list(by_name)
        tag_list = [t for item in (tags or []) for t in item.split(",") if t]
        check_targets(tag_list)
        skip = ROLE_INPUT_CHECKS
        backend = backends.for_spec(loaded.spec)
        if backend.setup_skips:
            if any(t in backend.setup_skips for t in tag_list):
                fail(f"error: --tags {', '.join(t for t in tag_list if t in backend.setup_skips)}: not used with "
                     f"backend: {backend.name} (nothing was run)", EXIT_SPEC)  # fmt: skip
            skip = (*skip, *backend.setup_skips)
        limited = resolve_limit(by_name, limit)
        require_controller_files(loaded, os.environ, setup=True, tags=tag_list)
        if gpus.auto_nodes(loaded):  # before rendering: the hostfile's slots and nodeops_gpus need them
            loaded, found = gpus.setup_discover(loaded, limited or None)
            if found:
                said = [f"{h}: {len(ids)} GPU(s)" if ids else f"{h}: no NVIDIA GPU, 1 process"
                        for h, ids in found.items()]  # fmt: skip
                err("==> gpus: auto: " + ", ".join(said))
        inv = inventory(loaded, os.environ)
        chief = hosts[0]
        if limited and chief not in limited and (not tag_list or "ssh_mesh" in tag_list) and "ssh_mesh" not in skip:
            limited.insert(0, chief)
            err(f"note: the chief {chief} joins --limit: ssh_mesh needs its key (use --tags to skip ssh_mesh)")
        limit = ",".join(limited) if limited else None
        secret_values = resolve_secrets(loaded.spec, os.environ)
        console = Console(stderr=True)
        cancel = threading.Event()
        with Live(console=console, refresh_per_second=4, transient=True) as live:

            def update(results: dict[str, HostResult]) -> None:
                live.update(_progress_table(results))  # type: ignore[arg-type]

            try:
                result = run_playbook(
                    "setup.yml", inv, secrets=secret_values, limit=limit, tags=tag_list,
                    skip_tags=skip, check=check, diff=diff, verbosity=verbose,
                    on_update=update, cancel=cancel,
                )  # fmt: skip
            except KeyboardInterrupt:
                cancel.set()
                raise
        print_summary(result, "setup (check mode)" if check else "setup", verbose)
        if not result.ok:
            where = ", ".join(result.bad_hosts) or "the controller"
            fail(f"setup failed on {where} (ansible status {result.status}, rc {result.rc})", EXIT_FAILURE)
        ran = [h for h in result.hosts.values() if h.in_play]
        if not check:  # what these hosts now have, for `launch`/`check` to compare specs with
            roles = [r for r in (tag_list or ROLE_TAGS) if r in ROLE_TAGS and r not in skip]
            if roles:
                try:
                    setup_state.record(loaded, [h.host for h in ran], roles)
                except OSError as e:  # setup itself succeeded: say what launch/check will miss
                    err(f"warning: could not keep the setup record ({e}); launch and check will not compare "
                        "the spec with this setup")  # fmt: skip
        err(
            f"setup ok: {len(ran)} host(s), {result.changed} change(s)"
            + (" (check mode: none made)" if check else "")
            + (f" ({len(result.hosts) - len(ran)} left out by --limit)" if len(ran) < len(result.hosts) else "")
        )
