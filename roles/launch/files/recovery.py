"""nodeops launch: automatic restarts (``launch.restarts``), the rules. Stdlib only (Python 3.8+),
shipped beside the supervisor, which applies them on the chief; the controller reads the same
records (``attempts.json``) to show them.

When an attempt fails, the supervisor asks, in order:

- what kind of failure it was (:func:`kind_of`): ``lost`` (a host's guard or agent gone: the
  machine, its ssh or the agent died), ``hang`` (the hang watchdog), ``signal`` (a rank or the
  job killed by a signal, the OOM killer included), ``peer`` (ranks that only report a lost
  peer), ``script`` (the script's own error: an exit code of its own);
- whether it restarts (:func:`should_restart`): ``restart_on: infra`` restarts every kind but
  ``script``; ``any`` restarts them all; never more than ``restarts`` times;
- on which hosts (:func:`next_hosts`): an infrastructure fault excludes the culprit host (the one
  the root-cause rule named); the first spare left takes its node rank, else the run goes on with
  one node fewer while that leaves at least ``min_nodes``; the chief is never excluded (it runs
  rank 0 and this supervisor);
- after how long (:func:`backoff`): ``restart_backoff`` doubled per restart, at most 60 s;
- whether it is a loop (:func:`loop`): the same failure (:func:`signature`: its kind, the
  culprit's node rank, its exit code or signal in words) after the culprit was replaced by
  another host is the job's own fault (a bad shard, a poisoned checkpoint), which no node swap
  fixes: the run stops there, naming the hosts excluded for it.

Each attempt's ranks get :func:`attempt_env` (node count, node rank, world size, restart count).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

INFRA = ("lost", "hang", "signal", "peer")  # the kinds restart_on: infra restarts
KINDS = (*INFRA, "script")
MAX_BACKOFF = 60.0
BEGUN = "@@nodeops-begun"  # agent.py begin: this host is ready for the attempt


def kind_of_exit(code: Any) -> str:
    """A job's or a worker's exit code: killed by a signal (negative, as torchrun reports a worker
    that died of one, or 128+N from a shell) or the script's own error."""
    try:
        n = int(code)
    except (TypeError, ValueError):
        return "lost"
    return "signal" if n < 0 or n > 128 else "script"


def kind_of_worker(code: str, peer: bool, raised: bool) -> str:
    """A worker torchrun reported as failed (``code``: its exit code, "" when unknown): ``peer``
    when its host's lines say a peer went away first; ``script`` when it exited with a code of its
    own, or died of a signal after the script raised (``raised``: the ranks' hook marked an
    exception the script did not catch, agent.raised); else ``signal``."""
    if peer:
        return "peer"
    kind = kind_of_exit(code) if code else "signal"
    return "script" if kind == "signal" and raised else kind


def finished_then_crashed(kind: str, finished: list[tuple[int, int] | None]) -> bool:
    """Whether a failure (its ``kind``) came after every rank had finished its work: each job
    host's (ranks that ended their script, ranks started) says every started rank finished, and
    the failure is a rank's death, not a lost host or a hang."""
    counted = [f for f in finished if f is not None]
    return (kind in ("signal", "script", "peer") and bool(counted) and len(counted) == len(finished)
            and all(started > 0 and done >= started for done, started in counted))  # fmt: skip


def should_restart(kind: str, restart_on: str, done: int, restarts: int) -> tuple[bool, str]:
    """Whether attempt ``done`` (1-based) that failed with ``kind`` is followed by another, and
    if not, why not (said in the verdict)."""
    if restarts <= 0:
        return False, ""
    if kind == "teardown":
        return False, "every rank had finished its work before one crashed in its teardown: not running it again"
    if done > restarts:
        return False, f"no restart left ({restarts} used)"
    if restart_on != "any" and kind not in INFRA:
        return False, "the script's own error (restart_on: infra restarts only infrastructure faults)"
    return True, ""


def signature(kind: str, rank: int | None, code: Any, why: str, step: int | None = None) -> list[Any]:
    """What tells one failure from another across attempts: its kind, the culprit's node rank
    (None: no host blamed), what it was, the same however it was reported: the signal or exit
    code (``code``: a shell's 128+N and torchrun's -N are both signal N), else its words without
    durations (a hang's 'no progress for 41s' is the same hang after 43 s), and the training step
    its host last printed (None: unknown): the same failure at another step is another failure."""
    if isinstance(code, int) and not isinstance(code, bool):
        what = f"signal {-code}" if code < 0 else f"signal {code - 128}" if code > 128 else f"exit code {code}"
    else:
        what = re.sub(r"\b\d+(?:\.\d+)?\s?s\b", "N s", why)
    return [kind, rank, what, step]


def loop(earlier: Sequence[dict[str, Any]], sig: list[Any], culprit: str | None) -> str:
    """Why the run must not restart again, or '': an earlier attempt failed with the same
    signature on another host (so replacing that host did not help). A lost host is a host's
    fault every time; a failure nobody is blamed for has no host to compare."""
    if sig[0] == "lost" or culprit is None:
        return ""
    same = [a for a in earlier if a.get("signature") == sig]
    if not same or same[-1].get("culprit") in (None, culprit):
        return ""
    hosts = " then ".join([*(str(a.get("culprit")) for a in same), culprit])
    excluded = [h for a in same for h in a.get("excluded") or []]
    at = f" at step {sig[3]}" if len(sig) > 3 and sig[3] is not None else ""
    return (f"the same failure twice ({sig[0]} at node rank {sig[1]}: {sig[2]}{at}; on {hosts}): not a node fault; "
            "not restarting" + (f" ({', '.join(excluded)} excluded for it)" if excluded else ""))  # fmt: skip


def next_hosts(
    active: Sequence[dict[str, Any]],
    spares: Sequence[dict[str, Any]],
    culprit: str | None,
    exclude: bool,
    min_nodes: int,
) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None, str]:
    """The next attempt's hosts in node-rank order, the spare brought in (or None), and what was
    decided, in words. None for the hosts when the run cannot go on. ``active[0]`` is the chief."""
    names = [h["name"] for h in active]
    if not exclude or culprit is None or culprit not in names:
        return list(active), None, "on the same nodes"
    if culprit == names[0]:
        return list(active), None, f"on the same nodes ({culprit} is the chief, which cannot be excluded)"
    at = names.index(culprit)
    if spares:
        spare = spares[0]
        new = [*active[:at], spare, *active[at + 1 :]]
        return new, spare, f"{culprit} excluded; spare {spare['name']} takes its node rank {at}"
    if len(active) - 1 >= min_nodes:
        new = [*active[:at], *active[at + 1 :]]
        return new, None, f"{culprit} excluded; no spare left: going on with {len(new)} node(s) (min_nodes {min_nodes})"
    return None, None, (f"{culprit} excluded and no spare left: {len(active) - 1} node(s) would be fewer than "
                        f"min_nodes {min_nodes}")  # fmt: skip


def backoff(base: float, restart: int) -> float:
    """Seconds before restart number ``restart`` (1 for the first)."""
    return float(min(MAX_BACKOFF, max(0.0, base) * 2.0 ** max(0, restart - 1)))


def attempt_env(hosts: Sequence[dict[str, Any]], name: str, restart: int) -> str:
    """``attempt.env`` for host ``name`` in an attempt on ``hosts`` (node-rank order, each with
    its ``nproc``): sourced by job.sh after everything else, so these win. Digits only."""
    names = [h["name"] for h in hosts]
    world = sum(int(h.get("nproc", 1)) for h in hosts)
    rank = names.index(name)
    values = {"NNODES": len(hosts), "NODE_RANK": rank, "WORLD_SIZE": world, "PET_NNODES": len(hosts),
              "PET_NODE_RANK": rank, "NODEOPS_RESTART_COUNT": restart, "NODEOPS_ATTEMPT": restart + 1}  # fmt: skip
    return "".join(f"export {k}={int(v)}\n" for k, v in values.items())


def marker(attempt: int, total: int, hosts: Sequence[str], name: str, why: str) -> str:
    """The line each host's log starts an attempt with (`nodeops logs` shows where each begins)."""
    return (f"==> nodeops: attempt {attempt}/{total} on {','.join(hosts)} (node rank {list(hosts).index(name)})"
            + (f"; {why}" if why else ""))  # fmt: skip


def describe(a: dict[str, Any], total: int) -> str:
    """One attempt in one line: 'attempt 2/3 on node1,node2,node4: failed (node3 lost: ...); node3 excluded'."""
    head = f"attempt {a.get('attempt')}/{total} on {','.join(a.get('hosts') or [])}"
    outcome = a.get("outcome")
    if outcome is None:
        return head + ": running"
    if outcome == "ok":
        return head + ": finished, every rank exited 0"
    if outcome == "stopped":
        return head + ": stopped on request"
    text = f"{head}: {outcome}"
    if a.get("culprit"):
        text += f" ({a.get('kind')} on {a['culprit']}: {a.get('why', '')})"
    if a.get("decision"):
        text += f"; {a['decision']}"
    return text


def summary(attempts: Sequence[dict[str, Any]], total: int) -> list[str]:
    """Every attempt in a line (:func:`describe`), once there was more than one or a decision
    was made; else []."""
    if len(attempts) < 2 and not any(a.get("decision") for a in attempts):
        return []
    return [describe(a, total) for a in attempts]


# --------------------------------------------------------------------------- the run's timeline
def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def fault_time(a: dict[str, Any]) -> float | None:
    """When an attempt's fault happened: a hang or a lost host at its last progress (nothing
    was seen after it), any other failure when it was reported."""
    t = a.get("times") or {}
    if a.get("kind") in ("hang", "lost") and t.get("last_progress"):
        return float(t["last_progress"])
    return float(t["failed"]) if t.get("failed") else None


def incident(a: dict[str, Any], nxt: dict[str, Any] | None) -> str:
    """One fault in a line of offsets from when it happened: detected, ranks stopped, the next
    attempt's preflight done, its ranks started, training again (its ranks printed), e.g.
    'attempt 1 -> 2: lost on node3 at 12:01:07; detected +2.1 s; stopped +3.0 s; ...'. '' for an
    attempt without a recorded fault."""
    t = a.get("times") or {}
    at = fault_time(a)
    if at is None:
        return ""
    # a reported failure is detected when it happens: its "detected +0.0 s" says nothing
    detected = t.get("failed") if a.get("kind") in ("hang", "lost") else None
    marks = [("detected", detected), ("stopped", t.get("ended") if t.get("stop_sent") else None),
             ("preflight", a.get("preflight_done")), ("started", (nxt or {}).get("started")),
             ("training again", ((nxt or {}).get("times") or {}).get("ranks_up"))]  # fmt: skip
    head = f"attempt {a.get('attempt')}" + (f" -> {nxt.get('attempt')}" if nxt else "")
    said = "; ".join(f"{name} +{float(v) - at:.1f} s" for name, v in marks if v)
    return f"{head}: {a.get('kind') or 'failure'} on {a.get('culprit') or '?'} at {_clock(at)}" + (
        f"; {said}" if said else "")  # fmt: skip


def goodput(attempts: Sequence[dict[str, Any]], stalls: Sequence[dict[str, Any]] = ()) -> dict[str, float] | None:
    """The run's goodput from its attempts' timelines: the share of its wall time in which
    training ran (every host's ranks printed, until the fault or the end), and the time lost,
    split into start-up (the first attempt's, to its ranks' first lines), faults (from each
    fault to the ranks stopped), restarts (from there to the next attempt's training) and stalls
    (the stall watch's reports: from the last progress to progress again, or to the attempt's
    end). None when the timeline is missing (a run of an older release)."""
    timed = [a for a in attempts if (a.get("times") or {}).get("began")]
    if not timed or len(timed) != len(attempts):
        return None
    t0 = float(timed[0]["times"]["began"])
    end = max(float((a.get("times") or {}).get("ended") or a.get("ended") or t0) for a in timed)
    wall = max(end - t0, 1e-9)
    train = startup = faults = restarts = 0.0
    for i, a in enumerate(timed):
        t = a["times"]
        up = t.get("ranks_up")
        stop = fault_time(a) or float(t.get("ended") or t["began"])
        if up is not None:
            train += max(0.0, stop - float(up))
        if i == 0:
            startup = max(0.0, float(up if up is not None else stop) - float(t["began"]))
        if fault_time(a) is not None:
            faults += max(0.0, float(t.get("ended") or stop) - stop)
            if i + 1 < len(timed):
                nxt = timed[i + 1]["times"]
                restarts += max(0.0, float(nxt.get("ranks_up") or nxt.get("ended") or nxt["began"])
                                - float(t.get("ended") or stop))  # fmt: skip
    stalled = sum(max(0.0, float(st.get("ended") or end) - float(st.get("since") or end)) for st in stalls)
    stalled = min(stalled, train)
    train -= stalled
    return {"goodput": round(train / wall, 4), "wall": round(wall, 1), "training": round(train, 1),
            "startup": round(startup, 1), "faults": round(faults, 1), "restarts": round(restarts, 1),
            "stalls": round(stalled, 1)}  # fmt: skip


def goodput_line(g: dict[str, float]) -> str:
    """'goodput 87% of 1h02m: lost 41.0 s to start-up, 3.1 s to faults, 12.4 s to restarts'."""
    lost = [f"{g[k]:.1f} s to {k.replace('startup', 'start-up')}"
            for k in ("startup", "faults", "restarts", "stalls") if g.get(k)]  # fmt: skip
    return f"goodput {g['goodput'] * 100:.0f}% of {g['wall']:.1f} s" + (f": lost {', '.join(lost)}" if lost else "")
