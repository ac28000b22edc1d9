"""nodeops on Slurm: the hang watchdog (stdlib only, Python 3.8+), shipped into the run dir as
``watch.py`` beside ``stacks.py``; the batch script starts it on the batch node beside the
training step when the launch asked for a hang timeout (``watch.json`` in the run dir):

    python3 watch.py RUN_DIR SRUN_PID NODE...

Progress is what the ssh watchdog counts: a node's log (``logs/NODE.log``, srun's ``--output``)
grew, or the script touched ``$NODEOPS_PROGRESS_FILE`` (``RUN_DIR/progress``). After none for
the timeout: every rank's stack, from one ``srun --overlap`` task per node running stacks.py
(each node's answer in ``hang/NODE.out``, so no line passes through srun's 1,024-byte messages);
the verdict and every dump in ``hang.json`` (stacks.judge, as the ssh supervisor judges); a
``nodeops: hang:`` line per finding in the batch log; then SIGTERM to the training step's launcher
(srun, which ends every node's task, torchrun and its ranks; or, for runner mpirun, mpirun, which
ends every rank), SIGKILL after GRACE seconds.
It ends when the training step does, or on SIGTERM (the batch script's, once srun returned).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

if __package__:
    from . import stacks as S
    from . import stall as ST
else:  # shipped: stacks.py and stall.py lie beside this file
    import stacks as S  # type: ignore[import-not-found,no-redef]
    import stall as ST  # type: ignore[import-not-found,no-redef]

CONFIG = "watch.json"  # in the run dir: {"hang_timeout": seconds}; written by launch, read here
HANG = "hang.json"  # the verdict and every rank's stack (protocol.HANG over ssh)
OUT_DIR = "hang"  # each node's stacks.py output: hang/NODE.out
STALL_DIR = "stall"  # the stall watch's: stall/NODE.out
STALLS = "stalls.json"  # every stall the stall watch reported (protocol.STALLS over ssh)
STACKS_WAIT = 40.0  # seconds the stacks step may take (the supervisor's STACKS_WAIT)
GRACE = 60.0  # seconds between SIGTERM and SIGKILL to the training step's srun
TICK = 1.0


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (ended, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def look(run_dir: str, nodes: list[str]) -> tuple[tuple[str, int], ...]:
    """What progress changes: each node log's size (the training step's nodes: a node a restart
    excluded may still write), and the progress file's mtime."""
    names = {f"{n}.log" for n in nodes}
    seen = []
    try:
        with os.scandir(os.path.join(run_dir, "logs")) as it:
            seen += [(e.name, e.stat().st_size) for e in it
                     if e.name.endswith(".log") and (not names or e.name in names)]  # fmt: skip
    except OSError:
        pass
    with contextlib.suppress(OSError):
        seen.append(("progress", int(os.stat(os.path.join(run_dir, "progress")).st_mtime_ns)))
    return tuple(sorted(seen))


def read_answers(out_dir: str) -> tuple[list[dict[str, Any]], set[str]]:
    """The dumps in each node's ``NODE.out`` (each with its ``host``), and the nodes that answered
    (a stack, or why they have none)."""
    dumps, answered = [], set()
    try:
        names = sorted(n for n in os.listdir(out_dir) if n.endswith(".out"))
    except OSError:
        return [], set()
    for name in names:
        node = name[: -len(".out")]
        try:
            with open(os.path.join(out_dir, name), errors="replace") as f:
                got, why = S.read_answer(f.read(), node)
        except OSError:
            continue
        dumps += got
        if got or why not in ("", S.UNREADABLE):
            answered.add(node)
    return dumps, answered


def take_stacks(run_dir: str, nodes: list[str], out: str = OUT_DIR) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank's stack, one srun task per node of the allocation beside the training step."""
    out_dir = os.path.join(run_dir, out)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # this watchdog's own files from an earlier attempt
        if name.endswith(".out"):
            os.unlink(os.path.join(out_dir, name))
    count = len(nodes) or int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    # the training step's own nodes (after a restart, not the excluded node or an idle spare)
    where = [f"--nodelist={','.join(nodes)}"] if nodes else []
    argv = ["srun", "--overlap", f"--nodes={count}", *where, "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            f"--output={out_dir}/%N.out", "python3", os.path.join(run_dir, "stacks.py"), run_dir]  # fmt: skip
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=STACKS_WAIT, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        say(f"the stacks step did not finish: {e}")
    dumps, answered = read_answers(out_dir)
    return dumps, [n for n in nodes if n not in answered]


def say(text: str) -> None:
    sys.stdout.write(f"nodeops: hang: {text}\n")
    sys.stdout.flush()


def fire(run_dir: str, srun_pid: int, nodes: list[str], timeout: float, idle: float, rearm: bool = True) -> bool:
    """Every rank's stack, the verdict and the stop; False (nothing stopped) when every node
    answered with no live rank and ``rearm``: the ranks ended, their launchers are ending."""
    fired = time.time()  # (the timeline: the hang was detected now)
    say(f"no progress for {idle:.0f}s (hang timeout {timeout:.0f}s): taking every rank's stack")
    dumps, silent = take_stacks(run_dir, nodes)
    if rearm and not S.running(dumps) and not silent:
        say("no rank is alive on any node (their launchers are ending): not a hang; watching on")
        return False
    report, why, host = S.judge(dumps, timeout, idle, silent, HANG)
    report["host"] = host
    tmp = os.path.join(run_dir, HANG + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**report, "why": why, "fired": fired, "stop_sent": time.time(), "dumps": dumps}, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, HANG))
    say(why)
    for line in S.report_lines(report):
        say(line.strip())
    say(f"stopping the training step (SIGTERM to its launcher, srun or mpirun, {srun_pid}; SIGKILL in {GRACE:.0f}s)")
    try:
        os.kill(srun_pid, signal.SIGTERM)
    except OSError:
        return True
    deadline = time.monotonic() + GRACE
    while alive(srun_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if alive(srun_pid):
        say(f"srun {srun_pid} still runs after {GRACE:.0f}s: SIGKILL (the job's end stops its tasks)")
        with contextlib.suppress(OSError):
            os.kill(srun_pid, signal.SIGKILL)
    return True


def stall_watch(run_dir: str) -> ST.Watch:
    """The stall watch on Slurm (stall.Watch, as the ssh supervisor keeps it): each node's log
    growth is its progress; a stall is reported in the batch log (the attached launch shows it)
    and in ``stalls.json``; nothing is stopped."""

    def save(stalls: list[dict[str, Any]]) -> None:
        tmp = os.path.join(run_dir, STALLS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(stalls, f, indent=1)
        os.replace(tmp, os.path.join(run_dir, STALLS))

    return ST.Watch([], say=note, save=save, log=lambda _text: None)


def look_for_stalls(watch: ST.Watch, run_dir: str, nodes: list[str], now: float) -> None:
    """A silence beyond the pace: every rank's stack (an srun step), then the watch's verdict."""
    got = watch.due(now, nodes or sorted(watch.rhythm.last))
    if got is not None:
        _idle, late, overall = got
        dumps, _silent = take_stacks(run_dir, [n for n in nodes if overall or n in late], STALL_DIR)
        watch.judge(dumps, time.monotonic())


def note(text: str) -> None:
    """A notice in the batch log: the attached launch and `logs` show it as ``==> ...``."""
    sys.stdout.write(ST.note(text))
    sys.stdout.flush()


def grown(seen: tuple[tuple[str, int], ...], now: tuple[tuple[str, int], ...]) -> list[str]:
    """The nodes whose log grew (the progress file counts for every node)."""
    was = dict(seen)
    changed = [name for name, size in now if was.get(name) != size]
    if "progress" in changed:
        return sorted({name[: -len(".log")] for name, _ in now if name.endswith(".log")})
    return [name[: -len(".log")] for name in changed if name.endswith(".log")]


def started(first: tuple[tuple[str, int], ...], now: tuple[tuple[str, int], ...], nodes: list[str]) -> bool:
    """Whether every node's log grew since the watch began (each node's first progress; without
    node names, any log)."""
    was = dict(first)
    grew = {name for name, size in now if name != "progress" and was.get(name) != size}
    return all(f"{n}.log" in grew for n in nodes) if nodes else bool(grew)


def watch(run_dir: str, srun_pid: int, nodes: list[str], timeout: float) -> int:
    seen = first = look(run_dir, nodes)
    last = began = time.monotonic()
    up = False  # every node showed its first progress: until then (at most the grace) the limit is the grace
    rearmed = 0  # fired and found no live rank on any node (at most 3 times): watched on
    stalls = stall_watch(run_dir)
    while alive(srun_pid):
        time.sleep(TICK)
        now = look(run_dir, nodes)
        up = up or time.monotonic() - began > S.HANG_STARTUP_GRACE
        if up:
            stalls.rhythm.start(time.monotonic())
        moved = now != seen
        if moved:
            stalls.beat(grown(seen, now), time.monotonic())
            seen, last = now, time.monotonic()
            up = up or started(first, now, nodes)
        if stalls.rhythm.learning and time.monotonic() - last <= timeout:
            look_for_stalls(stalls, run_dir, nodes, time.monotonic())  # every node silent, or some
        elif not moved and time.monotonic() - last > (timeout if up else max(timeout, S.HANG_STARTUP_GRACE)):
            if fire(run_dir, srun_pid, nodes, timeout, time.monotonic() - last, rearm=rearmed < 3):
                return 0
            rearmed, last = rearmed + 1, time.monotonic()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[2].isdigit():
        sys.stderr.write("usage: watch.py RUN_DIR SRUN_PID NODE...\n")
        return 2
    # the batch script's SIGTERM (its step ended): exit, ending a stacks srun under way too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_dir = os.path.abspath(argv[1])
    try:
        with open(os.path.join(run_dir, CONFIG)) as f:
            timeout = float(json.load(f)["hang_timeout"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.stderr.write(f"nodeops: hang watchdog off: cannot read {CONFIG}: {e}\n")
        return 0
    if timeout <= 0:
        return 0
    return watch(run_dir, int(argv[2]), argv[3:], timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
