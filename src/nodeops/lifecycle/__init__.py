"""The run lifecycle: launch (with its gates: sync, preflight, fabric), dry run, status, logs,
stop, runs and clean, over whichever backend a spec or run record names.

Nothing here prints or exits: events go to a :class:`~nodeops.backends.base.Sink`, outcomes are
returned or raised as :class:`~nodeops.errors.NodeopsError` (``ExitWith`` for a run's own code).
"""

from __future__ import annotations

from pathlib import Path

from nodeops.setup import gpus
from nodeops.setup.render import require_controller_files
from nodeops.spec.loading import load_spec
from nodeops.spec.model import LoadedSpec


def load_cluster(spec_path: Path, group: str | None, *, required: bool) -> LoadedSpec:
    """The spec (or inventory) with ``gpus: auto`` as setup found them (``required``: it must
    have run), and the files it names on this machine present."""
    loaded = gpus.resolved(load_spec(spec_path, group), required=required)
    require_controller_files(loaded)
    return loaded
