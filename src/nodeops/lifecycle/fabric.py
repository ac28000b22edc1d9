"""`check --fabric` and `launch --fabric-check`: the fabric probe run as an ordinary torchrun
run over the ssh backend, and the verdict on its result."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nodeops import fabric, store
from nodeops.backends.base import Sink
from nodeops.backends.ssh import run_job
from nodeops.errors import EXIT_FAILURE, ExitWith, NodeopsError
from nodeops.fabric import FabricReport
from nodeops.spec import LoadedSpec
from nodeops.starter import RunFile


class FabricError(NodeopsError):
    """The fabric measurement did not produce a result (the run failed, or said nothing)."""


def run_fabric(loaded: LoadedSpec, spec_path: Path, seconds: float, sink: Sink, verbose: bool = False) -> FabricReport:
    """Run the fabric probe as an ordinary torchrun run (the spec's env file, Python env,
    interface settings and ports; NCCL's network lines switched on) and judge its result."""
    s = loaded.spec
    # torchrun whatever the job's runner: one process per GPU (or one per node), the same ports.
    # Every node is measured, spares too, once: the probe is never restarted.
    launch = s.launch.model_copy(update={"runner": "torchrun", "max_restarts": 0, "restarts": 0})
    nodes = [n.model_copy(update={"spare": False}) for n in s.nodes]
    as_torchrun = dataclasses.replace(loaded, spec=s.model_copy(update={"launch": launch, "nodes": nodes}))
    names = [s.alias(n) for n in s.ranked_nodes()]
    run_id = store.new_run_id()
    thresholds = s.network.fabric
    undiscovered = [s.alias(n) for n in s.nodes if n.gpus == "auto"]
    if undiscovered:
        raise FabricError(f"gpus: auto is not discovered yet on {', '.join(undiscovered)}: run `nodeops setup` first")
    which = fabric.backend([len(n.gpus) if isinstance(n.gpus, list) else 0 for n in s.ranked_nodes()])
    script = f"@@HOME@@/{store.remote_dir(run_id)}/fabric.py"
    argv = fabric.probe_argv(names, seconds, thresholds.max_pair_spread, script, which)
    probe = (Path(fabric.__file__).parent / "fabric_probe.py").read_text()
    collector = fabric.Collector(lambda host, line: sink.note(f"{host} {line}"), verbose)
    pairs = len(fabric.ring_pairs(len(names)))
    sink.note(
        f"==> fabric: all-reduce over {len(names)} node(s) and {pairs} node pair(s), {seconds:g}s budget (run {run_id})"
    )
    try:
        run_job(as_torchrun, spec_path, argv, sink, extra_files=[RunFile("fabric.py", probe, "0600")],
                extra_env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}, emit=collector,
                run_id=run_id)  # fmt: skip
    except ExitWith as e:
        if e.exit_code == 130:  # Ctrl-C: the run is stopped everywhere; so is check
            raise
        if e.message:
            sink.note(e.message)
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


def fabric_gate(loaded: LoadedSpec, spec_path: Path, sink: Sink) -> None:
    """`launch --fabric-check`: the fabric measurement first; nothing starts unless it passes."""
    try:
        report = run_fabric(loaded, spec_path, 30, sink)
    except FabricError as e:
        raise ExitWith(EXIT_FAILURE, f"--fabric-check: {e}; nothing was started") from None
    sink.report(report)  # stderr: stdout is the job's (and, detached, the run id)
    if not report.ok:
        raise ExitWith(EXIT_FAILURE, f"--fabric-check failed ({'; '.join(report.problems)}); nothing was started "
                       "(network.fabric in the spec changes the thresholds: docs/reference/spec.md)")  # fmt: skip
