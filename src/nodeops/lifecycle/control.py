"""`nodeops status`, `logs`, `stop` and `stacks`: find a launched run by its id and ask its backend."""

from __future__ import annotations

import json
import time
from typing import Any

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.base import Sink
from nodeops.errors import UsageError
from nodeops.node import stacks as S


def status(run_id: str | None, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).status(job, sink)


def logs(run_id: str | None, follow: bool, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).logs(job, follow, sink)


def stop(run_id: str | None, sink: Sink) -> None:
    job = store.find(run_id)
    backends.for_job(job).stop(job, sink)


def stacks(run_id: str | None, native: bool, method: str) -> dict[str, Any]:
    """Every rank's Python stack of a live run, at once: the groups (those that differ from the
    majority first), each rank's method, and where the raw dumps were saved in the run's record
    here (``stacks/<time>/``). A run with no live rank anywhere is a usage error (exit 2)."""
    job = store.find(run_id)
    backend = backends.for_job(job)
    if not backend.capabilities.stacks:
        raise UsageError(f"nodeops stacks cannot be used with backend: {backend.name} (run {job.run_id})")
    if method not in S.METHODS:
        raise UsageError(f"--method {method!r}: use one of {', '.join(S.METHODS)}")
    t0 = time.monotonic()
    dumps, none = backend.stacks(job, native, method)
    took = time.monotonic() - t0
    if not dumps:
        why = "; ".join(f"{h}: {w}" for h, w in none.items()) or "no host answered"
        verdict = store.read_verdict(job.dir)
        ended = f" it has ended ({verdict.detail});" if verdict is not None else ""
        raise UsageError(f"run {job.run_id} has no live rank to take a stack of:{ended} {why}")
    out_dir = job.dir / "stacks" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for d in dumps:
        f = out_dir / f"rank{d['rank']}-{d['host']}-{d['method']}.txt"
        f.write_text(d.get("raw") or d.get("error") or "")
        files.append(str(f))
    (out_dir / "stacks.json").write_text(json.dumps(dumps, indent=1))
    groups = S.group(dumps)
    return {"run_id": job.run_id, "seconds": round(took, 2), "dir": str(out_dir), "files": files,
            "groups": groups, "odd": [g for g in groups if g["odd"]], "no_rank": none,
            "methods": {d["rank"]: {"host": d["host"], "pid": d["pid"], "method": d["method"],
                                    **({"fallback_from": d["fallback_from"]} if d.get("fallback_from") else {})}
                        for d in dumps}}  # fmt: skip
