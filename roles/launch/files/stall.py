"""nodeops launch: the stall watch (stdlib only, Python 3.8+), shipped beside ``supervisor.py``.

On by default, with no number to choose. The supervisor hears every host's progress (a rank's
output, or the script touching ``$NODEOPS_PROGRESS_FILE``: at most once a second per host) and
:class:`Rhythm` learns the run's own pace from it, once every host's ranks have printed: the
longest gap between two progress events, overall and per host. A stall is suspected when no
progress came for ``FACTOR`` times that gap, and never sooner than ``FLOOR`` after the last one.
Only then are the ranks' stacks taken (nothing is sent to a rank before: the watch costs them
nothing), and :func:`verdict` reads them:

- a rank that is not waiting in a collective while others are (``fetch_batch (train.py:11)``
  against ``all_reduce``), or the ranks whose stack differs from the majority's, are the
  stall's culprits: it is reported, live, without stopping anything;
- every rank in the same frame, or the odd ranks writing a checkpoint while the others wait in
  a collective, is a healthy quiet phase: it says so and looks again later (at twice the
  silence). A quiet phase that ends by itself is learned: later silences up to ``STRETCH``
  times its length are not suspected again.

A stall is reported once; progress ends it, and a new stall gets a new report. Stopping a hung
run stays the hard timeout's job (``launch.hang_timeout``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

if __package__:
    from . import stacks as S
else:  # shipped: stacks.py lies beside this file
    import stacks as S  # type: ignore[import-not-found,no-redef]

FLOOR = 5.0  # seconds of silence below which nothing is ever suspected
FACTOR = 4.0  # a silence of this many times the longest gap seen is suspected
MIN_GAPS = 3  # a host's own pace counts once this many gaps were seen there
STRETCH = 1.5  # a healthy quiet phase of T seconds: silences up to STRETCH * T are not suspected again
RECHECK = 2.0  # a silence that looked healthy is looked at again when it is this many times as long
NOTE_MARK = "@@nodeops-note "  # a line the supervisor adds to the chief's host.log: a notice, not the job's


# Frames of a rank that waits for its peers (torch.distributed's collectives and their waits).
COLLECTIVE = re.compile(
    r"^(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|monitored_barrier|all_to_all\w*|reduce|"
    r"gather|scatter|send|recv|isend|irecv|wait|_wait|synchronize|batch_isend_irecv|_store_based_barrier)$"
)
COLLECTIVE_FILES = ("distributed_c10d.py", "c10d_logger.py", "torch/distributed/")
# Frames of a rank that writes a checkpoint (torch.save, distributed checkpointing, safetensors).
CHECKPOINT = re.compile(r"save|checkpoint|serializ|write|flush|fsync|dump|pickle", re.I)


class Rhythm:
    """The run's pace, learned from its progress events (monotonic seconds)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # host -> its last progress
        self.longest: dict[str, float] = {}  # host -> the longest gap between two of its events
        self.gaps: dict[str, int] = {}  # host -> how many gaps were seen there
        self.overall_last = 0.0
        self.overall_longest = 0.0
        self.quiet = 0.0  # the longest healthy quiet phase that ended by itself
        self.learning = False  # from every host's first progress on

    def beat(self, host: str, now: float) -> None:
        if self.learning:
            if host in self.last:
                self.longest[host] = max(self.longest.get(host, 0.0), now - self.last[host])
                self.gaps[host] = self.gaps.get(host, 0) + 1
            if self.overall_last:
                self.overall_longest = max(self.overall_longest, now - self.overall_last)
        self.last[host] = now
        self.overall_last = now

    def start(self, now: float) -> None:
        """Every host's ranks are up: the pace is learned from here (start-up's silences are not)."""
        if not self.learning:
            self.learning = True
            self.last = dict.fromkeys(self.last, now)
            self.overall_last = now

    def resume(self, now: float) -> None:
        """A silence that was looked at ended: every host counts from now (its length is no step's)."""
        self.last = dict.fromkeys(self.last, now)
        self.overall_last = now

    def limit(self, host: str | None = None) -> float:
        """How long a silence (of ``host``, or of every host) may last before it is suspected."""
        longest = self.overall_longest if host is None else self.longest.get(host, 0.0)
        return max(FLOOR, FACTOR * longest, STRETCH * self.quiet)

    def suspect(self, now: float, hosts: list[str]) -> tuple[float, list[str], bool] | None:
        """A silence beyond the pace among ``hosts`` (those whose job runs): how long, the hosts
        gone quiet, and whether it is every host's (else only theirs: their own pace broke while
        the others went on); None when there is none."""
        if not self.learning or not self.overall_last or not hosts:
            return None
        idle = now - self.overall_last
        if idle > self.limit():
            return idle, list(hosts), True
        late = [h for h in hosts if h in self.last and self.gaps.get(h, 0) >= MIN_GAPS
                and now - self.last[h] > self.limit(h)]  # fmt: skip
        if late and idle < self.limit() / 2:  # the others do go on (not a silence of every host, seen early)
            return max(now - self.last[h] for h in late), late, False
        return None


def innermost(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    return frames[0] if frames else None


def waits(frames: list[dict[str, Any]]) -> bool:
    """Whether a stack waits for peers: a collective (or its wait) among its innermost frames."""
    for f in frames[:6]:
        func, file = str(f.get("func", "")), str(f.get("file", ""))
        if COLLECTIVE.match(func) and any(k in file for k in COLLECTIVE_FILES):
            return True
    return False


def writes_checkpoint(frames: list[dict[str, Any]]) -> bool:
    return any(CHECKPOINT.search(f"{f.get('func', '')} {S.short(str(f.get('file', '')))}") for f in frames)


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame: ``all_reduce (torch/distributed/distributed_c10d.py:2501)``."""
    return S.frames_text(frames[:1], 1) if frames else "(no Python frame)"


def who(g: dict[str, Any]) -> str:
    many = len(g["ranks"]) > 1
    return f"rank{'s' if many else ''} {S.span(g['ranks'])} ({', '.join(g['hosts'])})"


def verdict(dumps: list[dict[str, Any]], idle: float) -> dict[str, Any]:
    """What the stacks of a silent run say: ``{"kind": "stall" | "quiet" | "none", "line",
    "culprits": [group lines], "groups": [group lines], "host", "method"}``. ``none``: no rank is
    alive (the run is ending)."""
    methods = sorted({str(d.get("method")) for d in dumps if d.get("method")})
    base: dict[str, Any] = {"idle_seconds": round(idle, 1), "method": ", ".join(methods) or "none",
                            "ranks": len({d["rank"] for d in dumps})}  # fmt: skip
    dumps = S.running(dumps)
    if not dumps:
        return dict(base, kind="none", line="no rank runs its script", culprits=[], groups=[], host="")
    groups = S.group(dumps)
    base["groups"] = [S.group_line(g) for g in groups]
    live = [g for g in groups if not g["error"]]
    waiting = [g for g in live if waits(g["frames"])]
    busy = [g for g in live if not waits(g["frames"])]
    unread = [g for g in groups if g["error"]]
    if len(live) == 1 and not unread:
        line = f"every rank waits in the same place, {where(live[0]['frames'])}: a quiet phase, not a stall"
        return dict(base, kind="quiet", culprits=[], host="", line=line)
    culprits = busy if waiting and busy else [g for g in live if g["odd"]]
    if culprits and waiting and all(writes_checkpoint(g["frames"]) for g in culprits):
        text = "; ".join(f"{who(g)} in {where(g['frames'])}" for g in culprits)
        line = f"{text} (writing a checkpoint?) while {others(waiting)}: a quiet phase, not a stall"
        return dict(base, kind="quiet", culprits=[], host="", line=line)
    if not culprits:
        culprits = unread  # a rank whose stack could not be read, among ranks that agree on none
    if not culprits:
        return dict(base, kind="stall", culprits=[], host="",
                    line=f"no progress for {idle:.0f}s; no rank's stack differs from the others'")  # fmt: skip
    first = culprits[0]
    rest = [g for g in groups if g not in culprits]
    verb = "have" if len(first["ranks"]) > 1 else "has"
    text = (f"{who(first)} {verb} made no progress for {idle:.0f}s, in {where(first['frames'])}" if not first["error"]
            else f"{who(first)}: no stack ({first['error']})")  # fmt: skip
    more = [f"{who(g)} in {where(g['frames'])}" for g in culprits[1:]]
    line = "; ".join([text, *more] + ([others(rest)] if rest else []))
    return dict(base, kind="stall", culprits=[S.group_line(g) for g in culprits], host=(first["hosts"] or [""])[0],
                line=line)  # fmt: skip


def others(groups: list[dict[str, Any]]) -> str:
    """``ranks 0-2 wait in all_reduce (distributed_c10d.py:2501)`` for the groups not to blame."""
    parts = []
    for g in groups:
        many = len(g["ranks"]) > 1
        ranks = f"rank{'s' if many else ''} {S.span(g['ranks'])}"
        if g["error"]:
            parts.append(f"{ranks}: no stack ({g['error']})")
        elif waits(g["frames"]):
            parts.append(f"{ranks} {'wait' if many else 'waits'} in {where(g['frames'])}")
        else:
            parts.append(f"{ranks} {'are' if many else 'is'} in {where(g['frames'])}")
    return ", ".join(parts)


def note(text: str) -> str:
    """A notice line for the chief's host.log (one line, marked)."""
    return NOTE_MARK + " ".join(text.split()) + "\n"


def describe(st: dict[str, Any]) -> str:
    """One stall (``stalls.json``, a verdict's ``stalls``) as a timeline line: its last progress,
    when it was reported, when progress came again, and what the stacks said."""
    since = float(st.get("since") or st.get("at") or 0)
    at = time.strftime("%H:%M:%S", time.localtime(since))
    found = f"reported +{float(st.get('at') or since) - since:.1f} s"
    end = f"training again +{float(st['lasted']):.1f} s" if st.get("ended") else "no progress since"
    return f"stall: last progress at {at}; {found}; {end}: {st.get('line', '')}"


class Watch:
    """The stall watch's bookkeeping, the same for the ssh supervisor and Slurm's watch.py: the
    pace (:class:`Rhythm`), the silence being looked at, and every stall reported. The caller
    hears progress (:meth:`beat`), asks whether to take stacks (:meth:`due`), and hands them
    over (:meth:`judge`); ``say`` puts a notice where the user reads the run, ``save`` keeps
    the stalls (stalls.json), ``log`` the watch's own words."""

    def __init__(self, stalls: list[dict[str, Any]], say: Callable[[str], None],
                 save: Callable[[list[dict[str, Any]]], None], log: Callable[[str], None],
                 keep_dumps: bool = False) -> None:  # fmt: skip
        self.rhythm = Rhythm()
        self.stalls = stalls
        self.silence: dict[str, Any] = {}
        self.say, self.save, self.log, self.keep_dumps = say, save, log, keep_dumps

    def beat(self, hosts: list[str], now: float) -> None:
        """Progress from ``hosts``: a silence that was looked at ends (a reported stall is over;
        a quiet phase that ended by itself is learned), then the pace learns the beat."""
        s = self.silence
        if s and (s["overall"] or set(hosts) & set(s["hosts"])):
            took = now - s["since"]
            if s.get("reported"):
                self.stalls[s["index"]].update(ended=round(time.time(), 3), lasted=round(took, 1))
                self.save(self.stalls)
                self.say(f"stall over: progress again after {took:.0f}s")
            elif s.get("quiet"):
                self.rhythm.quiet = max(self.rhythm.quiet, took)
                self.log(f"the quiet phase ended after {took:.0f}s: silences up to {STRETCH * self.rhythm.quiet:.0f}s "
                         "are not suspected from now on")  # fmt: skip
            self.rhythm.resume(now)
            self.silence = {}
        for h in hosts:
            self.rhythm.beat(h, now)

    def due(self, now: float, hosts: list[str]) -> tuple[float, list[str], bool] | None:
        """A silence to look at now among ``hosts`` (stall.Rhythm.suspect), else None."""
        if self.silence and now < self.silence["next"]:
            return None
        got = self.rhythm.suspect(now, hosts)
        if got is not None and not self.silence:
            idle, late, overall = got
            self.silence = {"since": now - idle, "hosts": late, "overall": overall, "next": 0.0}
        return got

    def judge(self, dumps: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
        """The stacks of the silence being looked at: its verdict (None: progress came meanwhile).
        A stall is reported once; a quiet phase is said once; either is looked at again at
        RECHECK times the silence."""
        s = self.silence
        if not s:
            return None
        idle = now - s["since"]
        mine = dumps if s["overall"] else [d for d in dumps if d.get("host") in s["hosts"]] or dumps
        v = verdict(mine, idle)
        if not s["overall"] and v["kind"] != "none":
            line = f"{', '.join(s['hosts'])}: no progress for {idle:.0f}s while the others go on; "
            v = dict(v, kind="stall", line=line + "; ".join(v["groups"]))
        s["next"] = s["since"] + RECHECK * idle
        if v["kind"] == "none":
            self.log("stall watch: no rank runs its script on any host (the run is ending); watching on")
        elif v["kind"] == "quiet" and not s.get("quiet"):
            s["quiet"] = True
            self.log(f"stall watch: {v['line']}; looking again at {RECHECK * idle:.0f}s")
        elif v["kind"] == "stall" and not s.get("reported"):
            s.update(reported=True, index=len(self.stalls))
            self.stalls.append({"at": round(time.time(), 3), "since": round(time.time() - idle, 3),
                                "idle": round(idle, 1), "line": v["line"], "host": v["host"],
                                "culprits": v["culprits"], "groups": v["groups"], "method": v["method"],
                                "ranks": v["ranks"], "ended": None,
                                **({"dumps": dumps} if self.keep_dumps else {})})  # fmt: skip
            self.save(self.stalls)
            self.say(f"stall: {v['line']} (stacks by {v['method']}; the run goes on: `nodeops stacks` for more, "
                     f"`nodeops stop` to end it)")  # fmt: skip
            return dict(v, reported=True)
        return v
