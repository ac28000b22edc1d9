"""`check --fabric` and `launch --fabric-check`: the fabric probe run as an ordinary torchrun
run by the spec's backend, and the verdict on its result."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.base import Sink
from nodeops.backends.starter import RunFile
from nodeops.errors import EXIT_FAILURE, ExitWith
from nodeops.node import fabric, fabric_probe
from nodeops.node.fabric import FabricError, FabricReport
from nodeops.spec.model import LoadedSpec


def run_fabric(loaded: LoadedSpec, spec_path: Path, seconds: float, sink: Sink, verbose: bool = False) -> FabricReport:
    """Run the fabric probe as an ordinary torchrun run (the spec's env file, Python env,
    interface settings and ports; NCCL's network lines switched on) and judge its result."""
    s = loaded.spec
    backend = backends.for_spec(s)
    # torchrun whatever the job's runner: one process per GPU (or one per node), the same ports;
    # measured once (never restarted) and ended by its own timeouts, not a hang watchdog
    launch = s.launch.model_copy(update={"runner": "torchrun", "max_restarts": 0, "restarts": 0,
                                         "hang_timeout": None})  # fmt: skip
    as_torchrun = dataclasses.replace(loaded, spec=s.model_copy(update={"launch": launch}))
    names, gpus = backend.fabric_nodes(loaded)
    n = names if isinstance(names, int) else len(names)
    run_id = store.new_run_id()
    thresholds = s.network.fabric
    args = fabric.probe_args(names, seconds, thresholds.max_pair_spread, fabric.backend(gpus))
    probe = RunFile("fabric.py", Path(fabric_probe.__file__).read_text(), "0600")
    collector = fabric.Collector(lambda host, line: sink.note(f"{host} {line}"), verbose)
    pairs = len(fabric.ring_pairs(n))
    sink.note(f"==> fabric: all-reduce over {n} node(s) and {pairs} node pair(s), {seconds:g}s budget (run {run_id})")
    try:
        backend.run_probe(as_torchrun, spec_path, probe, args, sink, emit=collector, run_id=run_id, seconds=seconds,
                          env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"})  # fmt: skip
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
        report = run_fabric(loaded, spec_path, fabric.GATE_SECONDS, sink)
    except FabricError as e:
        raise ExitWith(EXIT_FAILURE, f"--fabric-check: {e}; nothing was started") from None
    sink.report(report)  # stderr: stdout is the job's (and, detached, the run id)
    if not report.ok:
        raise ExitWith(EXIT_FAILURE, f"--fabric-check failed ({'; '.join(report.problems)}); nothing was started "
                       "(network.fabric in the spec changes the thresholds: docs/reference/spec.md)")  # fmt: skip
