"""`nodeops status`, `logs`, `stop` and `stacks`: find the run the user meant and ask its backend.

Which run: a run id names one; a spec file names the latest run launched from that spec; nothing
names the latest run, said on stderr with its spec, except for ``stop``, which acts without a
name only when at most one run is live here (with more, it refuses and lists them)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.base import Sink
from nodeops.errors import UsageError
from nodeops.lifecycle import runs as R
from nodeops.node import stacks as S
from nodeops.transport import ensure_fds

LIVE = ("running", "starting")  # a run in these states may still have ranks somewhere
STACKS_WAIT = 60.0  # seconds `stacks` waits for the ranks of a run that is starting (launch --detach)
STACKS_POLL = 1.0
# Seconds ssh gets to connect to each run's chief (or Slurm login node) when `stop` looks for the
# one live run: a run recorded here whose cluster is gone would otherwise cost nodeops' usual
# 10 s. A run that could not be asked is named, and not counted.
QUICK_CONNECT = 3


def spec_key(target: str) -> str:
    """A spec file as a run record holds it (launch saves the resolved path)."""
    return str(Path(target).expanduser().resolve())


def is_spec(target: str) -> bool:
    """Whether a command's RUN argument names a spec file rather than a run id."""
    if store.RUN_ID.match(target):
        return False
    return Path(target).expanduser().is_file() or target.endswith((".yaml", ".yml"))


def runs_of_spec(found: Sequence[R.Run], target: str) -> list[R.Run]:
    """The runs launched from this spec file, newest first (``found`` is newest first)."""
    key = spec_key(target)
    return [r for r in found if r.job.spec == key]


def live_conflict(live: Sequence[R.Run], of_spec: bool = False) -> str:
    """Why ``stop`` refuses: every live run, with its spec, and how to name one."""
    rows = "\n".join(f"  {r.job.run_id}  {r.state:8} {r.job.backend:5} {r.job.spec or '?'}" for r in live)
    which = "a run id" if of_spec else "a run id, or the spec file it was launched from"
    return (f"{len(live)} runs{' of this spec' if of_spec else ''} are live here; say which to stop ({which}):\n"
            f"{rows}\nfor example: nodeops stop {live[0].job.run_id}")  # fmt: skip


def unasked(runs: Sequence[R.Run]) -> str:
    """The runs that could not be asked, each with why (the first 3, then how many more)."""
    each = "; ".join(f"{r.job.run_id} ({r.detail})" for r in runs[:3])
    return (f"{len(runs)} run(s) could not be asked (ssh gets {QUICK_CONNECT} s to connect to a run's chief or "
            f"Slurm login node): {each}" + (f"; and {len(runs) - 3} more" if len(runs) > 3 else ""))  # fmt: skip


def only_live(found: list[R.Run], of_spec: bool, sink: Sink) -> R.Run | None:
    """The one live run of ``found`` (asking each chief about runs without a verdict; ssh gets
    QUICK_CONNECT seconds to connect), None when none is live; more than one is refused (a
    command that acts must not guess). Runs that could not be asked are named: beside a live run
    they are not counted; with no live run, `stop` refuses (one of them may be live)."""
    R.refresh(found, connect_timeout=QUICK_CONNECT, shortcut=True)
    unknown = [r for r in found if r.state == "unreachable"]
    live = [r for r in found if r.state in LIVE]
    if len(live) > 1:
        raise UsageError(live_conflict(live, of_spec))
    if unknown and not live:
        raise UsageError(f"no run here answered as live, and {unasked(unknown)}; name the run to stop "
                         f"(for example: nodeops stop {unknown[0].job.run_id}); `nodeops runs` lists them")  # fmt: skip
    if unknown:
        sink.note(f"not counted: {unasked(unknown)}; `nodeops runs` lists them; name one to stop it")
    return live[0] if live else None


def pick(target: str | None, sink: Sink, *, acts: bool = False) -> store.Job:
    """The run a command's RUN argument means (see the module's doc). ``acts``: the command
    changes the run (stop), so without a name it must be the only live one."""
    if target is not None and not is_spec(target):
        if not store.RUN_ID.match(target):
            raise store.RunIdError(f"{target!r} is neither a run id (like 20261122-101500-ab12) nor a spec file "
                                   "(`nodeops runs` lists the runs and their specs)")  # fmt: skip
        return store.find(target)
    if target is not None:
        found = runs_of_spec(R.local_runs(), target)
        if not found:
            raise store.RunIdError(f"no run was launched from {spec_key(target)} on this machine "
                                   "(`nodeops runs` lists the runs and their specs)")  # fmt: skip
        live = only_live(found, of_spec=True, sink=sink) if acts else None
        if live is not None:
            sink.note(f"run {live.job.run_id}: the live run launched from {live.job.spec}")
            return live.job
        job = found[0].job
        sink.note(f"run {job.run_id}: the latest launched from {job.spec}")
        return job
    if acts:
        one = only_live(R.local_runs(), of_spec=False, sink=sink)
        if one is not None:
            job = one.job
            sink.note(f"run {job.run_id} ({job.spec or 'no spec recorded'}): the only live run here")
            return job
    job = store.find(None)
    sink.note(f"run {job.run_id} ({job.spec or 'no spec recorded'}): the latest launched from this machine")
    return job


def status(target: str | None, sink: Sink) -> None:
    job = pick(target, sink)
    backends.for_job(job).status(job, sink)


def logs(target: str | None, follow: bool, sink: Sink) -> None:
    job = pick(target, sink)
    if follow and job.backend == "ssh":
        ensure_fds("logs -f (it follows every host's log)", len(job.hosts))
    backends.for_job(job).logs(job, follow, sink)


def stop(target: str | None, sink: Sink) -> None:
    job = pick(target, sink, acts=True)
    backends.for_job(job).stop(job, sink)


def stacks(target: str | None, native: bool, method: str, sink: Sink) -> dict[str, Any]:
    """Every rank's Python stack of a live run, at once: the groups (those that differ from the
    majority first), each rank's method, and where the raw dumps were saved in the run's record
    here (``stacks/<time>/``). A run with no live rank anywhere is a usage error (exit 2)."""
    job = pick(target, sink)
    backend = backends.for_job(job)
    if not backend.capabilities.stacks:
        raise UsageError(f"nodeops stacks cannot be used with backend: {backend.name} (run {job.run_id})")
    if method not in S.METHODS:
        raise UsageError(f"--method {method!r}: use one of {', '.join(S.METHODS)}")
    t0 = time.monotonic()
    dumps, none = backend.stacks(job, native, method)
    took = time.monotonic() - t0
    if not dumps and store.read_verdict(job.dir) is None:
        st = backend.run_state(job)
        if st.state in LIVE:  # just launched (--detach): its ranks are on their way
            sink.note(f"run {job.run_id} has no rank yet ({st.detail}); waiting up to {STACKS_WAIT:.0f} s "
                      "for its ranks to start")  # fmt: skip
            deadline = time.monotonic() + STACKS_WAIT
            while not dumps and st.state in LIVE and time.monotonic() < deadline:
                time.sleep(STACKS_POLL)
                t0 = time.monotonic()
                dumps, none = backend.stacks(job, native, method)
                took = time.monotonic() - t0
                if not dumps:
                    st = backend.run_state(job)
            if not dumps and st.state in LIVE:
                why = "".join(f"; {h}: {w}" for h, w in none.items())
                raise UsageError(f"run {job.run_id} started no rank within {STACKS_WAIT:.0f} s ({st.detail}{why}); "
                                 "`nodeops logs` shows what it is doing")  # fmt: skip
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
