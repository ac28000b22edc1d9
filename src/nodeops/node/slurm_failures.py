"""nodeops on Slurm: which node's failure ended a training step, and, with ``launch.restarts``,
what the next attempt inside the same allocation runs on. Stdlib only (Python 3.8+).

The controller reads a finished job's logs with :func:`first_failure`. A job with restarts also
ships this module, with what it imports, into its run dir as a package of its own
(``recover/nodeops/...``), and its batch script asks it, on the batch node:

    python3 -E -s -m nodeops.node.slurm_failures start RUN_DIR BATCH_NODE NODE...
        -> the first attempt's nodes (comma-separated): the batch node first, then the others,
           up to the job's node count; the rest of the allocation are the spares
    python3 -E -s -m nodeops.node.slurm_failures decide RUN_DIR ATTEMPT EXIT [SIGNAL]
        -> 'go NODES SECONDS' (the next attempt's nodes, after a back-off) or 'stop'
    python3 -E -s -m nodeops.node.slurm_failures begin RUN_DIR ATTEMPT
        -> the attempt starts now (recorded; each node's log marks where)
    python3 -E -s -m nodeops.node.slurm_failures abort RUN_DIR WHY
        -> the decided attempt will not start (the time-limit signal came): the record ends

``decide`` applies the ssh supervisor's rules (recovery.py) to what Slurm and the logs say:
a node whose heartbeats stopped (the batch driver's ``step.json``, which also holds the step's
timeline, kept with the attempt), a node whose task never ended when srun gave up on the step,
or one that Slurm marks not responding or down, was ``lost``; the hang watchdog's report is a
``hang``; else the root-cause rule of an ssh run picks among the nodes srun reported (``script``
for a rank's own exit code, ``signal``, or ``peer`` when only lost peers are reported). Every
attempt is kept in ``attempts.json`` in the ssh supervisor's form, which `launch`, `status` and
`logs` show.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nodeops.node import failures, mpi_split
from nodeops.node import protocol as P
from nodeops.node import recovery as R

RESTART_MARK = "nodeops: requeued, restart"  # in each node's log where a requeued run starts
ATTEMPT_MARK = "==> nodeops: attempt "  # where an attempt after a restart starts (recovery.marker)
CONFIG = "recover.json"  # in the run dir: the spec's restart rules (launch writes it)
ATTEMPTS = P.ATTEMPTS  # in the run dir: every attempt (the ssh supervisor's form, plus the nodes left)
PACKAGE_DIR = "recover"  # in the run dir: this module's package (nodeops/...), run with python3 -m
STEP = "step.json"  # in the run dir: the last training step's timeline and lost node (the batch driver's)
BATCH_LOG = "batch.log"
TAIL_LINES = failures.TAIL_LINES
LOST_STATES = ("DOWN", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWERING_DOWN")

_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? [0-9,-]+: (?:Exited with exit code (\d+)|(\w+))")
# srun naming a task's node ("srun: error: node2: task 1: ..."): the task numbers' own map
_SRUN_NAMED = re.compile(r"^srun: error: (\S+): tasks? ([0-9,-]+):")
# srun's list of a step's tasks when --wait ran out: those that never ended
_SRUN_RUNNING = re.compile(r"^srun: StepId=\S+ tasks? ([0-9,-]+): running")


def last_run(lines: Sequence[str]) -> list[str]:
    """A log's lines from the last run on: after the last requeue's or restart's mark (the whole
    log when the job never started again), with torchrun's rank lines made whole
    (:class:`mpi_split.RankLines`)."""
    lines = mpi_split.rank_lines(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith((RESTART_MARK, ATTEMPT_MARK))]
    return list(lines[starts[-1] + 1 :] if starts else lines)


def _states(batch_lines: Sequence[str], tails: Tails | None) -> dict[str, failures.HostState]:
    """Each node srun reported as ended badly, in the order it reported them."""
    states: dict[str, failures.HostState] = {}
    for i, line in enumerate(batch_lines):
        m = _SRUN_TASK.match(line)
        if m is None or m.group(1) in states or m.group(2) == "0":
            continue
        code = int(m.group(2)) if m.group(2) else -1
        st = failures.HostState(m.group(1), exit_code=code, ended_at=float(i))
        st.tail.extend((tails or {}).get(m.group(1), []))
        states[st.host] = st
    return states


if TYPE_CHECKING:  # (not at run time: Python 3.8 on a node cannot subscript collections.abc)
    Tails = Mapping[str, Sequence[str]]  # each node's last lines


def first_failure(batch_lines: Sequence[str], tails: Tails | None = None) -> tuple[str, int] | None:
    """(host, code) of the node whose failure started it. srun reports each node whose task
    ended badly ("Exited with exit code N", or "Terminated" once --kill-on-bad-exit stopped
    it), but not in causal order: a node whose ranks lost a peer can exit first. The same rule
    as ssh runs (failures.root_cause) picks among them: a node whose own rank failed beats one whose
    ranks report a lost peer, then the earliest. Under mpirun, mpirun names the first rank that
    failed itself (mpi_split.py's line in the batch log), and that is the answer."""
    for line in batch_lines:  # runner mpirun: mpirun itself names the first rank that failed (mpi_split.py)
        m = mpi_split.FAILURE.match(line)
        if m is not None:
            return m.group(2), int(m.group(3)) or 1
    cause = failures.root_cause(list(_states(batch_lines, tails).values()))
    if cause is None:
        return None
    code = failures.failure_code(cause) or 1
    # srun's stop can reach a launcher still ending its ranks (DeepSpeed's exits on the signal
    # then: 143): the code its own rank exited with is the failure's
    return cause.host, (failures.rank_code(cause.tail) or code) if code > 128 else code


def _task_ids(text: str) -> list[int]:
    """srun's task list ("0-1,3") as numbers."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def lost_nodes(batch_lines: Sequence[str], step_nodes: Sequence[str],
               node_states: Mapping[str, str]) -> list[tuple[str, str]]:  # fmt: skip
    """The step's nodes that were lost, each with why: a task srun still listed as running when
    it gave up on the step (its node as srun named it elsewhere, else the step's i-th node in the
    allocation's order: one task per node), or a node Slurm marks not responding or down
    (``node_states``: scontrol's State= of each node)."""
    out: dict[str, str] = {}
    named = {i: m.group(1) for line in batch_lines for m in [_SRUN_NAMED.match(line)] if m
             for i in _task_ids(m.group(2))}  # fmt: skip
    # the tasks srun did not name: the step's other nodes, in order
    unnamed = [n for n in step_nodes if n not in named.values()]
    rest = {i: unnamed.pop(0) for i in range(len(step_nodes)) if i not in named and unnamed}
    for line in batch_lines:
        m = _SRUN_RUNNING.match(line)
        for i in _task_ids(m.group(1)) if m else []:
            node = named.get(i) or rest.get(i)
            if node is not None:
                out.setdefault(node, "its task never ended (srun gave up waiting for it)")
    for node in step_nodes:
        state = node_states.get(node, "")
        # scontrol's "+NOT_RESPONDING", or the "*" older Slurm (and sinfo) append instead
        flags = set(re.split(r"[+*]", state)) | ({"NOT_RESPONDING"} if state.endswith("*") else set())
        bad = sorted(flags & set(LOST_STATES))
        if bad:
            out[node] = f"Slurm marks it {'+'.join(bad)}" + (f"; {out[node]}" if node in out else "")
    return [(n, out[n]) for n in step_nodes if n in out]


def _raised(run_dir: str, host: str, tail: Sequence[str], since: float) -> str | None:
    """The exception the failed worker torchrun names (its pid) on ``host`` did not catch, when
    the ranks' hook marked one during this attempt (raised/HOST-PID.txt, HOST Slurm's name for
    the node: pids repeat across nodes), else None."""
    pid = next((m.group(2) for line in tail for m in [P.AGENT_FAILED.search(line)] if m and m.group(2)), None)
    for mark in glob.glob(os.path.join(run_dir, "raised", f"{glob.escape(host)}-{pid}.txt")) if pid else []:
        try:
            if os.path.getmtime(mark) >= since - 1:
                with open(mark, errors="replace") as f:
                    return f.read()
        except OSError:
            continue
    return None


def classify(batch_lines: Sequence[str], tails: Tails, step_nodes: Sequence[str],
             node_states: Mapping[str, str], hang: Mapping[str, Any] | None = None,
             run_dir: str = "", since: float = 0.0,
             silent: Mapping[str, Any] | None = None) -> tuple[str, str | None, str]:  # fmt: skip
    """A failed attempt's fault, as the ssh supervisor names it: (kind, the node blamed or None,
    why). ``batch_lines``: the batch log since the attempt began; ``tails``: each node's lines;
    ``silent``: the node whose heartbeats stopped (the batch driver's, which ended the step)."""
    if silent and silent.get("node") in step_nodes:
        return "lost", str(silent["node"]), str(silent.get("why") or "its heartbeats stopped")
    if hang is not None:
        host = hang.get("host")
        return "hang", (str(host) if host else None), str(hang.get("why") or "no progress")
    lost = lost_nodes(batch_lines, step_nodes, node_states)
    if lost:
        return "lost", lost[0][0], lost[0][1]
    cause = failures.root_cause(list(_states(batch_lines, tails).values()))
    if cause is None:
        return "lost", None, "srun ended the step with no node reported as failed"
    if any(P.PEER_LOST.search(line) for line in cause.tail):  # every node only lost a peer
        return "peer", None, "its ranks lost a peer (no node was lost)"
    own = failures.rank_code(cause.tail)
    if own is not None:
        return "script", cause.host, f"exited {own}"
    # the worker's own code, as torchrun reported it (srun has torchrun's: 1 whatever ended the
    # worker), else the task's (srun's "Killed": -1, no code of its own)
    worker = next((m.group(1) for line in cause.tail for m in [P.AGENT_FAILED.search(line)] if m), None)
    code = worker or ("" if cause.exit_code in (None, -1) else str(cause.exit_code))
    threw = _raised(run_dir, cause.host, cause.tail, since) if run_dir else None
    if threw is not None and P.PEER_LOST.search(threw):
        return "peer", None, "its ranks lost a peer (no node was lost)"
    kind = R.kind_of_worker(code, False, threw is not None)
    why = (f"a rank's exit code {code}" if worker else f"exit code {code}" if code else "killed") + (
        ", after an uncaught exception" if threw else "")  # fmt: skip
    return kind, cause.host, why


# --------------------------------------------------------------------------- on the batch node
def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _lines(path: str, limit: int = 4 << 20) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return P.log_lines(f.read().decode("utf-8", "replace"))
    except OSError:
        return []


def node_states(nodes: Sequence[str]) -> dict[str, str]:
    """scontrol's State= of each node ('' where it does not say)."""
    out: dict[str, str] = {}
    for node in nodes:
        try:
            p = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            out[node] = ""
            continue
        m = re.search(r"\bState=(\S+)", p.stdout)
        out[node] = m.group(1) if m else ""
    return out


def start(run_dir: str, batch_node: str, nodes: Sequence[str]) -> list[str]:
    """The first attempt's nodes: the batch node (it runs the batch script and rank 0, so it is
    never excluded), then the allocation's others up to the job's count; the rest are spares.
    ``nodes``: the allocation in Slurm's order (a step numbers its tasks in that order)."""
    cfg = _read_json(os.path.join(run_dir, CONFIG))
    count = int(cfg["nodes"])
    order = [batch_node, *[n for n in nodes if n != batch_node]] if batch_node in nodes else list(nodes)
    if len(order) < count:
        raise ValueError(f"the allocation has {len(order)} node(s), fewer than the job's {count}")
    active, spares = order[:count], order[count:]
    doc = {"total": int(cfg["restarts"]) + 1, "allocation": list(nodes), "active": active, "spares": spares,
           "attempts": [{"attempt": 1, "hosts": active, "started": time.time()}]}  # fmt: skip
    _write_json(os.path.join(run_dir, ATTEMPTS), doc)
    return active


def _step(run_dir: str, attempt: int) -> dict[str, Any]:
    """The batch driver's record of attempt ``attempt``'s step ({} when there is none for it)."""
    try:
        got = _read_json(os.path.join(run_dir, STEP))
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) and got.get("attempt") == attempt else {}


def _close(doc: dict[str, Any], path: str, decision: str) -> None:
    """The run ends with the last attempt: what was decided, and the record done."""
    if decision:
        doc["attempts"][-1]["decision"] = decision
    doc["done"] = True
    _write_json(path, doc)


def decide(run_dir: str, attempt: int, code: int, signal: str = "") -> tuple[list[str], float] | None:
    """After attempt ``attempt`` ended with ``code`` (srun's): record it, and return the next
    attempt's nodes and back-off (:func:`begin` then starts it), or None when the run ends here."""
    cfg = _read_json(os.path.join(run_dir, CONFIG))
    path = os.path.join(run_dir, ATTEMPTS)
    doc = _read_json(path)
    a = doc["attempts"][-1]
    if a.get("attempt") != attempt:
        raise ValueError(f"attempts.json's last attempt is {a.get('attempt')}, not {attempt}")
    active: list[str] = list(doc["active"])
    a["ended"] = time.time()
    step = _step(run_dir, attempt)
    if step.get("times"):
        a["times"] = step["times"]
    hang_path = os.path.join(run_dir, "hang.json")
    hang: dict[str, Any] | None = None
    if os.path.exists(hang_path):
        try:
            got = _read_json(hang_path)
        except (OSError, ValueError):
            got = {}
        hang = got if isinstance(got, dict) else {}
    a["outcome"] = "ok" if code == 0 else "hung" if hang is not None else "failed"
    if code == 0:
        _close(doc, path, "")
        return None
    batch = last_run(_lines(os.path.join(run_dir, BATCH_LOG)))
    tails = {n: last_run(_lines(os.path.join(run_dir, "logs", f"{n}.log"), 1 << 20))[-TAIL_LINES:] for n in active}
    states = node_states([*active, *doc["spares"]])
    # srun numbers a step's tasks in the allocation's order, whatever --nodelist's order
    allocation = list(doc.get("allocation") or active)
    in_order = sorted(active, key=lambda n: allocation.index(n) if n in allocation else len(allocation))
    kind, culprit, why = classify(batch, tails, in_order, states, hang, run_dir, float(a.get("started") or 0),
                                  step.get("lost"))  # fmt: skip
    finished = step.get("finished") or {}  # the batch driver's count: [ranks that ended their script, started]
    if R.finished_then_crashed(kind, [tuple(finished[n]) if n in finished else None for n in active]):
        kind, why = "teardown", f"{why}, after every rank had finished its work (it crashed in its teardown)"
    # its place in the attempt's nodes (a spare takes the culprit's place there; c10d gives ranks by arrival)
    rank = active.index(culprit) if culprit in active else None
    a.update(kind=kind, culprit=culprit, why=why, signature=R.signature(kind, rank, None, why))
    again, why_not = R.should_restart(kind, str(cfg.get("restart_on") or "infra"), attempt, int(cfg["restarts"]))
    if again and signal:
        again, why_not = False, f"{signal} came (the time limit is near)"
    if again:
        why_not = R.loop(doc["attempts"][:-1], a["signature"], culprit)
        again = not why_not
    if not again:
        _close(doc, path, f"no restart: {why_not}")
        return None
    # spares Slurm marks lost are never brought in
    spares = [{"name": n} for n in doc["spares"] if not lost_nodes([], [n], states)]
    hosts, spare, decision = R.next_hosts([{"name": n} for n in active], spares, culprit, kind in R.INFRA,
                                          int(cfg.get("min_nodes") or len(active)))  # fmt: skip
    # torchrun's c10d rendezvous gives node ranks in the order the nodes join: a spare takes the
    # failed node's place, not its rank (the ssh backend's static ranks say the rank)
    decision = re.sub(r"takes its node rank \d+", "takes its place", decision).replace(
        "is the chief, which cannot", "is the batch node, which cannot"
    )
    if hosts is None:
        _close(doc, path, f"no restart: {decision}")
        return None
    new = [h["name"] for h in hosts]
    wait = R.backoff(float(cfg.get("backoff") or 0), attempt)
    a.update(decision=decision, excluded=[culprit] if culprit is not None and culprit not in new else [], backoff=wait)
    # the next nodes are ready: the job's preflight step probed them all, and Slurm's states were read just now
    a["preflight_done"] = round(time.time(), 3)
    if hang is not None:  # this attempt's report, kept under its own name: the next starts clean
        os.replace(hang_path, os.path.join(run_dir, f"hang.attempt-{attempt}.json"))
    note = f"after attempt {attempt}: {kind} on {culprit}" + (f"; {culprit} excluded" if a["excluded"] else "")
    doc.update(active=new, spares=[n for n in doc["spares"] if spare is None or n != spare["name"]],
               next={"hosts": new, "note": note})  # fmt: skip
    _write_json(path, doc)
    return new, wait


def begin(run_dir: str, attempt: int) -> list[str]:
    """Attempt ``attempt`` (after a restart) starts now, on the nodes :func:`decide` chose: it is
    added to the record, and each node's log and the batch log mark where it begins (last_run
    cuts there). Returns its nodes."""
    path = os.path.join(run_dir, ATTEMPTS)
    doc = _read_json(path)
    nxt = doc.pop("next", None)
    if not isinstance(nxt, dict) or doc["attempts"][-1].get("attempt") != attempt - 1:
        raise ValueError(f"no attempt {attempt} was decided")
    new, total = list(nxt["hosts"]), int(doc["total"])
    doc["attempts"].append({"attempt": attempt, "hosts": new, "started": time.time()})
    _write_json(path, doc)
    mark = f"{ATTEMPT_MARK}{attempt}/{total} on {','.join(new)}; {nxt.get('note', '')}"
    for n in new:
        with open(os.path.join(run_dir, "logs", f"{n}.log"), "a") as f:
            f.write(mark + "\n")
    print(mark, file=sys.stderr, flush=True)
    return new


def abort(run_dir: str, why: str) -> None:
    """The next attempt was decided but will not start (the time-limit signal came during the
    back-off, or the rules failed): the record ends with the last attempt, saying why."""
    path = os.path.join(run_dir, ATTEMPTS)
    doc = _read_json(path)
    doc.pop("next", None)
    last = doc["attempts"][-1]
    if "outcome" not in last:  # it never ended in the rules' view (they failed while judging it)
        last.update(outcome="failed", ended=time.time())
    decision = str(last.get("decision") or "")
    _close(doc, path, f"{decision}; but {why}: no next attempt" if decision else f"no restart: {why}")


def main(argv: Sequence[str]) -> int:
    try:
        if len(argv) >= 3 and argv[0] == "start":
            print(",".join(start(argv[1], argv[2], argv[3:])))
            return 0
        if len(argv) in (4, 5) and argv[0] == "decide":
            nxt = decide(argv[1], int(argv[2]), int(argv[3]), argv[4] if len(argv) == 5 else "")
            print("stop" if nxt is None else f"go {','.join(nxt[0])} {nxt[1]:.0f}")
            return 0
        if len(argv) == 3 and argv[0] == "begin":
            print(",".join(begin(argv[1], int(argv[2]))))
            return 0
        if len(argv) == 3 and argv[0] == "abort":
            abort(argv[1], argv[2])
            return 0
    except Exception as e:  # never a traceback in the batch log: the batch script stops restarting
        print(f"nodeops: restarts: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("usage: python3 -m nodeops.node.slurm_failures start RUN_DIR BATCH_NODE NODE... | decide RUN_DIR ATTEMPT "
          "EXIT [SIGNAL] | begin RUN_DIR ATTEMPT | abort RUN_DIR WHY", file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
