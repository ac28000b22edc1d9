"""nodeops launch: the per-host agent (stdlib only, Python 3.8+), shipped into every run dir.

``python3 agent.py host [--detach]``
    Started by start.sh (``--detach``: in a session of its own, returning once the job started).
    Runs ``job.sh`` in a new process group (its pgid in
    ``pgid``, its output in ``host.log``, ``NODEOPS_RUN_ID`` in its environment), writes
    ``exit_code`` when it ends, and is the host's dead man's switch: if no supervisor attached
    within ATTACH_DEADLINE, or the supervisor's heartbeat stops for HEARTBEAT_STALE, it stops
    the job (and says why in ``lost``). It never outlives the job.

``python3 agent.py guard [--job] [--agent-final] [--pdsh]``
    The supervisor's link to this host (over ssh, or a local child on the chief). Reads
    heartbeats and commands on stdin (a line each; ``stop`` stops the run here), touches
    ``heartbeat``, and reports on stdout, one line each: ``watching``, ``exit CODE|killed``,
    ``agent-failed CODE own|peer|raised [stopped]`` (torchrun's final failure line, with
    --agent-final: the worker's exit code, whether the lines before it say a peer went away first
    or the worker raised an exception it did not catch, and whether it was read after a stop
    came), ``pdsh-failed ADDRESS CODE`` (with --pdsh), ``stopped N`` (N processes of the run
    left after a stop). On stdin EOF or silence for HEARTBEAT_STALE (the chief or its supervisor
    died) it stops the run here; the silence counts once ``arm`` came (the supervisor sends it when
    every guard is watching; before it, ATTACH_DEADLINE), and ``heartbeat`` is touched from
    then. It exits once the job here has ended, or after a stop where
    there is no job.

With ``--watch-progress`` (the supervisor always asks: for the hang watchdog and the run's
timeline) it also says ``ranks-up`` once a rank's line is in ``host.log``, and ``progress`` (at
most once a second) when ``host.log`` grew or the script touched ``progress``
(``$NODEOPS_PROGRESS_FILE``);
on ``stacks`` from the supervisor it takes every rank's stack here and says ``stack JSON`` for
each, then ``stacks-done``; on ``stacks-for ID NATIVE METHOD`` (``nodeops stacks``, through the
supervisor) it says ``stacks-for ID LINE`` for each line ``agent.py stacks`` would print, then
``stacks-for-done ID``.

``python3 agent.py stacks [--native] [--method auto|py-spy|signal]``
    Every rank's Python stack on this host (stacks.py), one ``@@nodeops-stack JSON`` line each,
    or ``@@nodeops-stack-none WHY`` when no rank of the run runs here.
``python3 agent.py preflight`` / ``begin ATTEMPT ENV MARKER`` (automatic restarts, from the
    supervisor): whether this host is ready for another attempt; make the run dir ready for it
    (the last attempt's files to ``attempts/N/``). Each prints @@nodeops-begun or
    ``@@nodeops-not-ready WHY``.
``python3 agent.py kill``   stop the run on this host now; prints @@nodeops-stopped or @@nodeops-left N.
``python3 agent.py status`` print running / exited CODE / killed / idle / running (N process(es) ...).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

if __package__:
    from . import protocol as P
    from . import recovery as R
    from . import stacks as S
else:  # shipped: protocol.py, recovery.py and stacks.py lie beside this file
    import protocol as P  # type: ignore[import-not-found,no-redef]
    import recovery as R  # type: ignore[import-not-found,no-redef]
    import stacks as S  # type: ignore[import-not-found,no-redef]

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_ID = os.path.basename(HERE)
READY = b"started"  # host --detach: the forked agent's word that the job's pgid is written


def path(name: str) -> str:
    return os.path.join(HERE, name)


def read(name: str) -> str | None:
    try:
        with open(path(name)) as f:
            return f.read().strip()
    except OSError:
        return None


def touch(name: str) -> None:
    try:
        os.utime(path(name))
    except FileNotFoundError:
        open(path(name), "a").close()


def write_atomic(name: str, text: str) -> None:
    tmp = path(name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path(name))


def log(msg: str) -> None:
    with open(path(P.AGENT_LOG), "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} {msg}\n")


# --------------------------------------------------------------------------- waiting
# The agent and the guard live on every host for the whole run, so they wait for what they
# watch instead of looking every POLL: the job's or the agent's end (a pidfd), a signal (a
# wakeup pipe), the supervisor's lines (stdin), host.log's growth (inotify). They still look
# every IDLE (a heartbeat's staleness, the progress file), as often as the heartbeats come. Where
# the kernel gives no pidfd (Linux < 5.3, Python < 3.9) or no inotify, they look every POLL, as
# they all did before: at 64 sandbox nodes those looks cost the nodes ~2.5 ms of CPU a second
# each (docs/design.md).
POLL = 0.2
IDLE = P.HEARTBEAT_EVERY
PROGRESS_LOOK = 1.0  # the guard, once the script touched its progress file: a look at it this often
IN_MODIFY = 0x2  # <sys/inotify.h>


def agent_pidfd() -> int | None:
    """The host agent's pidfd, once ``agent.pid`` names it: None while it names none, -1 where no
    pidfd is to be had (the caller looks every POLL) or the pid is not the agent's (gone, or
    reused by another process). Checked after the pidfd is open: the pid cannot be reused then."""
    pid = read(P.AGENT_PID) or ""
    if not pid.isdigit():
        return None
    fd = pidfd(int(pid))
    if fd is None:
        return -1
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            ours = b"agent.py" in f.read() and not select.select([fd], [], [], 0)[0]
    except OSError:
        ours = False
    if not ours:
        os.close(fd)
        return -1
    return fd


def pidfd(pid: int) -> int | None:
    """A descriptor that turns readable once process ``pid`` has ended (a zombie has), or None
    where there is none to be had (Linux < 5.3, Python < 3.9) or ``pid`` is gone already."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class Growth:
    """A descriptor that turns readable when ``file`` is written: inotify, through libc (the agent
    is stdlib only). ``fd()`` is None until the file exists, and for good where inotify is not
    to be had (no such call, or the user's inotify instances are used up)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.watch: int | None = None
        self.failed = False

    def fd(self) -> int | None:
        if self.watch is not None or self.failed or not os.path.exists(self.file):
            return self.watch
        try:  # imported here: only the guard needs it, and a Python without ctypes only polls
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(self.file), IN_MODIFY) < 0:
                self.failed = ctypes.get_errno() != errno.ENOENT  # removed meanwhile: try again
                os.close(fd)
                return None
        except Exception:  # no ctypes (ImportError), no libc or no such call
            fd = -1
        if fd < 0:
            self.failed = True
            return None
        self.watch = fd
        return fd

    def drain(self) -> None:
        """Read the events so far: a write after this wakes the next wait."""
        if self.watch is not None:
            with contextlib.suppress(OSError):  # BlockingIOError once they are read
                while os.read(self.watch, 4096):
                    pass


def tagged_pids() -> list[int]:
    """Processes of this run on this host (stacks.tagged_pids)."""
    return S.tagged_pids(RUN_ID)


def leader_is_ours(pgid: int) -> bool:
    try:
        with open(f"/proc/{pgid}/environ", "rb") as f:
            return f"{P.TAG_VAR}={RUN_ID}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def kill_run(why: str) -> int:
    """SIGTERM the job's group (only while it is still this run's: not ended, leader tagged), then
    SIGKILL whatever still carries the run's tag after GRACE, or as soon as every rank alive at
    the SIGTERM has ended: what is left then is the launcher's own ending (torchrun's shutdown and
    interpreter teardown took 0.6 s of CPU per node, 2 s with 8 sandbox nodes on 2 cores) and
    what the ranks left behind. Returns how many survived."""
    ranks = {pid for _rank, pid in S.ranks(tagged_pids())}
    pg = read(P.PGID)
    if pg and pg.isdigit() and read(P.EXIT) is None and leader_is_ours(int(pg)):
        if not os.path.exists(path(P.KILLED)):
            write_atomic(P.KILLED, why)
        with contextlib.suppress(OSError):
            os.killpg(int(pg), signal.SIGTERM)
    deadline = time.monotonic() + P.GRACE
    while time.monotonic() < deadline:
        alive = tagged_pids()
        if not alive:
            break
        now = {pid for _rank, pid in S.ranks(alive)}  # a rank started meanwhile, or one under a wrapper
        if ranks and not now and not ranks & set(alive):
            break
        ranks |= now
        time.sleep(0.05)
    for pid in tagged_pids():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2
    while tagged_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = len(tagged_pids())
    log(f"kill ({why}): {left} left")
    return left


def mtime(name: str) -> float | None:
    try:
        return os.stat(path(name)).st_mtime
    except OSError:
        return None


# --------------------------------------------------------------------------- host
def detach(timeout: float = 15.0) -> int:
    """``host --detach`` (start.sh): the host agent forks into a session of its own (as
    ``setsid -f`` did) and this process returns once the job has started (its pgid written):
    0, or 1 when the agent failed first (at once, its traceback in agent.log) or took longer
    than ``timeout``. start.sh no longer polls for the pgid file: at 64 sandbox nodes its
    ``sleep`` every 0.05 s ran dozens of times per node while the nodes' CPU was scarcest."""
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        said = os.read(r, 8) if select.select([r], [], [], timeout)[0] else b""
        return 0 if said == READY else 1
    os.close(r)
    os.setsid()
    return host(ready=w)


def host(ready: int | None = None) -> int:
    """The host agent: job.sh under it until the job ends. ``ready``: a pipe told READY once the
    job's pgid is written (:func:`detach`)."""

    def tell_ready() -> None:
        if ready is not None:
            with contextlib.suppress(OSError):  # the waiting start.sh gave up: nobody listens
                os.write(ready, READY)
            os.close(ready)

    if read(P.PGID) is not None:
        tell_ready()
        return 0  # already started (start.sh is safe to run twice)
    stopping = []

    def on_signal(sig: int, _frame: object) -> None:  # an operator's kill, a shutdown: never orphan the job
        stopping.append(f"the agent got signal {sig}")

    # before the job starts (and start.sh returns): a signal from then on stops the job, never orphans it
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    with open(path(P.LOG), "ab") as out:
        job = subprocess.Popen(["bash", path(P.JOB)], cwd=HERE, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env=dict(os.environ, **{P.TAG_VAR: RUN_ID}))  # fmt: skip
    write_atomic(P.AGENT_PID, str(os.getpid()))
    write_atomic(P.PGID, str(job.pid))
    log(f"job started, pgid {job.pid}")
    tell_ready()
    woken, wake = os.pipe()  # a signal writes here, so the wait below ends at once
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    job_end = pidfd(job.pid)
    asked = POLL  # how long the last wait below was asked to be
    started = time.monotonic()
    seen_beat, beat_at = mtime(P.HEARTBEAT), time.monotonic()  # staleness on this clock, not the wall's
    slept = 0.0
    while True:
        rc = job.poll()
        if rc is not None:
            break
        beat = mtime(P.HEARTBEAT)
        now = time.monotonic()
        beat_at += P.late(asked, slept, now) if slept else 0.0  # this host was not running: no one's silence
        if beat != seen_beat:
            seen_beat, beat_at = beat, now
        lost = stopping[0] if stopping else ""
        if beat is None and now - started > P.ATTACH_DEADLINE:
            lost = f"no supervisor attached within {P.ATTACH_DEADLINE:.0f}s"
        elif beat is not None and now - beat_at > P.HEARTBEAT_STALE + 1:
            lost = f"no heartbeat from the supervisor for {now - beat_at:.0f}s"
        if lost:
            write_atomic(P.LOST, lost)
            kill_run(lost)
            rc = job.wait()
            break
        slept = time.monotonic()
        late_beat = beat is not None and slept - beat_at > 2 * P.HEARTBEAT_EVERY  # P.late() is best in short waits
        asked = POLL if job_end is None or late_beat else IDLE
        select.select([woken] if job_end is None else [woken, job_end], [], [], asked)
        with contextlib.suppress(OSError):  # BlockingIOError once it is read
            os.read(woken, 64)
    write_atomic(P.EXIT, str(rc if rc >= 0 else 128 - rc))
    log(f"job ended: {rc}")
    return 0


# --------------------------------------------------------------------------- stacks
def stacks_here(native: bool = False, method: str = "auto") -> list[dict[str, Any]]:
    """Every rank's stack on this host, taken at once (one thread per rank)."""
    return S.here(HERE, RUN_ID, native, method)


def stacks_answer(native: bool, method: str) -> list[str]:
    """What ``agent.py stacks`` prints (stacks.read_answer reads it): a MARK line per rank, or
    NONE_MARK and this host's state."""
    dumps = stacks_here(native, method if method in S.METHODS else "auto")
    return [S.MARK + json.dumps(d) for d in dumps] or [S.NONE_MARK + status()]


# --------------------------------------------------------------------------- guard
_SAY = threading.Lock()


def say(line: str) -> None:
    with _SAY:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except OSError:  # the supervisor is gone; the EOF on stdin says so too
            pass


def report_stacks() -> None:
    """The hang watchdog asked: every rank's stack here, for the supervisor (a thread of its own:
    the guard goes on reading heartbeats meanwhile)."""
    for d in stacks_here():
        if len(d.get("raw", "")) > 200_000:  # one line each: keep it within reason
            d["raw"] = d["raw"][-200_000:]
        say("stack " + json.dumps(d))
    say("stacks-done")


def answer_stacks(cmd: bytes) -> None:
    """``nodeops stacks`` asked, through the supervisor (``stacks-for ID NATIVE METHOD``): this
    host's answer, a line at a time (a thread of its own, as report_stacks)."""
    words = cmd.decode(errors="replace").split()
    if len(words) != 4 or not P.STACKS_ID.match(words[1]):
        return
    for line in stacks_answer(words[2] == "1", words[3]):
        say(f"stacks-for {words[1]} {line}")
    say(f"stacks-for-done {words[1]}")


class Progress:
    """Whether the job showed progress: host.log grew, or the script touched its progress file."""

    def __init__(self) -> None:
        self.seen = self.look()
        self.said = 0.0
        self.pending = False

    def look(self) -> tuple[int, float]:
        size = os.path.getsize(path(P.LOG)) if os.path.exists(path(P.LOG)) else 0
        return size, mtime(P.PROGRESS) or 0.0

    def moved(self) -> bool:
        """Whether to say ``progress`` now: something changed since the last look, or a change
        was held back because the last word was under a second ago (the last lines of a run
        must not be lost to that limit: the watchdog would count them as silence)."""
        now = self.look()
        if now != self.seen:
            self.seen, self.pending = now, True
        if not self.pending or time.monotonic() - self.said < 1.0:
            return False
        self.said, self.pending = time.monotonic(), False
        return True

    def next_look(self) -> float:
        """How soon to look again: a word held back is said once its second is over, and the
        progress file, once the script touched it, is looked at every PROGRESS_LOOK."""
        if self.pending:
            return max(0.0, self.said + 1.0 - time.monotonic())
        return PROGRESS_LOOK if self.seen[1] else IDLE


class LogScan:
    """Reads host.log as it grows, line by line, without a tail or grep process."""

    def __init__(self) -> None:
        self.pos = 0
        self.partial = b""

    def lines(self) -> list[str]:
        try:
            with open(path(P.LOG), "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        self.pos += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [c.decode(errors="replace") for c in complete]


def raised(pid: str | None) -> str | None:
    """What the failed worker ``pid`` (torchrun's failure line names it) left in raised/ when
    the script raised an exception it did not catch (the ranks' hook writes it, stacks.HOOK):
    the exception's first line, or None (none, or one older than this attempt's job)."""
    if not pid:
        return None
    mark = path(os.path.join(S.RAISED_DIR, f"{S.host_name()}-{pid}.txt"))
    try:
        if os.path.getmtime(mark) < os.path.getmtime(path(P.PGID)) - 1:
            return None  # a previous attempt's rank with the same pid
        with open(mark, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def finished_ranks() -> tuple[int, int]:
    """This attempt's ranks here that finished their script (the hook's finished/ marks) and
    that started (the hook's stacks/ files), by this host's name and newer than the job."""
    try:
        since = os.path.getmtime(path(P.PGID)) - 1
    except OSError:
        return 0, 0
    host = S.host_name()

    def count(d: str) -> int:
        try:
            names = [n for n in os.listdir(path(d)) if S.mark_host(n) == host]
        except OSError:
            return 0
        return sum(1 for n in names if os.path.getmtime(path(os.path.join(d, n))) >= since)

    return count(S.FINISHED_DIR), count(S.STACKS_DIR)


def agent_alive() -> bool:
    pid = read(P.AGENT_PID)
    if not pid or not pid.isdigit():
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead too


def guard(has_job: bool, agent_final: bool, pdsh: bool, watch_progress: bool = False) -> int:
    say("watching")
    progress = Progress() if watch_progress else None
    # The dead man's switch (HEARTBEAT_STALE) is armed by the supervisor's ``arm``, sent once every
    # guard is watching: until then a starved chief may send its heartbeats late (starting 64
    # guards took 45-94 s on 2 sandbox cores, and heartbeats stalled for 15 s meanwhile), so only
    # ATTACH_DEADLINE applies, as to the agent, which reads the heartbeat file this touches.
    heard = False
    last_beat = time.monotonic()
    scan = LogScan()
    recent: deque[str] = deque(maxlen=P.TAIL_LINES)  # what the ranks printed before torchrun's failure line
    agent_failed_said = False
    ranks_up = False  # a rank of this host printed (the log is read from its start): said once
    last_step: int | None = None  # the last training step a rank here printed (a failure's signature)
    stopped = False
    buf = b""
    growth = Growth(path(P.LOG)) if has_job and (agent_final or pdsh or watch_progress) else None
    agent_end: int | None = None  # the host agent's pidfd: -1 where none is to be had, or once it fired
    looked = 0.0
    read_with: int | None = None  # the log's inotify descriptor when the log was last read
    while True:
        fds, wait = [0], IDLE
        if has_job:
            if agent_end is None:
                agent_end = agent_pidfd()
            if agent_end is None or agent_end < 0:
                wait = POLL
            else:
                fds.append(agent_end)
        log_fd = growth.fd() if growth is not None else None
        if log_fd is not None:
            fds.append(log_fd)
        elif growth is not None:
            wait = POLL
        if progress is not None:
            wait = min(wait, progress.next_look())
        if heard and time.monotonic() - last_beat > 2 * P.HEARTBEAT_EVERY:
            wait = POLL  # a heartbeat is late: P.late() excuses a frozen host's time best in short waits
        asked = time.monotonic()
        ready = select.select(fds, [], [], wait)[0]
        grew = log_fd is not None and log_fd in ready
        # inotify has watched the log since it was last read, and it did not grow: nothing to read
        unchanged = log_fd is not None and log_fd == read_with and not grew
        read_with = log_fd
        if ready == [log_fd] and (rest := looked + POLL - time.monotonic()) > 0:  # at most one look a POLL for the log
            ready = select.select([f for f in fds if f != log_fd], [], [], rest)[0] or ready
        last_beat += P.late(wait, asked, time.monotonic())  # this host was not running: no one's silence
        if agent_end is not None and agent_end in ready:  # ended: from now on, look every POLL
            os.close(agent_end)
            agent_end = -1
        looked = time.monotonic()
        if grew and growth is not None:
            growth.drain()
        # The log first: a failure printed before a stop arrives is reported, not lost to the stop.
        if not unchanged and (agent_final or pdsh or (watch_progress and not ranks_up)):
            for line in scan.lines():
                if watch_progress and not ranks_up and P.RANK_OUTPUT.search(line):
                    ranks_up = True
                    say("ranks-up")  # the hang watchdog's clock starts once every host said so
                m = P.AGENT_FAILED.search(line) if agent_final and not agent_failed_said else None
                if m:
                    agent_failed_said = True
                    threw = raised(m.group(2))
                    peer = any(P.PEER_LOST.search(r) for r in recent) or bool(threw and P.PEER_LOST.search(threw))
                    how = "peer" if peer else "raised" if threw is not None else "own"
                    if last_step is not None:
                        say(f"step {last_step}")
                    # "stopped": this line was read after a stop came (its code may be the stop's doing)
                    say(f"agent-failed {m.group(1)} {how}" + (" stopped" if stopped else ""))
                recent.append(line)
                step = P.STEP.search(line) if P.RANK_OUTPUT.search(line) else None
                if step is not None:
                    last_step = int(step.group(1))
                m = P.PDSH_EXIT.match(line) if pdsh else None
                if m and m.group(2) != "0":
                    say(f"pdsh-failed {m.group(1)} {m.group(2)}")
        if progress is not None and progress.moved():
            say("progress")
        if 0 in ready:
            chunk = os.read(0, 4096)
            if not chunk:  # the supervisor (or the chief) is gone: stop here, and say so if anyone listens
                say(f"lost-stopped {kill_run('the supervisor connection closed')} the supervisor connection closed")
                return 0
            last_beat = time.monotonic()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            cmds = [c.strip() for c in lines]
            heard = heard or b"arm" in cmds
            if heard:
                touch(P.HEARTBEAT)
            if b"stacks" in cmds:
                threading.Thread(target=report_stacks, daemon=True).start()
            for c in cmds:
                if c.startswith(b"stacks-for "):
                    threading.Thread(target=answer_stacks, args=(c,), daemon=True).start()
            if b"flight" in cmds:  # NCCL ranks' flight-recorder dumps, now
                say("flight " + ",".join(str(r) for r in S.ask_flight(HERE)))
            if b"stop" in cmds and not stopped:
                stopped = True
                say(f"stopped {kill_run('stop requested by the supervisor')}")
                if not has_job:
                    return 0
        elif time.monotonic() - last_beat > (P.HEARTBEAT_STALE if heard else P.ATTACH_DEADLINE):
            since = f"for {P.HEARTBEAT_STALE:.0f}s" if heard else f"armed within {P.ATTACH_DEADLINE:.0f}s of its start"
            why = f"no heartbeat from the supervisor {since}"
            say(f"lost-stopped {kill_run(why)} {why}")
            return 0
        if not has_job or (agent_end is not None and agent_end >= 0):
            continue  # the agent's pidfd did not fire: it is alive, and writes exit_code just before it ends
        code = read(P.EXIT)
        if code is None and read(P.PGID) is not None and not agent_alive():
            time.sleep(0.3)  # the agent may have written exit_code just before it ended
            code = read(P.EXIT)
            if code is None:
                kill_run("the host agent died")
                say("exit agent-died")
                return 0
        if code is not None:
            killed = read(P.KILLED)
            left = kill_run("the job ended: its strays") if tagged_pids() else 0  # nothing outlives the job
            done, started = finished_ranks()
            say(f"finished {done} {started}")  # how many of its ranks ended their script first
            if last_step is not None:
                say(f"step {last_step}")
            say("exit " + ("killed " + (killed or "") if killed is not None else code)
                + (f" ({left} left)" if left else ""))  # fmt: skip
            return 0


# --------------------------------------------------------------------------- restarts
def end_warming() -> None:
    """A spare's warm-up (``spare-job.sh --warm``, started at launch) ends before the spare is
    checked or used: it only filled the page cache."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # again until none is left: one may have just started a child
        warm = [pid for pid in tagged_pids() if S.environ(pid).get("NODEOPS_WARM") == "1"]
        if not warm:
            return
        for pid in warm:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def preflight() -> str:
    """Before an attempt starts here: nothing of the run is still alive, and the job's workdir,
    env and command are there (``job.sh --preflight``). '' when ready, else why not."""
    end_warming()
    left = tagged_pids()
    if left:
        return f"{len(left)} process(es) of the run are still alive here"
    job = path(P.JOB) if os.path.exists(path(P.JOB)) else path(P.SPARE_JOB)
    if not os.path.exists(job):
        return "no job.sh in the run dir"
    try:
        p = subprocess.run(["bash", job, "--preflight"], cwd=HERE, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=30, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "job.sh --preflight did not answer within 30s"
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    return "" if p.returncode == 0 else (lines[-1] if lines else f"job.sh --preflight exited {p.returncode}")


def begin(attempt: int, env_text: str, marker: str) -> str:
    """Make this host's run dir ready for attempt ``attempt``: what the previous attempt left
    (its log, exit code, pgid, ...) moves to ``attempts/<attempt - 1>/``, a spare's job becomes
    job.sh, ``attempt.env`` gets this attempt's values and the log starts with ``marker``. Then
    start.sh starts the job as for the first attempt. '' when done, else why not."""
    end_warming()
    if tagged_pids():
        return "processes of the run are still alive here"
    old = os.path.join(HERE, P.ATTEMPTS_DIR, str(attempt - 1))
    for name in (P.PGID, P.EXIT, P.KILLED, P.LOST, P.AGENT_PID, P.HEARTBEAT, P.LOG, P.PROGRESS, P.HANG):
        if os.path.exists(path(name)):
            os.makedirs(old, mode=0o700, exist_ok=True)
            os.replace(path(name), os.path.join(old, name))
    if not os.path.exists(path(P.JOB)) and os.path.exists(path(P.SPARE_JOB)):
        os.replace(path(P.SPARE_JOB), path(P.JOB))
    if not os.path.exists(path(P.JOB)):
        return "no job.sh in the run dir"
    write_atomic(P.ATTEMPT_ENV, env_text.rstrip("\n"))
    with open(path(P.LOG), "a") as f:
        f.write(marker + "\n")
    log(f"attempt {attempt} ready")
    return ""


# --------------------------------------------------------------------------- kill / status
def status() -> str:
    n = len(tagged_pids())
    if not os.path.exists(path(P.JOB)):
        if os.path.exists(path(P.SPARE_JOB)):
            return "spare (not used)" + (f" ({n} process(es) of the run alive)" if n else "")
        return f"running ({n} process(es) started from the chief)" if n else "idle"
    code = read(P.EXIT)
    strays = f" ({n} process(es) of the run still alive)" if n else ""
    if os.path.exists(path(P.KILLED)) and (code is None or code != "0"):
        return "killed" + strays
    if code is not None:
        return f"exited {code}" + strays
    pg = read(P.PGID)
    if pg and pg.isdigit() and leader_is_ours(int(pg)):
        return "running"
    return "killed"


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "host":
        return detach() if "--detach" in argv else host()
    if mode == "guard":
        return guard("--job" in argv, "--agent-final" in argv, "--pdsh" in argv, "--watch-progress" in argv)
    if mode == "stacks":
        method = argv[argv.index("--method") + 1] if "--method" in argv[:-1] else "auto"
        for line in stacks_answer("--native" in argv, method):
            print(line)
        return 0
    if mode == "kill":
        left = kill_run("nodeops stop/teardown")
        print(P.STOPPED if left == 0 else f"{P.LEFT}{left}")
        print(P.STATE + status())  # `nodeops stop` shows it: no second round of ssh to ask
        return 0
    if mode == "status":
        print(status())
        return 0
    if mode == "unwarm":  # the run has ended: a spare's warm-up with it
        end_warming()
        print(P.STOPPED)
        return 0
    if mode == "preflight":
        why = preflight()
        print(R.BEGUN if not why else f"@@nodeops-not-ready {why}")
        return 0
    if mode == "begin" and len(argv) == 5 and argv[2].isdigit():
        why = begin(int(argv[2]), argv[3], argv[4])
        print(R.BEGUN if not why else f"@@nodeops-not-ready {why}")
        return 0
    sys.stderr.write("usage: agent.py host|guard|stacks|kill|status|unwarm|preflight|begin\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
