"""`nodeops status`, `logs` and `stop`: find a launched run by its id and ask its backend."""

from __future__ import annotations

from nodeops import backends, store
from nodeops.backends.base import Sink


def status(run_id: str | None, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).status(job, sink)


def logs(run_id: str | None, follow: bool, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).logs(job, follow, sink)


def stop(run_id: str | None, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).stop(job, sink)
