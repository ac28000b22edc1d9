"""The run store on the controller: run ids, one record per run (``~/.nodeops/jobs/<run id>/``:
``job.json``, its ssh_config, and ``result.json`` once the run's verdict is known) and the
starting marker. Every backend saves and finds its runs here; what is its own (a Slurm job id,
the login node) is in the record's ``handle``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeops.errors import NodeopsError
from nodeops.node import protocol as P
from nodeops.node import recovery, stall
from nodeops.node.failures import exit_code_for
from nodeops.resources import nodeops_home
from nodeops.setup.render import pins_digest, ssh_config_text, ssh_target_from_record

RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
STARTING = "starting"  # in a run's record while `nodeops launch` starts it: the launch's pid
RESULT = "result.json"  # the run's verdict, in one shape (Verdict.save)
# Fields of records written before the handle existed: a Slurm run's, now its handle's keys
_OLD_HANDLE_FIELDS = {"slurm_job": "job_id", "slurm_login": "login", "slurm_state": "state"}


class JobError(NodeopsError):
    pass


class RunIdError(JobError):
    """A run id that is malformed or unknown here: usage, nothing was run (exit 2)."""

    exit_code = 2


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise RunIdError(f"{run_id!r} is not a run id (like 20261122-101500-ab12); see `ls ~/.nodeops/jobs`")
    return run_id


def jobs_dir() -> Path:
    base = nodeops_home()
    d = base / "jobs"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def remote_dir(run_id: str) -> str:
    return P.run_dir(check_run_id(run_id))  # relative to the login user's home


@dataclass(frozen=True)
class Job:
    """The run record on the controller (``~/.nodeops/jobs/<run id>/job.json``), written by
    ``launch`` and read by ``status``/``logs``/``stop``/``runs``/``clean``; one typed record for
    every backend, saved and loaded here. What only one backend needs is in ``handle``."""

    run_id: str
    dir: Path
    hosts: list[str]  # ssh: hosts that run a job.sh (their logs are followed); Slurm: the login node
    argv: list[str]
    runner: str
    chief: str = ""  # where the run is controlled: the supervisor's host (ssh), the login node (Slurm)
    spec: str = ""
    started: float = 0.0
    rank_hosts: list[str] = field(default_factory=list)  # mpirun: the host of each global rank
    all_hosts: list[str] = field(default_factory=list)  # every host with the run's dir: where stop/clean run
    pdsh_hosts: dict[str, str] = field(default_factory=dict)  # deepspeed: pdsh's address prefix -> host
    backend: str = "ssh"  # the name of the backend that runs it (nodeops.backends.REGISTRY)
    handle: dict[str, str] = field(default_factory=dict)  # the backend's own (Slurm: job_id, login, state)

    @property
    def kill_hosts(self) -> list[str]:
        return self.all_hosts or self.hosts

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    def with_handle(self, **values: str) -> Job:
        return dataclasses.replace(self, handle={**self.handle, **values})

    def save(self) -> None:
        record = {k: v for k, v in dataclasses.asdict(self).items() if k != "dir"}
        tmp = self.dir / "job.json.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(self.dir / "job.json")


def find(run_id: str | None) -> Job:
    """The job with this run id, or the latest one when run_id is None. Records of earlier
    releases load too (a Slurm run's ``slurm_*`` fields become its handle)."""
    if run_id is None:
        ids = sorted(p.name for p in jobs_dir().iterdir() if RUN_ID.match(p.name))
        if not ids:
            raise RunIdError("no job has been launched from this machine yet")
        run_id = ids[-1]
    d = jobs_dir() / check_run_id(run_id)
    if not (d / "job.json").is_file():
        raise RunIdError(f"no job {run_id} in {jobs_dir()}")
    meta = json.loads((d / "job.json").read_text())
    if not (d / "ssh_config").exists() and isinstance(meta.get("connection"), dict):
        write_ssh_config(d, meta["connection"])  # a run the launch playbook started
    handle = {new: str(meta[old]) for old, new in _OLD_HANDLE_FIELDS.items() if meta.get(old)}
    own = meta.get("handle") or {}
    if not isinstance(own, dict):
        raise JobError(f"{d / 'job.json'}: its handle is not a mapping; the record is damaged")
    handle.update({str(k): str(v) for k, v in own.items() if v is not None})
    known = {f.name for f in dataclasses.fields(Job)} - {"dir", "handle"}
    job = Job(dir=d, handle=handle, **{k: v for k, v in meta.items() if k in known})
    return job if job.chief else dataclasses.replace(job, chief=(job.all_hosts or job.hosts)[0])


def mark_starting(d: Path) -> None:
    """Say, in the run's record, that this process is starting the run (`runs` shows it so)."""
    (d / STARTING).write_text(f"{os.getpid()}\n")


def clear_starting(d: Path) -> None:
    (d / STARTING).unlink(missing_ok=True)


@dataclass(frozen=True)
class Verdict:
    """How a run ended, in one shape for every backend (the run's ``result.json`` here)."""

    outcome: str  # ok | failed | stopped (or what a supervisor said that nodeops does not know)
    detail: str  # in one line
    exit_code: int | None  # what `nodeops launch` exits (or would have exited) with: failures.exit_code_for
    first_failure: dict[str, Any] | None = None  # {host, why, code}: the failure that started it
    teardown_seconds: float | None = None
    hosts: dict[str, Any] = field(default_factory=dict)  # host -> what the follower saw of it
    raw: dict[str, Any] = field(default_factory=dict)  # the backend's own result (the supervisor's, Slurm's)
    backend: str = "ssh"

    @classmethod
    def of(cls, outcome: str, detail: str, code: int | None = None, **kw: Any) -> Verdict:
        return cls(outcome, detail, exit_code_for(outcome, code), **kw)

    def save(self, d: Path) -> None:
        tmp = d / (RESULT + ".tmp")
        tmp.write_text(json.dumps({"version": 2, **dataclasses.asdict(self)}, indent=2))
        tmp.replace(d / RESULT)


def supervisor_verdict(result: dict[str, Any]) -> Verdict:
    """An ssh run's verdict from its supervisor's result.json (as the chief keeps it)."""
    first = result.get("first_failure") or None
    outcome = str(result.get("outcome") or "unknown")
    return Verdict.of(outcome, describe(result), (first or {}).get("code"), first_failure=first,
                      teardown_seconds=result.get("teardown_seconds"), raw=result)  # fmt: skip


ATTEMPT_KEYS = ("attempt", "hosts", "started", "ended", "outcome", "kind", "culprit", "why", "excluded", "decision",
                "backoff")  # fmt: skip


def attempts_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's attempts (automatic restarts) as its supervisor recorded them, in a compact form."""
    out = result.get("attempts") or []
    return [{k: a[k] for k in ATTEMPT_KEYS if k in a} for a in out if isinstance(a, dict)]


def faults(result: dict[str, Any]) -> str:
    """Every attempt's fault, in words ('' without restarts)."""
    attempts = attempts_of(result)
    if len(attempts) < 2 and not any(a.get("culprit") for a in attempts):
        return ""
    said = [f"attempt {a['attempt']}: {a.get('kind')} on {a.get('culprit')}"
            + (f" ({', '.join(a['excluded'])} excluded)" if a.get("excluded") else "")
            for a in attempts if a.get("culprit")]  # fmt: skip
    return f"{len(attempts)} attempt(s)" + (f"; faults: {'; '.join(said)}" if said else "")


def timed_attempts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A supervisor result's attempts with their timelines (a run without restarts is one)."""
    if result.get("attempts"):
        return [a for a in result["attempts"] if isinstance(a, dict)]
    first = result.get("first_failure") or {}
    return [{"attempt": 1, "times": result.get("times") or {}, "kind": first.get("kind"), "culprit": first.get("host")}]


def timeline(result: dict[str, Any]) -> tuple[list[str], dict[str, float] | None]:
    """Each fault of a run in a line of offsets (recovery.incident), and its goodput (or None)."""
    attempts = timed_attempts(result)
    lines = [recovery.incident(a, attempts[i + 1] if i + 1 < len(attempts) else None)
             for i, a in enumerate(attempts)]  # fmt: skip
    stalls = [st for st in result.get("stalls") or [] if isinstance(st, dict)]
    lines += [stall.describe(st) for st in stalls]
    return [line for line in lines if line], recovery.goodput(attempts, stalls)


def timeline_lines(result: dict[str, Any]) -> list[str]:
    """:func:`timeline` as lines: each fault's offsets, then the goodput line (none of either for
    a run with no timeline)."""
    incidents, good = timeline(result)
    return incidents + ([recovery.goodput_line(good)] if good is not None else [])


def describe(result: dict[str, Any]) -> str:
    """The supervisor's verdict in one line (with every attempt's fault, after restarts)."""
    first = result.get("first_failure")
    more = faults(result)
    more = f" [{more}]" if more else ""
    if result.get("outcome") == "failed" and first:
        took = result.get("teardown_seconds")
        return (f"failed: first failure on {first['host']} ({first.get('why', '')}); every other host stopped"
                + (f" in {took:.1f}s" if took is not None else "") + more)  # fmt: skip
    if result.get("outcome") == "hung" and first:
        return f"{first.get('why', 'hung')}; suspect host {first['host']}; every rank stopped" + more
    return {"ok": "finished: every job exited 0", "stopped": "stopped on request"}.get(
        str(result.get("outcome")), f"supervisor: {result.get('outcome')} {result.get('error', '')}".strip()
    ) + more


def read_verdict(d: Path) -> Verdict | None:
    """The verdict kept in a run's dir, or None. Earlier releases wrote ``{"supervisor": ...}``
    (ssh, with ``hosts`` when an attached launch wrote it) or ``{"slurm": ...}`` (never read
    back: a Slurm run's state is asked of Slurm, as it was then)."""
    try:
        data = json.loads((d / RESULT).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if "outcome" in data:
        known = {f.name for f in dataclasses.fields(Verdict)}
        code = data.get("exit_code")
        if not (isinstance(data["outcome"], str) and isinstance(data.get("detail"), str)
                and (code is None or (isinstance(code, int) and not isinstance(code, bool)))):  # fmt: skip
            return None
        try:
            return Verdict(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None
    sup, hosts = data.get("supervisor"), data.get("hosts") or {}
    if not isinstance(sup, dict) or not sup or not isinstance(hosts, dict):
        return None
    try:
        return dataclasses.replace(supervisor_verdict(sup), hosts=hosts)
    except (KeyError, TypeError, AttributeError):  # a damaged old record: ask the chief, as then
        return None


def write_ssh_config(d: Path, connection: dict[str, Any]) -> None:
    """The run's ssh_config from the connection data the launch role recorded for each host."""
    targets = [ssh_target_from_record(h, c, str(d / "known_hosts")) for h, c in connection.items()]
    pins = pins_digest(t.known_hosts for t in targets)  # other pins: another master (render.control_tag)
    tag = hashlib.sha256((repr(sorted(connection.items(), key=str)) + pins).encode()).hexdigest()[:10]
    text = ssh_config_text(
        targets, tag, f"Generated by nodeops from the run record {d.name}/job.json (nodeops.cluster.launch)"
    )
    tmp = d / "ssh_config.tmp"
    tmp.write_text(text)
    tmp.replace(d / "ssh_config")
