"""nodeops launch: the chief's supervisor (stdlib only, Python 3.8+), the one authority for a
run's life, for attached and detached runs alike.

Started by start.sh on the chief in its own session. Reads ``run.json``::

    {"run_id": ..., "agent_final": bool, "pdsh": bool, "hang_timeout": seconds | null,
     "hosts": [{"name", "address", "port", "user", "local": bool, "dir"?: path}]}

and runs one guard (``agent.py guard``) per host: a local child for the chief, ``ssh`` (BatchMode,
strict host keys) for the others. It sends every guard a heartbeat each HEARTBEAT_EVERY, so each
host's agent stops its job by itself when the supervisor or the chief dies (the dead man's
switch). The decision is made here, once:

- the first failure (a job's non-zero exit, torchrun's final failure line, pdsh's report of a
  failed node, a host whose guard is lost) stops every other host (``stop`` through each
  guard's own connection: no new ssh handshakes on the teardown path);
- ``stop_request`` in the run dir (``nodeops stop``, Ctrl-C on an attached launch) stops all;
- when every job has ended, hosts without a job (mpirun/deepspeed ranks) are swept;
- with ``hang_timeout`` (the hang watchdog): when no host showed progress (log output, or the
  script's progress file) for that long, every guard takes its ranks' stacks, the ranks whose
  stack differs from the majority are named in ``hang.json`` and the run stops as ``hung``.
  The clock starts once a rank printed on every job's host (the guards say ``ranks-up``); until
  then, and at most ``stacks.HANG_STARTUP_GRACE`` from the attempt's start, the limit is at least
  that grace.

Then it writes ``result.json`` and exits, always. Progress goes to ``supervisor.log``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

if __package__:
    from . import protocol as P
    from . import recovery as R
    from . import stacks as S
    from . import stall as ST
else:  # shipped: protocol.py, recovery.py, stacks.py and stall.py lie beside this file
    import protocol as P  # type: ignore[import-not-found,no-redef]
    import recovery as R  # type: ignore[import-not-found,no-redef]
    import stacks as S  # type: ignore[import-not-found,no-redef]
    import stall as ST  # type: ignore[import-not-found,no-redef]

STACKS_WAIT = 40.0  # how long the hang watchdog waits for every guard's stacks
GUARD_STARTERS = 16  # guards started at once (each an ssh exec'd; sshd's MaxStartups is per target)
# `arm` waits for every guard to be watching, but no longer than this after they were started: a
# guard stuck before its first line must not keep every host's agent from being armed (each stops
# its job at protocol.ATTACH_DEADLINE, 300 s). The laggard gets `arm` whenever it starts reading.
ARM_WAIT = 150.0
FLIGHT_WAIT = 2.0  # NCCL ranks asked for their flight-recorder dump write it within a second: stop after this

HERE = os.path.dirname(os.path.abspath(__file__))
# The mesh path (as mpirun and pdsh use it): strict host keys, no prompts, no user ControlMaster.
SSH_OPTS = ["BatchMode=yes", "StrictHostKeyChecking=yes", *P.SSH_TIMEOUTS, "ControlMaster=no", "ControlPath=none"]
# The mesh ssh's key exchange, per host: where the chief's ssh would begin with sntrup761x25519
# (OpenSSH 9.0 to 9.8's default), its client side took ~150 ms of CPU per connection against
# ~25 ms for curve25519-sha256 (OpenSSH 9.2, 5 connections each on a sandbox node), and the chief
# opens one link per host at every launch (~8 CPU s at 64 hosts, on the chief alone). OpenSSH
# 9.9's default, mlkem768x25519, is as cheap and is left first. (address, port, user) -> options.
KEX: dict[tuple[str, str, str], list[str]] = {}
DEFAULT_KEX: list[list[str]] = []  # [the chief's ssh's own default list], found once
FAST_KEX = "curve25519-sha256"


def log(msg: str) -> None:
    with open(os.path.join(HERE, P.SUPERVISOR_LOG), "a") as f:
        f.write(f"{time.time():.3f} {msg}\n")


def ssh_base(host: dict[str, Any], kex: bool = True) -> list[str]:
    """``ssh`` with the mesh path's options, the host's port and user (its address comes next)."""
    argv = ["ssh", "-p", str(host.get("port", 22))]
    for o in [*SSH_OPTS, *(host_kex(host) if kex else [])]:
        argv += ["-o", o]
    if host.get("user"):
        argv += ["-l", host["user"]]
    return argv


def resolved_kex(argv: list[str]) -> list[str]:
    """The key exchange list ``ssh -G`` resolves (nothing is connected); [] when it cannot."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return kex_list(p.stdout) if p.returncode == 0 else []


def host_kex(host: dict[str, Any]) -> list[str]:
    """The key exchange option of the mesh ssh to ``host`` (:func:`link_kex`), found once per
    address, port and user: ``ssh -G`` for the host, and once for ssh's own default."""
    key = (str(host.get("address", "")), str(host.get("port", 22)), str(host.get("user") or ""))
    if key not in KEX:
        if not DEFAULT_KEX:
            DEFAULT_KEX[:] = [resolved_kex(["ssh", "-F", "/dev/null", "-G", "nodeops-kex-default"])]
        chosen = link_kex(DEFAULT_KEX[0], resolved_kex([*ssh_base(host, kex=False), "-G", key[0]]))
        if chosen and chosen not in KEX.values():
            log(f"the links' key exchange: {chosen[0]}")
        KEX[key] = chosen
    return KEX[key]


def kex_list(resolved: str) -> list[str]:
    """The key exchange list in what ``ssh -G`` printed; [] without one."""
    for line in resolved.splitlines():
        key, sep, value = line.partition(" ")
        if sep and key == "kexalgorithms":
            return value.strip().split(",")
    return []


def link_kex(default: list[str], mine: list[str]) -> list[str]:
    """``["KexAlgorithms=LIST"]`` when the host's list (``mine``) is ssh's own ``default`` (no
    config file, the system's or the user's, chose one for it: a choice made there is left as
    it is), begins with sntrup761x25519 and holds curve25519-sha256: the same algorithms,
    curve25519-sha256 first. Else ``[]``: ssh's own choice."""
    if mine and mine == default and mine[0].startswith("sntrup761") and FAST_KEX in mine:
        return ["KexAlgorithms=" + ",".join([FAST_KEX, *(a for a in mine if a != FAST_KEX)])]
    return []


def on_host(host: dict[str, Any], run_id: str, words: list[str]) -> list[str]:
    """argv that runs ``words`` in the run dir of ``host``: here for the chief, else over the
    mesh ssh (strict host keys, batch mode)."""
    if host.get("local"):
        return words
    argv = ssh_base(host)
    # ssh joins its arguments into one shell line on the host: quote each word (this file is
    # shipped stdlib-only, so shlex here; nodeops.quoting.sh_word is the same function)
    return [*argv, host["address"], "cd " + shlex.quote(P.run_dir(run_id)) + " && " + shlex.join(words)]


def agent_argv(host: dict[str, Any], run_id: str, args: list[str]) -> list[str]:
    if host.get("local"):
        return [sys.executable, os.path.join(host.get("dir") or HERE, "agent.py"), *args]
    return on_host(host, run_id, ["python3", "agent.py", *args])


class Link:
    """One host's guard process and what it reported."""

    def __init__(self, host: dict[str, Any], run_id: str, flags: list[str]) -> None:
        self.name: str = host["name"]
        self.address: str = host.get("address", "")
        self.has_job = bool(host.get("job", True))
        self.here = bool(host.get("local")) and os.path.abspath(host.get("dir") or HERE) == HERE  # the chief's own
        flags = (["--job"] if self.has_job else []) + flags
        argv = agent_argv(host, run_id, ["guard", *flags])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     universal_newlines=True, start_new_session=True)  # fmt: skip
        self.lock = threading.Lock()
        self.watching = False
        self.ended: str | None = None  # "0", "1", "killed", ...
        self.left: int | None = None  # processes left after a stop (None: no confirmation)
        self.lost = ""
        self.sent_stop = False  # this supervisor told it to stop
        self.stderr: list[str] = []
        self.finished: tuple[int, int] | None = None  # (ranks that finished their script, ranks started)
        self.step: int | None = None  # the last training step its ranks printed

    def send(self, line: str) -> None:
        with self.lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        with self.lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass


def read_events(link: Link, events: queue.SimpleQueue[tuple[Link | None, str | None]]) -> None:
    assert link.proc.stdout is not None and link.proc.stderr is not None
    err = link.proc.stderr

    def drain() -> None:  # its own thread: a stderr held open elsewhere never blocks the verdict
        for line in err:
            if line.strip():
                link.stderr.append(line.strip())

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    for line in link.proc.stdout:
        events.put((link, line.strip()))
    link.proc.wait()
    drainer.join(timeout=2)
    link.lost = link.lost or (link.stderr[-1] if link.stderr else f"its guard exited {link.proc.returncode}")
    events.put((link, None))


def host_result(lk: Link) -> dict[str, Any]:
    """A host's end in the verdict; ``sent_stop``: this supervisor told it to stop (a "killed"
    host without it was stopped by someone else)."""
    return {"ended": lk.ended, "left": lk.left, "lost": lk.lost if lk.ended == "lost" else "",
            "sent_stop": lk.sent_stop, **({"step": lk.step} if lk.step is not None else {})}  # fmt: skip


def take_asks(asks: dict[str, dict[str, Any]], links: list[Link], gone: set[str]) -> None:
    """`nodeops stacks` asks left in the run dir (protocol.STACKS_ASK): each taken (unlinked: the
    controller that gave up on it unlinked it first) is passed to every guard still here."""
    for name in os.listdir(HERE):
        ask_id = name[len(P.STACKS_ASK) :] if name.startswith(P.STACKS_ASK) else ""
        if not P.STACKS_ID.match(ask_id) or ask_id in asks:
            continue
        try:
            with open(os.path.join(HERE, name)) as f:
                body = json.load(f)
            os.unlink(os.path.join(HERE, name))
        except (OSError, ValueError):
            continue
        method = body.get("method") if isinstance(body, dict) and body.get("method") in S.METHODS else "auto"
        native = "1" if isinstance(body, dict) and body.get("native") is True else "0"
        asks[ask_id] = {"asked": time.monotonic(), "lines": {}, "done": set()}
        log(f"stacks asked ({ask_id}): every guard takes its ranks' stacks")
        for lk in links:
            if lk.name not in gone:
                lk.send(f"stacks-for {ask_id} {native} {method}")


def answer_asks(asks: dict[str, dict[str, Any]], links: list[Link], gone: set[str], final: bool = False) -> None:
    """Each ask every guard answered (or that waited STACKS_ASK_WAIT; every one when the attempt
    is over) gets its answer file: the answering hosts only (the controller asks the others)."""
    for ask_id, a in list(asks.items()):
        if (final or a["done"] | gone >= {lk.name for lk in links}
                or time.monotonic() - a["asked"] > P.STACKS_ASK_WAIT):  # fmt: skip
            answer = {h: "\n".join(a["lines"].get(h, [])) for h in a["done"]}
            write_json(P.STACKS_ANSWER + ask_id + ".json", {"hosts": answer})
            log(f"stacks answered ({ask_id}): {len(answer)} of {len(links)} host(s)")
            del asks[ask_id]


def supervise(cfg: dict[str, Any], hosts: list[dict[str, Any]]) -> dict[str, Any]:
    """One attempt on ``hosts`` (their jobs already started): its result, as result.json holds it."""
    run_id = cfg["run_id"]
    hang_timeout = float(cfg.get("hang_timeout") or 0)
    flags = (["--agent-final"] if cfg.get("agent_final") else []) + (["--pdsh"] if cfg.get("pdsh") else [])
    flags += ["--watch-progress"]  # progress is the timeline's too (when training ran), not only the watchdog's
    # The heartbeat flows to each guard from the moment it is started: starting the guards one
    # by one took longer than HEARTBEAT_STALE on a CPU-starved chief (32 sandbox nodes on 2 cores),
    # and the first guard, which had heard nothing yet, stopped the run.
    links: list[Link] = []
    done = threading.Event()

    def heartbeat() -> None:
        while True:
            for lk in list(links):
                lk.send("")
            if done.wait(P.HEARTBEAT_EVERY):
                return

    threading.Thread(target=heartbeat, daemon=True).start()
    # SimpleQueue: its put is safe in a signal handler (wake, below), Queue's could deadlock
    events: queue.SimpleQueue[tuple[Link | None, str | None]] = queue.SimpleQueue()  # (None, None): a wake

    def start_guard(h: dict[str, Any]) -> Link:
        lk = Link(h, run_id, flags)
        links.append(lk)  # list.append is atomic: the heartbeat reaches it from now on
        threading.Thread(target=read_events, args=(lk, events), daemon=True).start()
        return lk

    # In parallel, a few at a time: each start waits for its ssh to be exec'd, and on a starved
    # chief one by one took ~1 s each (34 s for 32 guards before the last one was watching).
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(GUARD_STARTERS, max(1, len(hosts)))) as pool:
        in_order = list(pool.map(start_guard, hosts))
    links[:] = in_order  # the hosts' order (results, the first failure's ties)
    armed = False  # `arm` goes to every guard once each is watching (arm_when_watching)
    arm_by = time.monotonic() + ARM_WAIT
    by_address = {lk.address: lk for lk in links}
    first: dict[str, Any] | None = None
    stopping_since: float | None = None  # a failure or a stop request: the teardown's clock
    sweep_since: float | None = None  # every job ended: job-less hosts are swept
    outcome = "ok"
    gone: set[str] = set()
    closed = False
    stop_file = os.path.join(HERE, P.STOP_REQUEST)

    def stop_all(why: str, spare: str = "", sweep: bool = False) -> None:
        nonlocal stopping_since, sweep_since
        if sweep:
            sweep_since = time.monotonic()
        elif stopping_since is None:
            stopping_since = time.monotonic()
            times["stop_sent"] = time.time()
        log(f"stopping every host: {why}")
        for lk in links:
            if lk.name != spare and lk.name not in gone:
                lk.sent_stop = True
                lk.send("stop")

    first_rank = 0
    first_at = 0.0
    last_progress = time.monotonic()
    # every guard asked for its ranks' stacks: {"for": "stall" | "hang", "asked", "idle", "dumps", "done"}
    hang: dict[str, Any] = {}
    # `nodeops stacks` asks being answered: id -> {"asked", "lines": {host: [line]}, "done": {host}}
    asks: dict[str, dict[str, Any]] = {}
    asks_looked = 0.0  # when the run dir was last listed for new asks
    progressed: set[str] = set()  # hosts where a rank printed: until all have, it is start-up
    rearmed = 0  # the watchdog found no live rank anywhere and watched on (at most 3 times)
    began = time.monotonic()
    # The attempt's timeline (epoch seconds): when it began, when every host's ranks printed (training
    # runs), its last progress, when the first failure (or the hang) was seen, when the stop was
    # sent, and when every host confirmed it.
    times: dict[str, float] = {"began": time.time()}
    hang_report: dict[str, Any] | None = None
    flight: dict[str, list[int]] = {}  # host -> the NCCL ranks asked for their flight-recorder dump
    # The stall watch (stall.Watch; an earlier attempt's stalls too), and the size and progress-file
    # time of the chief's host.log right after the supervisor's own notice (that growth is not the
    # job's progress).
    watch = ST.Watch(
        read_json(P.STALLS) or [], say=log, save=lambda st: write_json(P.STALLS, st), log=log, keep_dumps=True
    )  # fmt: skip (say: notice, below, once it is defined)
    own_mark: list[tuple[int, float]] = []
    watch_stalls = cfg.get("stall_watch", True) is not False
    held: dict[str, Any] = {}  # a teardown held for PEER_GRACE: {"until", "why", "spare"}

    reports: list[tuple[str, str]] = []  # (host, kind) of every failure report, in order

    def fail(lk: Link, code: str, why: str, rank: int = P.CAUSE_EXIT, after_stop: bool = False,
             kind: str = "script") -> None:  # fmt: skip
        """A failure report. The first one starts the teardown at once. Ranks fail together (a
        crashed rank's peers abort within a second), and the first report can come from a
        victim (the chief's guard has no ssh hop): a likelier cause reported soon after becomes
        the first failure instead (``P.replaces_first``)."""
        nonlocal first, outcome, first_rank, first_at
        entry = {"host": lk.name, "code": int(code) if code.lstrip("-").isdigit() else None, "why": why, "kind": kind}
        reports.append((lk.name, kind))
        # a job host whose job is ending by itself is spared (it keeps its own exit code)
        spare = lk.name if lk.has_job and code != "lost" else ""
        if first is None and outcome == "ok":
            first, first_rank, first_at = entry, rank, time.monotonic()
            times.setdefault("failed", time.time())
            outcome = "failed"
            log(f"first failure: {lk.name}: {why}")
            if rank == P.CAUSE_PEER:  # a victim spoke first: let the cause report before stopping it
                held.update(until=time.monotonic() + P.PEER_GRACE, why=f"{lk.name}: {why}", spare=spare)
            else:
                stop_all(f"{lk.name}: {why}", spare=spare)
        elif (first is not None and lk.name != first["host"]
              and P.replaces_first(first_rank, time.monotonic() - first_at, rank, after_stop)):  # fmt: skip
            log(f"root cause: {lk.name}: {why} (before it: {first['host']}: {first['why']})")
            first, first_rank = entry, rank
            if held:
                held.clear()
                stop_all(f"{lk.name}: {why}", spare=spare)

    def progress(lk: Link) -> None:
        nonlocal last_progress
        now = time.monotonic()
        last_progress = now
        times["last_progress"] = time.time()
        watch.beat([lk.name], now)

    def handle(lk: Link, line: str) -> None:
        words = line.split()
        if not words:
            return
        if line == "watching" or (not lk.watching and line.endswith("watching")):  # glued to a login banner
            lk.watching = True
        elif line == "progress":
            if lk.here and own_mark and own_mark[-1] == job_marks():
                return  # the chief's log grew by the supervisor's own notice
            progress(lk)
        elif line == "ranks-up":
            progress(lk)
            progressed.add(lk.name)
            if "ranks_up" not in times and all(h.name in progressed for h in links if h.has_job):
                times["ranks_up"] = time.time()
                watch.rhythm.start(time.monotonic())
        elif words[0] == "stacks-for" and len(words) > 2 and words[1] in asks:
            asks[words[1]]["lines"].setdefault(lk.name, []).append(line.split(" ", 2)[2])
        elif words[0] == "stacks-for-done" and len(words) == 2 and words[1] in asks:
            asks[words[1]]["done"].add(lk.name)
        elif words[0] == "stack" and hang:
            with contextlib.suppress(ValueError):
                hang["dumps"].append(dict(json.loads(line[len("stack ") :]), host=lk.name))
        elif line == "stacks-done" and hang:
            hang["done"].add(lk.name)
        elif words[0] == "flight":  # flight ASKED_RANKS: the NCCL ranks asked for their flight-recorder dump
            asked = [int(r) for r in (words[1] if len(words) > 1 else "").split(",") if r.isdigit()]
            if asked:
                flight[lk.name] = asked
        elif words[0] == "exit":
            lk.ended = words[1]
            survived = re.search(r"\((\d+) left\)$", line)  # strays of the ended job that outlived SIGKILL
            if survived:
                lk.left = max(lk.left or 0, int(survived.group(1)))
            if first is not None and first["host"] == lk.name and first["code"] is None and lk.ended.isdigit():
                first["code"] = int(lk.ended)  # torchrun's failure line came first; this is its exit
            if lk.ended == "killed":
                if not lk.sent_stop:  # stopped by someone else (an operator, its own dead man's switch)
                    fail(lk, "lost", "stopped outside the supervisor: " + " ".join(words[2:]), P.CAUSE_LOST,
                         kind="lost")  # fmt: skip
            elif lk.ended != "0":
                died = lk.ended == "agent-died"
                fail(lk, lk.ended, "its host agent died" if died else f"exited {lk.ended}",
                     P.CAUSE_LOST if died else P.CAUSE_EXIT,
                     kind="lost" if died else R.kind_of_exit(lk.ended))  # fmt: skip
        elif words[0] == "agent-failed":  # agent-failed CODE own|peer|raised [stopped]
            worker = words[1] if len(words) >= 3 and words[1].lstrip("-").isdigit() else ""
            after_stop = words[-1] == "stopped"
            if worker.startswith("-") and (lk.sent_stop or after_stop):
                return  # its workers died of this supervisor's own stop
            peer = len(words) >= 3 and words[2] == "peer"
            rank = P.CAUSE_PEER if peer else P.CAUSE_EXIT if worker.startswith("-") or not worker else P.CAUSE_OWN
            threw = len(words) >= 3 and words[2] == "raised"
            after = ", after losing a peer" if peer else ", after an uncaught exception" if threw else ""
            detail = f" (exit code {worker}{after})" if worker else ""
            kind = R.kind_of_worker(worker, peer, threw)
            fail(lk, worker if rank == P.CAUSE_OWN else "agent-failed", "torchrun reported a failed worker" + detail,
                 rank, after_stop, kind)  # fmt: skip
        elif words[0] == "pdsh-failed" and len(words) == 3:
            fail(by_address.get(words[1], lk), words[2], f"exited {words[2]} (pdsh's report)", P.CAUSE_EXIT,
                 kind=R.kind_of_exit(words[2]))  # fmt: skip
        elif words[0] == "step" and len(words) == 2 and words[1].isdigit():
            lk.step = int(words[1])
        elif words[0] == "finished" and len(words) == 3 and words[1].isdigit() and words[2].isdigit():
            lk.finished = (int(words[1]), int(words[2]))
        elif words[0] == "stopped" and len(words) == 2:
            lk.left = int(words[1])
        elif words[0] == "lost-stopped":
            lk.left, lk.ended = int(words[1]), "lost"
            lk.lost = "its guard stopped the run there: " + " ".join(words[2:])
            if not lk.sent_stop:
                fail(lk, "lost", lk.lost, P.CAUSE_LOST, kind="lost")

    def arm_when_watching() -> None:
        """Once every guard is watching (or gone), or ARM_WAIT after they were started, ``arm`` each
        guard's dead man's switch: from then on its heartbeats keep time. Not as soon as the
        guards' processes are started: their ssh connections are still being made then. In a
        64-node sandbox the last guard was watching 94 s after the supervisor started, and one
        armed 35 s before that, while the chief made the other connections, heard no heartbeat for
        15 s and stopped a healthy run."""
        nonlocal armed
        if armed:
            return
        late = [lk.name for lk in links if not lk.watching and lk.name not in gone]
        if late and time.monotonic() < arm_by:
            return
        armed = True
        if late:
            log(f"not watching {ARM_WAIT:.0f}s after their start: {', '.join(late)}; every switch armed anyway")
        else:
            log("every guard is watching: their switches are armed")
        for lk in links:
            lk.send("arm")

    def judge_hang() -> None:
        """Every guard answered (or STACKS_WAIT passed): name the ranks whose stack differs from
        the majority, keep every dump in hang.json, and stop the run as hung."""
        nonlocal first, outcome, hang_report
        silent = [lk.name for lk in links if lk.name not in hang["done"]]
        hang_report, why, host = S.judge(hang["dumps"], hang_timeout, hang["idle"], silent, P.HANG)
        if flight:
            hang_report["flight"] = dict(flight)
        with open(os.path.join(HERE, P.HANG + ".tmp"), "w") as f:
            json.dump({**hang_report, "dumps": hang["dumps"]}, f, indent=1)
        os.replace(os.path.join(HERE, P.HANG + ".tmp"), os.path.join(HERE, P.HANG))
        host = host or links[0].name
        first, outcome = {"host": host, "code": None, "why": why, "kind": "hang"}, "hung"
        log(f"hang: {why}")
        stop_all(why)

    def job_marks() -> tuple[int, float]:
        """The chief's host.log size and progress-file time (what its guard's progress reads)."""
        size = os.path.getsize(os.path.join(HERE, P.LOG)) if os.path.exists(os.path.join(HERE, P.LOG)) else 0
        prog = os.path.join(HERE, P.PROGRESS)
        return size, os.stat(prog).st_mtime if os.path.exists(prog) else 0.0

    def notice(text: str) -> None:
        """A notice in the chief's host.log (the attached launch and ``logs`` show it; the
        supervisor's log keeps it too). Appended whole, between the job's own writes (its log is
        opened O_APPEND), on a line of its own."""
        log(text)
        path = os.path.join(HERE, P.LOG)
        if not any(lk.here and lk.has_job for lk in links) or not os.path.exists(path):
            return
        with contextlib.suppress(OSError), open(path, "ab") as f:
            f.seek(0, os.SEEK_END)
            cut = f.tell() > 0 and not ends_with_newline(path)
            f.write((("\n" if cut else "") + ST.note(text)).encode())
        own_mark.append(job_marks())

    watch.say = notice  # a stall's report goes into the chief's host.log

    def judge_stall() -> None:
        """Every guard answered a stall's stacks request: the watch reports a stall (once), or
        looks again later; NCCL ranks of a reported stall dump their flight recorder."""
        v = watch.judge(hang["dumps"], time.monotonic())
        if v is not None and v.get("reported"):
            for lk in links:  # NCCL ranks dump their flight recorder (flight/ in each host's run dir)
                lk.send("flight")
        hang.clear()

    def wake(sig: int, _frame: object) -> None:
        """SIGTERM (`nodeops stop` sends it after its request, as an operator's kill does): a
        stop request; SIGUSR1 (`nodeops stacks`): an ask was left. The loop below looks at once
        rather than at its next 0.2 s."""
        if sig == signal.SIGTERM:
            request_stop_here()
        events.put((None, None))

    signal.signal(signal.SIGTERM, wake)
    signal.signal(signal.SIGUSR1, wake)
    while len(gone) < len(links):
        quiet = time.monotonic() - last_progress
        # The watchdog counts from the moment a rank printed on every job's host; before that
        # (imports, rendezvous, a checkpoint's load) only a start-up that takes far longer is a
        # hang. The start-up ends after HANG_STARTUP_GRACE in any case (a script whose ranks print
        # on one host only, or not at all, is watched by the timeout from then on).
        started = (all(lk.name in progressed for lk in links if lk.has_job)
                   or time.monotonic() - began > S.HANG_STARTUP_GRACE)  # fmt: skip
        limit = hang_timeout if started else max(hang_timeout, S.HANG_STARTUP_GRACE)
        calm = first is None and outcome == "ok" and stopping_since is None and sweep_since is None
        if started and not watch.rhythm.learning:  # ranks printing on some hosts only: learned from the grace's end
            watch.rhythm.start(time.monotonic())
        if hang_timeout and hang.get("for") == "stall" and calm and quiet > limit:
            hang["for"] = "hang"  # the stacks being taken answer the hard timeout too
            hang["idle"] = quiet
            for lk in links:  # NCCL ranks dump their flight recorder now, before anything stops
                lk.send("flight")
            times.setdefault("failed", time.time())
            log(f"no progress for {quiet:.0f}s (hang timeout {hang_timeout:.0f}s): the stall's stacks decide")
        elif watch_stalls and not hang and calm:
            suspected = watch.due(time.monotonic(), [lk.name for lk in links if lk.has_job and lk.ended is None])
            if suspected is not None:
                idle, late, overall = suspected
                hang.update({"for": "stall"}, asked=time.monotonic(), idle=idle, dumps=[], done=set())
                log(f"stall watch: no progress from {', '.join(late)} for {idle:.0f}s (suspected after "
                    f"{watch.rhythm.limit(None if overall else late[0]):.0f}s): taking every rank's stack")  # fmt: skip
                for lk in links:
                    lk.send("stacks")
        if hang_timeout and not hang and calm and quiet > limit:
            hang.update({"for": "hang"}, asked=time.monotonic(), idle=quiet, dumps=[], done=set())
            for lk in links:  # NCCL ranks dump their flight recorder now, before anything stops
                lk.send("flight")
            times.setdefault("failed", time.time())
            late = [lk.name for lk in links if lk.has_job and lk.name not in progressed]
            waiting = f", in start-up: no progress yet from {', '.join(late)}" if late else ""
            log(f"no progress for {quiet:.0f}s (hang timeout {hang_timeout:.0f}s{waiting}): taking every rank's stack")
            for lk in links:
                lk.send("stacks")
        answered = hang and (hang["done"] | gone >= {lk.name for lk in links}
                             or time.monotonic() - hang["asked"] > STACKS_WAIT)  # fmt: skip
        if answered and hang.get("for") == "stall":
            if calm:
                judge_stall()
            else:
                hang.clear()
        elif (answered and hang_report is None and outcome == "ok" and stopping_since is None
              and (not flight or time.monotonic() - hang["asked"] >= FLIGHT_WAIT)):  # fmt: skip
            if not S.running(hang["dumps"]) and hang["done"] | gone >= {lk.name for lk in links} and rearmed < 3:
                # no rank runs Python on any host, and every host answered: the ranks have ended (or
                # are in the interpreter's teardown) and their launchers are ending (torchrun's exit
                # barrier), which is no training hang
                rearmed += 1
                log("no rank is alive on any host (their launchers are ending): not a hang; watching on")
                hang.clear()
                last_progress = time.monotonic()
                times.pop("failed", None)
            else:
                judge_hang()
        arm_when_watching()
        if time.monotonic() - asks_looked >= 0.2:  # not on every event: 64 hosts' progress lines
            asks_looked = time.monotonic()
            take_asks(asks, links, gone)
        answer_asks(asks, links, gone)
        if held and (time.monotonic() >= held["until"] or os.path.exists(stop_file)):
            why, spare = held["why"], held["spare"]
            held.clear()
            stop_all(why, spare=spare)
        if stopping_since is None and sweep_since is None and os.path.exists(stop_file):
            outcome = "stopped" if first is None else outcome
            stop_all("stop requested")
        since = stopping_since or sweep_since
        if since is not None and time.monotonic() - since > 30 and not closed:
            closed = True
            log("guards did not confirm within 30s; closing their connections")
            for lk in links:
                lk.close()
        try:
            got, line = events.get(timeout=0.2)
        except queue.Empty:
            continue
        if got is None:  # a signal's wake: the stop request, an ask
            log("woken by a signal: looking for a stop request and asks now")
            asks_looked = 0.0
            continue
        lk = got
        if line is None:
            gone.add(lk.name)
            if lk.ended is None and not (lk.sent_stop and lk.left is not None):
                lk.ended = "lost"
                fail(lk, "lost", f"lost: {lk.lost}" if lk.watching else f"cannot be watched: {lk.lost}", P.CAUSE_LOST,
                     kind="lost")  # fmt: skip
        else:
            if line != "progress" and not line.startswith("stacks-for "):  # progress: once a second per host
                log(f"{lk.name}: {line}")
            handle(lk, line)
        if sweep_since is None and all(lk.ended is not None for lk in links if lk.has_job):
            # every job ended: sweep the job-less hosts (mpirun/deepspeed ranks), spared ones too
            stop_all("every job has ended: sweep the hosts", sweep=True)
    done.set()
    answer_asks(asks, links, gone, final=True)
    for lk in links:
        lk.close()
        try:
            lk.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lk.proc.kill()
    took = None if stopping_since is None else round(time.monotonic() - stopping_since, 3)
    times["ended"] = time.time()
    if outcome == "failed" and first is not None and R.finished_then_crashed(
            first.get("kind") or "", [lk.finished if lk.has_job else None for lk in links]):  # fmt: skip
        first = dict(first, kind="teardown", why=f"{first['why']}, after every rank had finished its work "
                     "(it crashed in its teardown)")  # fmt: skip
        log(f"finished, then crashed in teardown: {first['host']}")
    return {
        "run_id": run_id,
        "outcome": outcome,
        "first_failure": first,
        "hosts": {lk.name: host_result(lk) for lk in links},
        "teardown_seconds": took,
        # stopped here, on request: each host's "left" is what its guard found after the stop
        # (`nodeops stop` trusts it; a verdict carried over between two attempts has not this)
        "stop_confirmed": outcome == "stopped",
        **({"hang": hang_report} if hang_report is not None else {}),
        **({"stalls": [{k: v for k, v in st.items() if k != "dumps"} for st in watch.stalls]} if watch.stalls else {}),
        "reports": [list(r) for r in reports],
        "times": {k: round(v, 3) for k, v in times.items()},
    }


# --------------------------------------------------------------------------- restarts
def ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_json(name: str) -> Any:
    try:
        with open(os.path.join(HERE, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(name: str, data: Any) -> None:
    tmp = os.path.join(HERE, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, os.path.join(HERE, name))


def on_each(hosts: list[dict[str, Any]], run_id: str, words: Any, timeout: float, ok: str = R.BEGUN) -> dict[str, str]:
    """Run ``words(host)`` in every host's run dir at once (the agent's preflight, or begin then
    start.sh): host -> '' when it said ``ok``, else why not."""
    out: dict[str, str] = {}

    def one(h: dict[str, Any]) -> None:
        try:
            p = subprocess.run(on_host(h, run_id, words(h)), cwd=h.get("dir") or HERE, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=timeout, start_new_session=True,
                               check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            out[h["name"]] = f"no answer within {timeout:.0f}s"
            return
        said = [ln for ln in p.stdout.splitlines() if ln.startswith("@@nodeops-")]
        if p.returncode == 0 and ok in said:
            out[h["name"]] = ""
            return
        why = next((ln.split(" ", 1)[1] for ln in said if ln.startswith("@@nodeops-not-ready ")), "")
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        out[h["name"]] = why or (err[-1] if err else f"exit {p.returncode}")

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return {h["name"]: out.get(h["name"], "no answer") for h in hosts}


def culprit_of(result: dict[str, Any]) -> tuple[str, str | None, str]:
    """An attempt's fault: its kind, the host blamed, and why. Ranks that only lost a peer are
    not the cause when a host was lost in the same attempt."""
    first = result.get("first_failure") or {}
    kind, host = str(first.get("kind") or "script"), first.get("host")
    if kind == "peer":
        lost = next((h for h, k in result.get("reports") or [] if k == "lost"), None)
        if lost is None:  # every rank only lost a peer (the network?): nobody to blame, nobody excluded
            return kind, None, str(first.get("why") or "")
        why = (result.get("hosts", {}).get(lost) or {}).get("lost") or "lost"
        return "lost", lost, str(why)
    return kind, host, str(first.get("why") or "")


def stop_requested() -> bool:
    return os.path.exists(os.path.join(HERE, P.STOP_REQUEST))


def request_stop_here(*_: object) -> None:
    """A SIGTERM's handler (`nodeops stop` sends it after its request, as an operator's kill
    does): the stop request's file. Never raises: raised in a handler it would surface anywhere."""
    with contextlib.suppress(OSError):
        open(os.path.join(HERE, P.STOP_REQUEST), "a").close()


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every attempt of the run: the first on the hosts the controller started; after a failure
    that restarts (recovery.py), the next on the hosts recovery.next_hosts chose, started from
    here. attempts.json keeps every attempt; the result is the last one's, with them all."""
    rec = cfg.get("recovery") or {}
    restarts = int(rec.get("restarts") or 0)
    total = restarts + 1
    active = [dict(h) for h in cfg["hosts"] if not h.get("spare")]
    spares = [dict(h) for h in cfg["hosts"] if h.get("spare")]
    attempts: list[dict[str, Any]] = []
    run_id = cfg["run_id"]
    start_failed: dict[str, str] = {}  # the hosts where this attempt's job could not be started

    def save(done: bool = False) -> None:
        if restarts:
            write_json(P.ATTEMPTS, {"total": total, "attempts": attempts, **({"done": True} if done else {})})

    while True:
        n = len(attempts) + 1
        a: dict[str, Any] = {"attempt": n, "hosts": [h["name"] for h in active], "started": time.time()}
        attempts.append(a)
        save()
        if n > 1 and not start_failed:  # the controller follows this attempt's hosts from now on
            with open(os.path.join(HERE, P.ATTEMPT), "w") as f:
                f.write(f"{n}\n")
        if start_failed:  # stop what did start; the host that could not start is this attempt's fault
            on_each(active, run_id, lambda _h: ["python3", "agent.py", "kill"], 30, ok=P.STOPPED)
            bad = next(iter(start_failed))
            result = {"run_id": run_id, "outcome": "failed", "hosts": {}, "teardown_seconds": None,
                      "first_failure": {"host": bad, "code": None, "kind": "lost",
                                        "why": f"its job did not start: {start_failed[bad]}"}}  # fmt: skip
        else:
            result = supervise(cfg, active)
        a.update(ended=time.time(), outcome=result["outcome"], result=result)
        log(f"attempt {n} ended: {result['outcome']}")
        if result["outcome"] not in ("failed", "hung") or not restarts:
            break
        kind, culprit, why = culprit_of(result)
        rank = a["hosts"].index(culprit) if culprit in a["hosts"] else None
        code = (result.get("first_failure") or {}).get("code") if kind != "lost" else None
        step = ((result.get("hosts") or {}).get(culprit) or {}).get("step") if culprit else None
        a.update(kind=kind, culprit=culprit, why=why, signature=R.signature(kind, rank, code, why, step))
        again, why_not = R.should_restart(kind, str(rec.get("restart_on") or "infra"), n, restarts)
        why_not = why_not if not again else R.loop(attempts[:-1], a["signature"], culprit)
        if not again or why_not:
            a["decision"] = f"no restart: {why_not}"
            break
        chosen, decision, excluded = choose(active, spares, culprit, kind, int(rec.get("min_nodes") or 1), run_id)
        a.update(decision=decision if chosen is not None else f"no restart: {decision}", excluded=excluded)
        if chosen is None:
            break
        a["preflight_done"] = round(time.time(), 3)
        log("preflight ok on " + ", ".join(h["name"] for h in chosen))
        wait = R.backoff(float(rec.get("backoff") or 0), n)
        a["backoff"] = wait
        save()
        log(f"attempt {n} {result['outcome']} ({kind} on {culprit}: {why}); {decision}; next in {wait:.0f}s")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not stop_requested():
            time.sleep(0.2)
        if stop_requested():  # nothing of the next attempt has started: the run ends here, stopped
            a["decision"] += "; stopped during the back-off"
            result = dict(result, outcome="stopped", first_failure=None, stop_confirmed=False)
            break
        if stop_requested():  # asked during the preflight: nothing was started
            a["decision"] += "; stopped before the next attempt"
            result = dict(result, outcome="stopped", first_failure=None, stop_confirmed=False)
            break
        active = [dict(h, job=True) for h in chosen]
        names = [h["name"] for h in active]
        note = f"after attempt {n}: {kind} on {culprit}" + (f"; {', '.join(excluded)} excluded" if excluded else "")

        def begin(h: dict[str, Any], k: int = n + 1, note: str = note, hosts: list[dict[str, Any]] = active,
                  names: list[str] = names) -> list[str]:  # fmt: skip
            # the host's run dir made ready (agent.py begin), then its job started as the first time
            script = 'o=$(python3 agent.py begin "$1" "$2" "$3"); echo "$o"; [ "$o" = "$4" ] && exec bash start.sh'
            return ["sh", "-c", script, "begin",
                    str(k), R.attempt_env(hosts, h["name"], k - 1), R.marker(k, total, names, h["name"], note),
                    R.BEGUN]  # fmt: skip

        started = on_each(active, run_id, begin, 60, ok=P.STARTED)
        start_failed = {h: why for h, why in started.items() if why}
        if stop_requested():  # asked while the jobs were starting: stop them before following them
            on_each(active, run_id, lambda _h: ["python3", "agent.py", "kill"], 30, ok=P.STOPPED)
            attempts.append({"attempt": n + 1, "hosts": names, "started": time.time(), "ended": time.time(),
                             "outcome": "stopped"})  # fmt: skip
            result = dict(result, outcome="stopped", first_failure=None, stop_confirmed=False)
            break
        if start_failed:
            log("attempt start failed: " + "; ".join(f"{h}: {w}" for h, w in start_failed.items()))
        else:
            log(f"attempt {n + 1} started on {', '.join(names)}")
    if spares:  # the spares left unused: their warm-up (spare-job.sh --warm) ends with the run
        on_each(spares, run_id, lambda _h: ["python3", "agent.py", "unwarm"], 15, ok=P.STOPPED)
    result = dict(result)
    if restarts:
        for a in attempts:
            r = a.pop("result", None) or {}
            a.setdefault("first_failure", r.get("first_failure"))
            a.setdefault("teardown_seconds", r.get("teardown_seconds"))
            a.setdefault("times", r.get("times") or {})
        result["attempts"] = attempts
        result["attempts_total"] = total
        save(done=True)
    return result


def choose(active: list[dict[str, Any]], spares: list[dict[str, Any]], culprit: str | None, kind: str,
           min_nodes: int, run_id: str) -> tuple[list[dict[str, Any]] | None, str, list[str]]:  # fmt: skip
    """The next attempt's hosts (recovery.next_hosts), each ready by the fast preflight; a host
    that is not ready is excluded in its turn. Spares brought in are taken from ``spares``.
    Returns the hosts (None: the run cannot go on), the decision in words, the excluded hosts."""
    excluded: list[str] = []
    said: list[str] = []
    exclude = kind in R.INFRA
    while True:
        chosen, spare, decision = R.next_hosts(active, spares, culprit, exclude, min_nodes)
        said.append(decision)
        if chosen is None:
            return None, "; ".join(said), excluded
        if spare is not None:
            spares.remove(spare)
        if culprit is not None and culprit not in [h["name"] for h in chosen] + excluded:
            excluded.append(culprit)
        ready = on_each(chosen, run_id, lambda _h: ["python3", "agent.py", "preflight"], 40)
        bad = [h for h in chosen if ready[h["name"]]]
        if not bad:
            return chosen, "; ".join(said), excluded
        log("preflight: " + "; ".join(f"{h['name']}: {ready[h['name']]}" for h in bad))
        said.append(f"{bad[0]['name']} not ready ({ready[bad[0]['name']]})")
        if bad[0]["name"] == chosen[0]["name"]:
            return None, "; ".join(said), excluded
        active, culprit, exclude = chosen, bad[0]["name"], True


def main() -> int:
    with open(os.path.join(HERE, P.RUN_CONFIG)) as f:
        cfg = json.load(f)

    # before the pid is written: nodeops signals a supervisor it finds by its pid file (supervise
    # then wakes its loop on both), and neither signal may end it
    signal.signal(signal.SIGTERM, request_stop_here)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    with open(os.path.join(HERE, P.SUPERVISOR_PID), "w") as f:
        f.write(f"{os.getpid()}\n")
    log("supervising " + ", ".join(h["name"] for h in cfg["hosts"]))
    try:
        result = run(cfg)
    except Exception as e:  # never leave the run without a verdict
        result = {"run_id": cfg["run_id"], "outcome": "error", "first_failure": None, "hosts": {},
                  "teardown_seconds": None, "error": repr(e)}  # fmt: skip
        log(f"error: {e!r}")
    tmp = os.path.join(HERE, P.RESULT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, os.path.join(HERE, P.RESULT))
    log(f"done: {result['outcome']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
