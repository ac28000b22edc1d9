"""The backends behind `launch`, `status`, `logs`, `stop`, `runs` and `clean`, by name.

Adding a scheduler: a module here with a :class:`~nodeops.backends.base.Backend` subclass,
one line in :data:`REGISTRY`, and the spec's ``backend`` field learning its name.
"""

from __future__ import annotations

from collections.abc import Mapping

from nodeops.backends.base import Backend
from nodeops.backends.slurm.backend import SlurmBackend
from nodeops.backends.ssh.backend import SshBackend
from nodeops.backends.store import Job
from nodeops.setup import render
from nodeops.spec.model import LoadedSpec, ResourceSpec

REGISTRY: dict[str, Backend] = {b.name: b for b in (SshBackend(), SlurmBackend())}


def for_spec(spec: ResourceSpec) -> Backend:
    """The backend a spec runs on (``backend:``; a ``slurm:`` section alone means Slurm)."""
    return REGISTRY["slurm" if spec.on_slurm else "ssh"]


def for_job(job: Job) -> Backend:
    """The backend a recorded run was launched on (records from before backends say ssh)."""
    return REGISTRY.get(job.backend or "ssh", REGISTRY["ssh"])


def render_files(loaded: LoadedSpec, environ: Mapping[str, str]) -> render.Rendered:
    """`nodeops render`: the spec's files, and the files its backend adds (a Slurm batch script)."""
    rendered = render.render(loaded, environ)
    rendered.files.update(for_spec(loaded.spec).files(loaded))
    return rendered
