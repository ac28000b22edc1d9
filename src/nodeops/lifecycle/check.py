"""`nodeops check`: the backend's preflight over every node, then (``--fabric``) the measurement."""

from __future__ import annotations

from pathlib import Path

from nodeops import backends
from nodeops.backends.base import Sink
from nodeops.check.preflight import FAIL, Report, Row
from nodeops.errors import ExitWith, NodeopsError, UsageError
from nodeops.lifecycle import load_cluster
from nodeops.lifecycle.fabric import run_fabric
from nodeops.lifecycle.gates import unreachable
from nodeops.node.fabric import FabricReport
from nodeops.setup import state as setup_state
from nodeops.spec.model import LoadedSpec


def check(spec_path: Path, sink: Sink, *, group: str | None = None, timeout: float = 120,
          fabric: bool = False) -> tuple[LoadedSpec, Report]:  # fmt: skip
    """Every node probed at once by the spec's backend, and judged."""
    loaded = load_cluster(spec_path, group, required=False)
    backend = backends.for_spec(loaded.spec)
    if fabric and not backend.capabilities.fabric:
        raise UsageError(f"--fabric cannot be used with backend: {backend.name} (nothing was run)")
    report = backend.check(loaded, timeout, sink)
    if backend.capabilities.preflight:  # what the spec needs that the last setup did not give: rows too
        diffs = setup_state.differences(loaded) or []
        # a node this machine cannot reach fails once, for its ssh row (setup cannot reach it either)
        no_ssh = [r.host for r in report.rows if r.check == "ssh" and r.status == FAIL]
        dead = set(unreachable(loaded, no_ssh)) if diffs and no_ssh else set()
        report.rows += [Row(h, "setup", FAIL, f"{d.what}: {d.detail}; fix: {setup_state.fix(loaded, [d])}")
                        for d in diffs for h in d.hosts if h not in dead]  # fmt: skip
    return loaded, report


def measure_fabric(loaded: LoadedSpec, spec_path: Path, report: Report, sink: Sink, *, seconds: float = 30,
                   verbose: bool = False) -> tuple[FabricReport | None, str]:  # fmt: skip
    """`check --fabric` after the checks: the fabric report, or why there is none."""
    if report.worst() == "fail":
        return None, "not run: a check failed (the measurement needs every node reachable on the job's ports)"
    try:
        return run_fabric(loaded, spec_path, seconds, sink, verbose), ""
    except ExitWith:  # only Ctrl-C gets through run_fabric: the run is stopped everywhere; so is check
        raise
    except NodeopsError as e:  # FabricError and the like: the check report above still stands
        return None, str(e)
