"""`nodeops check`: the full-mesh preflight (ssh, ports, interface, versions, GPUs, workdir, limits)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from nodeops.cli.app import CONTEXT, ConsoleSink, GroupOpt, SpecArg, app, err, errors
from nodeops.cli.reports import print_fabric
from nodeops.errors import NodeopsError, SpecError
from nodeops.lifecycle.check import check as do_check
from nodeops.lifecycle.check import measure_fabric

if TYPE_CHECKING:
    from nodeops.check.preflight import Report
    from nodeops.node.fabric import FabricReport

COLORS = {"ok": "green", "warn": "yellow", "fail": "red"}


def print_report(report: Report, title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()  # the report is the output: `nodeops check SPEC | less` shows it
    for host in report.hosts:
        rows = [r for r in report.rows if r.host == host]
        worst = (
            "fail"
            if any(r.status == "fail" for r in rows)
            else "warn"
            if any(r.status == "warn" for r in rows)
            else "ok"
        )
        table = Table(title=f"{host}: [{COLORS[worst]}]{worst}[/]", title_justify="left", show_header=False)
        table.add_column("check", style="bold")
        table.add_column("status")
        table.add_column("detail", overflow="fold")
        for r in rows:
            table.add_row(r.check, f"[{COLORS[r.status]}]{r.status}[/]", escape(r.detail))
        console.print(table)
    diff = report.diff()
    if diff:
        table = Table(title="values that differ across hosts", title_justify="left")
        table.add_column("")
        for h in report.hosts:
            table.add_column(h)
        for key, per in diff.items():
            table.add_row(key, *(escape(per[h]) for h in report.hosts))
        console.print(table)
    counts = {s: sum(1 for r in report.rows if r.status == s) for s in ("ok", "warn", "fail")}
    console.print(f"{title}: [{COLORS[report.worst()]}]{report.worst()}[/] "
                  f"({counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail)")  # fmt: skip


@contextlib.contextmanager
def json_errors(enabled: bool) -> Iterator[None]:
    """With --json, an error before the report is a JSON document on stdout too (then the usual
    message on stderr and exit code)."""

    try:
        yield
    except NodeopsError as e:
        if enabled:
            problems = [str(i) for i in e.issues if i.severity == "error"] if isinstance(e, SpecError) else [str(e)]
            typer.echo(json.dumps({"status": "error", "exit_code": e.exit_code, "errors": problems}, indent=2))
        raise


@app.command(
    context_settings=CONTEXT,
    epilog=(
        "Examples:\n\n    nodeops check cluster.yaml\n\n    nodeops check cluster.yaml --json | jq .diff\n\n"
        "    nodeops check cluster.yaml --strict   # warnings fail too\n\n"
        "    nodeops check inventory.ini --group gpu   # an Ansible inventory's group\n\n"
        "    nodeops check cluster.yaml --fabric   # then measure all-reduce and node pairs, name a slow node\n\n"
        "Exit codes: 0 everything ok (warnings allowed); 1 a check failed (or warned, with --strict), or\n"
        "--fabric's measurement failed a threshold (network.fabric); 2 bad spec."
    ),
)
def check(
    spec: SpecArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail the check too.")] = False,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for each node's probe.")] = 120,
    fabric: Annotated[
        bool,
        typer.Option(
            "--fabric",
            help="After the checks pass, measure the fabric with torchrun on every node (NCCL when every "
            "node has GPUs, else gloo): all-reduce over all nodes for a sweep of sizes, then node pairs around "
            "a ring; name a node whose pairs are slow. Needs torch in the nodes' env.",
        ),
    ] = False,
    fabric_seconds: Annotated[
        float, typer.Option(min=5, help="Time budget of the --fabric measurement (seconds, start-up not included).")
    ] = 30,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="With --fabric: show all the ranks print (NCCL's INFO lines too).")
    ] = False,
    group: GroupOpt = None,
) -> None:
    """Preflight from the chief: what makes multi-node jobs hang, checked on every node at once.

    The chief listens on the master (and c10d rendezvous) port and reaches every node over ssh
    (BatchMode, strict host keys). Each node then: connects to those ports for real; names the
    interface its route to the chief takes (warns on bridges/veths or a NCCL_SOCKET_IFNAME
    that disagrees); activates the Python env and reports python/torch/CUDA/NCCL and every
    package; lists GPUs (nvidia-smi and torch) against the spec's `gpus`; compares the workdir
    with the source; and reports clock offset to the chief, `ulimit -n`, /dev/shm and free disk. Values that
    differ from the chief's fail and are shown side by side.

    With --fabric, the links are then measured by a short torchrun run on every node: bus
    bandwidth (nccl-tests' definition) of an all-reduce over all ranks for a sweep of sizes, then
    each node paired with its ring neighbours. A node whose best pair is below
    network.fabric.max_pair_spread (0.7) of a healthy node's, or any figure below
    network.fabric.min_busbw_gbps, fails the check and is named, slowest first.
    """

    sink = ConsoleSink()
    with errors(), json_errors(as_json):
        loaded, report = do_check(spec, sink, group=group, timeout=timeout, fabric=fabric)
    code = report.exit_code(strict)
    if not as_json:
        print_report(report, "check")
    fab: FabricReport | None = None
    fab_error = ""
    if fabric:
        with errors():
            fab, fab_error = measure_fabric(loaded, spec, report, sink, seconds=fabric_seconds, verbose=verbose)
        code = max(code, 0 if fab is not None and fab.ok else 1)
        if not as_json:
            if fab is not None:
                print_fabric(fab)
            else:
                err(f"fabric: {fab_error}")
    if as_json:
        doc = report.to_json(strict)
        if fabric:
            doc["fabric"] = fab.to_json() if fab is not None else {"status": "error", "error": fab_error}
            doc["exit_code"] = code
            if code and doc["status"] != "fail":  # `jq -e '.status == "ok"'` must not pass a failed fabric
                doc["status"] = "fail"
        typer.echo(json.dumps(doc, indent=2))
    raise typer.Exit(code)
