"""`nodeops launch`: refuse what the backend lacks, then the dry run or the gates, then the
backend's own start (and follow)."""

from __future__ import annotations

import dataclasses

from nodeops import backends
from nodeops.backends.base import Backend, LaunchRequest, Sink
from nodeops.errors import UsageError
from nodeops.lifecycle import gates, load_cluster
from nodeops.lifecycle.fabric import fabric_gate
from nodeops.spec import timeouts
from nodeops.spec.model import ResourceSpec
from nodeops.transport import ensure_fds


def refuse_unsupported(backend: Backend, request: LaunchRequest, spec: ResourceSpec | None = None) -> None:
    """Every option the spec's backend does not declare, refused at once (exit 2, nothing run);
    the spec's own launch.hang_timeout too, unless --hang-timeout 0 turns it off, and its
    launch.flight_recorder: true."""
    asked = request.asked()
    if spec is not None and request.hang_timeout is None and spec.launch.hang_timeout:
        asked["hang"] = True
    if spec is not None and spec.launch.flight_recorder:
        asked["flight_recorder"] = True
    if spec is not None and (spec.launch.restarts or spec.spares()):
        asked["restarts"] = True
    bad = backend.refusals(asked)
    if bad:
        raise UsageError(f"{', '.join(bad)} cannot be used with backend: {backend.name} (nothing was run)")


def launch(request: LaunchRequest, sink: Sink, group: str | None = None) -> None:
    """Load the spec, refuse what its backend lacks, then dry-run, or pass the gates and start."""
    loaded = load_cluster(request.spec_path, group, required=not request.dry_run)
    if not request.argv and request.script is None:
        raise UsageError("nothing to run; give the training script, e.g. train.py")
    if request.detach and request.attach:
        raise UsageError("--detach and --attach contradict each other (a launch follows its job unless --detach)")
    backend = backends.for_spec(loaded.spec)
    refuse_unsupported(backend, request, loaded.spec)
    if request.hang_timeout is not None:  # --hang-timeout wins over the spec's (0: off)
        launch_spec = loaded.spec.launch.model_copy(update={"hang_timeout": request.hang_timeout})
        loaded = dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"launch": launch_spec}))
    if request.dry_run:
        for kind, text in backend.dry_run(loaded, request).entries:
            (sink.out if kind == "out" else sink.note)(text)
        for text in timeouts.table(loaded.spec):
            sink.note(text)
        return
    if backend.name == "ssh" and not request.detach:  # refused before a rank starts, not halfway
        ensure_fds("an attached launch (it follows every host's log)", len(loaded.spec.nodes))
    if request.check and backend.capabilities.preflight:
        gates.setup_gate(loaded, "started", "--no-check skips this comparison",
                         ignore=("shared_path",) if request.sync else ())  # fmt: skip
    if request.sync:
        gates.sync_workdir(loaded, sink)
    if request.check and backend.capabilities.preflight:
        gates.preflight(loaded, sink, request.script_file())
    if request.fabric_check and not backend.capabilities.fabric_check_in_job:
        fabric_gate(loaded, request.spec_path, sink)
    backend.launch(loaded, request, sink)
