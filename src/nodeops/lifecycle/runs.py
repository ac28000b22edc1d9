"""The runs this controller launched (``~/.nodeops/jobs/<run id>``) and the playbook artifacts
it kept (``~/.nodeops/runs/<kind>-<stamp>-<hex>``): listing them (``nodeops runs``) and removing
finished ones (``nodeops clean``), on the controller and on every host of a run.

A launch run's state comes from the supervisor's verdict: the copy kept on the controller
(``result.json``, written when an attached launch ends, or by an earlier ``runs``), else one ssh
to the chief that reads it there, or says the supervisor still runs. Removal is guarded twice:
only runs whose verdict exists (or whose chief has no trace of them) are chosen, and on each host
the run dir is removed only when no process of the run is alive there (``agent.py status``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.ssh.backend import ALIVE, in_home
from nodeops.errors import UsageError
from nodeops.node import protocol as P
from nodeops.quoting import sh_word
from nodeops.spec.model import duration_seconds
from nodeops.transport import fan_out, last_line, ssh_argv

FINISHED = ("ok", "failed", "stopped", "hung", "gone")  # what clean may remove
STATES = ("starting", "running", *FINISHED, "unreachable", "unknown")  # every state `runs` shows
INFERRED_MIN_AGE = 600.0  # a run without a verdict (gone, or failed while starting) is this old before clean takes it


def parse_duration(text: str) -> float:
    secs = duration_seconds(text) if re.search(r"[smhdw]\s*$", text) else None
    if secs is None:
        raise UsageError(f"--older-than {text!r}: give a number and a unit, like 30m, 12h, 7d or 2w")
    return secs


@dataclass
class Run:
    """One launch run as the controller knows it."""

    job: store.Job
    state: str = "unknown"  # running | ok | failed | stopped | gone | unreachable | unknown
    detail: str = ""  # the verdict in words, or why the state is not known
    exit_code: int | None = None
    size: int = 0  # bytes of its record on the controller
    verdict: bool = False  # the state is the supervisor's verdict (else inferred from what is left)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # automatic restarts: every attempt, as recorded
    goodput: dict[str, float] | None = None  # share of wall time training ran, time lost (recovery.goodput)
    reached: bool = True  # False: ssh did not reach where it is controlled when last asked

    def row(self) -> dict[str, Any]:
        j = self.job
        return {"run_id": j.run_id, "spec": j.spec, "runner": j.runner, "hosts": j.kill_hosts, "chief": j.chief,
                "state": self.state, "started": j.started, "exit_code": self.exit_code, "detail": self.detail,
                "argv": j.argv, "attempts": self.attempts, "goodput": self.goodput}  # fmt: skip


def apply_verdict(run: Run, verdict: store.Verdict) -> None:
    run.verdict = True
    run.state = verdict.outcome
    run.detail = verdict.detail
    run.exit_code = verdict.exit_code
    run.attempts = store.attempts_of(verdict.raw)
    run.goodput = store.timeline(verdict.raw)[1] if verdict.raw else None


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())


def _pid_alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except PermissionError:
        return True
    except (OSError, ValueError):
        return False
    return True


def local_runs() -> list[Run]:
    """Every launch run recorded here, newest first (the run id starts with its time). A dir
    whose job.json is unreadable, or names another run, is not a run record and is left alone."""
    out = []
    for d in sorted((p for p in store.jobs_dir().iterdir() if store.RUN_ID.match(p.name)), reverse=True):
        try:
            job = store.find(d.name)
            if job.run_id != d.name or not job.kill_hosts or not job.chief:
                continue
        except Exception:  # any damaged record is skipped, never fatal to the listing
            continue
        run = Run(job, size=_size(d))
        if (d / store.STARTING).exists() and _pid_alive(d / store.STARTING):
            run.state, run.detail = "starting", "nodeops launch is starting it"
            out.append(run)
            continue
        verdict = store.read_verdict(d)
        if verdict is not None:
            apply_verdict(run, verdict)
        out.append(run)
    return out


def where_controlled(run: Run) -> tuple[str, str, bytes]:
    """Runs with the same key are asked at the same place: their backend, their chief (or login
    node) and how it is reached (the run's ssh_config, its comments aside: ssh's ``-F`` reads
    nothing else)."""
    try:
        how = b"\n".join(ln for ln in run.job.ssh_config.read_bytes().splitlines() if not ln.lstrip().startswith(b"#"))
    except OSError:
        how = run.job.run_id.encode()  # no config to compare: a place of its own
    return run.job.backend, run.job.chief, how


def refresh(runs: Sequence[Run], connect_timeout: int | None = None, *, shortcut: bool = False) -> None:
    """Ask each chief about the runs with no verdict here, in parallel; keep what it says.
    ``connect_timeout``: seconds each chief has to answer the connection (see ``run_state``).
    ``shortcut`` (``runs`` and ``stop``, never ``clean``, which may forget unreachable runs): the
    newest run of each place with more than one is asked first, and where ssh's own words say it
    never reached the place (a cluster torn down), its other runs are said to be unreachable for
    that reason without a connection each: 600 records of a gone cluster cost one timeout, not
    10 rounds of 64."""
    todo = [r for r in runs if r.state == "unknown"]
    if not shortcut:
        ask(todo, connect_timeout)
        return
    places: dict[tuple[str, str, bytes], list[Run]] = {}
    for r in todo:
        places.setdefault(where_controlled(r), []).append(r)
    ask([group[0] for group in places.values()], connect_timeout)
    rest: list[Run] = []
    for group in places.values():
        first = group[0]
        if first.reached:
            rest += group[1:]
            continue
        for r in group[1:]:
            r.state, r.reached = first.state, False
            r.detail = f"{first.detail} (not asked: ssh did not reach it for run {first.job.run_id})"
    ask(rest, connect_timeout)


def ask(runs: Iterable[Run], connect_timeout: int | None = None) -> None:
    """Ask each run's chief (or login node) about it, in parallel; keep what it says."""
    by_id = {r.job.run_id: r for r in runs}

    def one(run: Run) -> None:
        st = backends.for_job(run.job).run_state(run.job, connect_timeout)
        run.state, run.detail, run.reached = st.state, st.detail, st.reached
        if st.exit_code is not None:
            run.exit_code = st.exit_code
        run.verdict = st.verdict
        kept = store.read_verdict(run.job.dir) if st.verdict else None
        if kept is not None and kept.raw:  # the backend kept the verdict it found: its attempts and goodput
            run.attempts = store.attempts_of(kept.raw)
            run.goodput = store.timeline(kept.raw)[1]

    fan_out(list(by_id), lambda rid: one(by_id[rid]), width=64)


def choose(
    runs: Sequence[Run],
    *,
    older_than: float | None,
    keep: int | None,
    now: float | None = None,
    states: Sequence[str] = FINISHED,
) -> list[Run]:
    """The runs in ``states`` (finished ones) to remove: older than ``older_than`` seconds, and
    beyond the newest ``keep`` runs (running ones count towards keep); both when both are given."""
    now = time.time() if now is None else now
    newest_first = sorted(runs, key=lambda r: r.job.started, reverse=True)
    kept = {r.job.run_id for r in newest_first[: keep or 0]} if keep is not None else set()
    return [r for r in newest_first if r.state in states and r.job.run_id not in kept
            and (older_than is None or now - r.job.started >= older_than)
            and (r.verdict or now - r.job.started >= INFERRED_MIN_AGE)]  # fmt: skip


def rmtree(d: Path) -> bool:
    """Remove a dir of ours (a symlink itself, never what it points to); True once it is gone."""
    if d.is_symlink():
        d.unlink(missing_ok=True)
    else:
        shutil.rmtree(d, ignore_errors=True)
    return not d.exists() and not d.is_symlink()


def forget(runs: Sequence[Run]) -> int:
    """Drop these runs' records here (their hosts are gone); returns the bytes freed."""
    return sum(r.size for r in runs if rmtree(r.job.dir))


# On each host: remove the given run dirs, unless a process of that run is alive there.
_REMOVE = (
    ALIVE
    + """cd "$HOME" || exit 1
for id in "$@"; do
  d="@RUNS@/$id"
  if [ ! -e "$d" ] && [ ! -L "$d" ]; then echo "gone $id"; continue; fi
  if alive "$id" "$d"; then echo "busy $id a process of the run is alive here"; continue; fi
  rm -rf -- "$d"
  if [ -e "$d" ] || [ -L "$d" ]; then echo "failed $id could not remove it"; else echo "removed $id"; fi
done
"""
)


@dataclass
class Removal:
    removed_local: list[str] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=dict)  # run id -> why it was kept
    freed: int = 0


def remove(runs: Sequence[Run], forget_unreachable: bool = False) -> Removal:
    """Remove each run's dir on every host of it (one ssh per host for all its runs), then its
    record here once every host confirmed. A host that cannot be reached, or where the run still
    has a process, keeps the record (a later clean retries); with ``forget_unreachable``, a run
    whose only problem is unreachable hosts loses its record anyway."""
    out = Removal()
    # host + ssh_config text -> (a config file to use, the runs to remove there)
    groups: dict[tuple[str, str], tuple[Path, list[str]]] = {}
    for r in runs:
        cfg = r.job.ssh_config
        text = cfg.read_text() if cfg.is_file() else ""
        for h in r.job.kill_hosts:
            groups.setdefault((h, text), (cfg, []))[1].append(r.job.run_id)
    replies: dict[str, dict[str, str]] = {}  # run id -> host -> reply

    def one(key: tuple[str, str]) -> None:
        host = key[0]
        cfg, ids = groups[key]
        script = in_home(_REMOVE.replace("@RUNS@", P.RUNS_DIR))
        argv = ssh_argv(cfg, host, "bash", "-c", sh_word(script), "nodeops-clean",
                             *(sh_word(store.check_run_id(i)) for i in ids))  # fmt: skip
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            said = {ln.split()[1]: ln for ln in p.stdout.splitlines() if len(ln.split()) >= 2}
            why = "" if p.returncode == 0 else "unreachable: " + last_line(p.stderr, f"ssh exited {p.returncode}")
        except subprocess.TimeoutExpired:
            said, why = {}, "unreachable: ssh timed out"
        for i in ids:
            replies.setdefault(i, {})[host] = said.get(i, why or "no answer")

    fan_out(list(groups), one, width=64)
    for r in runs:
        bad = [f"{h}: {reply}" for h, reply in replies.get(r.job.run_id, {}).items()
               if not reply.startswith(("removed ", "gone "))]  # fmt: skip
        if bad and not (forget_unreachable and all(b.split(": ", 1)[1].startswith("unreachable") for b in bad)):
            out.problems[r.job.run_id] = bad
            continue
        if not rmtree(r.job.dir):
            out.problems[r.job.run_id] = [f"here: could not remove {r.job.dir}"]
            continue
        out.removed_local.append(r.job.run_id)
        out.freed += r.size
    return out


# --------------------------------------------------------------------------- playbook artifacts
_ARTIFACT_DIR = re.compile(r"^[a-z]+-\d{8}-\d{6}-[0-9a-f]{6}$")


@dataclass
class Artifacts:
    path: Path
    started: float
    running: bool
    size: int


def artifact_dirs(base: Path) -> list[Artifacts]:
    """The playbook runs' private dirs (setup, check, launch --via ansible, --sync), newest first.
    One is running while the nodeops process that wrote its ``nodeops.pid`` lives."""
    out = []
    for d in sorted((p for p in base.iterdir() if p.is_dir() and _ARTIFACT_DIR.match(p.name)), reverse=True):
        stamp = "-".join(d.name.split("-")[1:3])
        try:
            started = time.mktime(time.strptime(stamp, "%Y%m%d-%H%M%S"))
        except ValueError:
            continue
        pid = d / "nodeops.pid"
        running = _pid_alive(pid) if pid.exists() else time.time() - d.stat().st_mtime < 3600
        out.append(Artifacts(d, started, running, _size(d)))
    return out


def choose_artifacts(dirs: Sequence[Artifacts], *, older_than: float | None, keep: int | None,
                     now: float | None = None) -> list[Artifacts]:  # fmt: skip
    now = time.time() if now is None else now
    kept = {a.path for a in dirs[: keep or 0]} if keep is not None else set()
    return [a for a in dirs if not a.running and a.path not in kept
            and (older_than is None or now - a.started >= older_than)]  # fmt: skip


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
