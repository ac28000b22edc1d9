"""`nodeops check`: the full-mesh preflight (ssh, ports, interface, versions, GPUs, workdir, limits)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from nodeops.cli.app import CONTEXT, GroupOpt, SpecArg, app, err, errors, fail
from nodeops.errors import EXIT_SPEC

if TYPE_CHECKING:
    from pathlib import Path

    from nodeops.check import Report
    from nodeops.fabric import FabricReport
    from nodeops.spec import LoadedSpec

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
    from nodeops.errors import NodeopsError, SpecError

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
    from nodeops import check as chk
    from nodeops import gpus
    from nodeops.render import require_controller_files
    from nodeops.spec import load_spec

    with errors(), json_errors(as_json):
        loaded = gpus.resolved(load_spec(spec, group), required=False)  # gpus: auto, as setup found them
        require_controller_files(loaded)
        if loaded.spec.on_slurm:
            if fabric:
                fail("error: --fabric cannot be used with backend: slurm yet (nothing was run)", EXIT_SPEC)
            s = loaded.spec.slurm
            err(f"==> checking the {s.nodes if s else 0} node(s) Slurm gives, in one srun step")
            nodes_spec, result = chk.run_slurm(loaded, timeout=timeout)
            report = chk.as_srun_rows(chk.evaluate(nodes_spec, result), result.get("missing", ""))
        else:
            err(f"==> checking {len(loaded.spec.nodes)} hosts from the chief {loaded.spec.alias(loaded.spec.chief)}")
            result = chk.run(loaded, timeout=timeout)
            report = chk.evaluate(loaded.spec, result, auto_gpus=loaded.discovered_gpus)
    code = report.exit_code(strict)
    if not as_json:
        print_report(report, "check")
    fab: FabricReport | None = None
    fab_error = ""
    if fabric:
        if report.worst() == "fail":
            fab_error = "not run: a check failed (the measurement needs every node reachable on the job's ports)"
        else:
            from nodeops.errors import NodeopsError

            try:
                fab = run_fabric(loaded, spec, fabric_seconds, verbose)
            except (FabricError, NodeopsError) as e:  # the check report above still stands
                fab_error = str(e)
        code = max(code, 0 if fab is not None and fab.ok else 1)
        if not as_json:
            if fab is not None:
                from nodeops.fabric import print_report as print_fabric

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


class FabricError(Exception):
    """The fabric measurement did not produce a result (the run failed, or said nothing)."""


def run_fabric(loaded: LoadedSpec, spec_path: Path, seconds: float, verbose: bool = False) -> FabricReport:
    """Run the fabric probe as an ordinary torchrun run (the spec's env file, Python env,
    interface settings and ports; NCCL's network lines switched on) and judge its result."""
    import dataclasses
    from pathlib import Path

    from nodeops import fabric, jobs
    from nodeops.cli.launch_cmds import run_job
    from nodeops.starter import RunFile

    s = loaded.spec
    # torchrun whatever the job's runner: one process per GPU (or one per node), the same ports.
    launch = s.launch.model_copy(update={"runner": "torchrun", "max_restarts": 0})
    as_torchrun = dataclasses.replace(loaded, spec=s.model_copy(update={"launch": launch}))
    names = [s.alias(n) for n in s.ranked_nodes()]
    run_id = jobs.new_run_id()
    thresholds = s.network.fabric
    undiscovered = [s.alias(n) for n in s.nodes if n.gpus == "auto"]
    if undiscovered:
        raise FabricError(f"gpus: auto is not discovered yet on {', '.join(undiscovered)}: run `nodeops setup` first")
    which = fabric.backend([len(n.gpus) if isinstance(n.gpus, list) else 0 for n in s.ranked_nodes()])
    script = f"@@HOME@@/{jobs.remote_dir(run_id)}/fabric.py"
    argv = fabric.probe_argv(names, seconds, thresholds.max_pair_spread, script, which)
    probe = (Path(fabric.__file__).parent / "fabric_probe.py").read_text()
    collector = fabric.Collector(lambda host, line: err(f"{host} {line}"), verbose)
    pairs = len(fabric.ring_pairs(len(names)))
    err(
        f"==> fabric: all-reduce over {len(names)} node(s) and {pairs} node pair(s), {seconds:g}s budget (run {run_id})"
    )
    try:
        run_job(as_torchrun, spec_path, argv, extra_files=[RunFile("fabric.py", probe, "0600")],
                extra_env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}, emit=collector,
                run_id=run_id)  # fmt: skip
    except typer.Exit as e:
        if e.exit_code == 130:  # Ctrl-C: the run is stopped everywhere; so is check
            raise
        if collector.doc is None:
            raise FabricError(
                f"the measurement (run {run_id}) failed with exit code {e.exit_code}; see above"
            ) from None
        failed_after = e.exit_code  # the result was printed: judge it, and say how the run ended
    else:
        failed_after = 0
    if collector.doc is None:
        raise FabricError(f"the measurement (run {run_id}) ended without a result; see `nodeops logs {run_id}`")
    report = fabric.evaluate(collector.doc, spread=thresholds.max_pair_spread, min_busbw=thresholds.min_busbw_gbps,
                             interfaces=collector.interfaces())  # fmt: skip
    report.run_id = run_id
    if failed_after:
        report.notes.append(
            f"the run ended with exit code {failed_after} after the measurement (nodeops logs {run_id})"
        )
    return report
