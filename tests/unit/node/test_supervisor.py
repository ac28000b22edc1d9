"""The supervisor state machine, run for real on this machine: three "hosts" are three run dirs,
each with its own agent (``agent.py host``) running a bash job, its guard a local child of the
supervisor. Each host dir has its own run id, so the run-tag scans of one host never reach
another's processes (on a cluster each host has its own /proc)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeops.backends.ssh import run as ssh_run
from nodeops.backends.store import remote_dir
from nodeops.node import agent as agent_mod
from nodeops.node import protocol as P
from nodeops.node import stacks as S

LAUNCH = Path(agent_mod.__file__).parent
pytestmark = pytest.mark.slow


def ship(d: Path) -> None:
    """The files a run dir gets beside its job (the chief's supervisor too)."""
    for f in ("agent.py", "protocol.py", "stacks.py", "recovery.py", "supervisor.py", "stall.py"):
        shutil.copy(LAUNCH / f, d / f)


def make_run(tmp: Path, jobs: dict[str, str | None], *, agent_final: bool = False) -> tuple[Path, list[Path]]:
    dirs = []
    for i, (name, body) in enumerate(jobs.items()):
        d = tmp / name / f"20261122-000000-{os.getpid() % 0xFFFF:04x}{i}"
        d.mkdir(parents=True)
        ship(d)
        if body is not None:
            (d / "job.sh").write_text(body)
        dirs.append(d)
    hosts = [
        {"name": n, "local": True, "dir": str(d), "job": jobs[n] is not None} for n, d in zip(jobs, dirs, strict=True)
    ]
    (dirs[0] / "run.json").write_text(json.dumps({"run_id": dirs[0].name, "agent_final": agent_final,
                                                  "pdsh": False, "hosts": hosts}))  # fmt: skip
    return dirs[0], dirs


def start(dirs: list[Path]) -> subprocess.Popen[bytes]:
    for d in dirs:
        if (d / "job.sh").exists():
            # as start.sh does: the agent forks into its own session (nobody's child here: init
            # reaps it) and this returns once the job's pgid is written
            subprocess.run([sys.executable, str(d / "agent.py"), "host", "--detach"], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            assert (d / "pgid").exists()
    # what `start.sh supervise` does on the chief (in its run dir), once every host has started
    return subprocess.Popen([sys.executable, str(dirs[0] / "supervisor.py")], cwd=dirs[0], start_new_session=True)


def ours(dirs: list[Path]) -> list[str]:
    """Every process that belongs to these runs: jobs (by tag), agents, guards, supervisors."""
    tags = {f"NODEOPS_RUN_ID={d.name}".encode() for d in dirs}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if env & tags or any(str(d) in cmd for d in dirs):
            found.append(f"{pid} {cmd}")
    return found


@pytest.fixture(autouse=True)
def nothing_outlives_the_test(tmp_path: Path) -> Iterator[None]:
    """Whatever a test started (supervisor, agents, guards, jobs) is killed when it ends, passed or
    failed: a failed assertion or a timeout must not leave a run going on this machine."""
    yield
    for _ in range(3):
        left = ours([d for d in tmp_path.glob("**/2026*") if d.is_dir()])
        for entry in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)
        if not left:
            break
        time.sleep(0.2)


def result_of(chief: Path, sup: subprocess.Popen[bytes], timeout: float = 30) -> dict[str, object]:
    sup.wait(timeout=timeout)
    return dict(json.loads((chief / "result.json").read_text()))


def wait_clean(dirs: list[Path], seconds: float = 5) -> list[str]:
    deadline = time.monotonic() + seconds
    while ours(dirs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ours(dirs)


def without_sent_stop(res: dict[str, object]) -> dict[str, dict[str, object]]:
    """The verdict's hosts without ``sent_stop``: whether the failed host's own link was still
    there to be sent the teardown's stop is a race (its guard ends with its job)."""
    return {h: {k: v for k, v in r.items() if k != "sent_stop"} for h, r in res["hosts"].items()}  # type: ignore[attr-defined]


def test_a_rank_exiting_1_stops_every_host(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "sleep 0.5; exit 1\n", "h3": "exec sleep 300\n"})
    t0 = time.monotonic()
    res = result_of(chief, start(dirs))
    assert res["outcome"] == "failed"
    assert res["first_failure"] == {"host": "h2", "code": 1, "why": "exited 1", "kind": "script"}
    assert without_sent_stop(res) == {"h1": {"ended": "killed", "left": 0, "lost": ""},
                                      "h2": {"ended": "1", "left": None, "lost": ""},
                                      "h3": {"ended": "killed", "left": 0, "lost": ""}}  # fmt: skip
    assert res["hosts"]["h1"]["sent_stop"] is res["hosts"]["h3"]["sent_stop"] is True  # type: ignore[index]
    assert res["teardown_seconds"] is not None and float(res["teardown_seconds"]) < 3  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 10
    assert wait_clean(dirs) == []


def test_all_exit_0_supervisor_exits_0_and_leaves_nothing(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "echo a\n", "h2": "sleep 0.3\n", "h3": None})  # h3: ranks from the chief
    sup = start(dirs)
    res = result_of(chief, sup)
    assert sup.returncode == 0
    assert res["outcome"] == "ok" and res["first_failure"] is None
    assert res["hosts"]["h3"] == {"ended": None, "left": 0, "lost": "", "sent_stop": True}  # type: ignore[index]
    assert wait_clean(dirs) == []
    assert (dirs[0] / "host.log").read_text() == "a\n"


def test_a_lost_host_stops_every_host(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n", "h3": "exec sleep 300\n"})
    sup = start(dirs)
    wait_watching(chief, ("h1", "h2", "h3"))
    guard = next(line for line in ours(dirs) if f"{dirs[1]}/agent.py guard" in line)
    os.kill(int(guard.split()[0]), signal.SIGKILL)  # what a dropped ssh looks like to the supervisor
    res = result_of(chief, sup)
    assert res["outcome"] == "failed"
    assert res["first_failure"]["host"] == "h2" and "lost" in res["first_failure"]["why"]  # type: ignore[index]
    assert wait_clean(dirs, P.HEARTBEAT_STALE + 6) == []  # h2's own agent stops its job: its heartbeat went stale


def wait_watching(chief: Path, hosts: tuple[str, ...]) -> None:
    """Until every guard said ``watching`` (under load they take a while to start) and heard its
    first heartbeat (which arms its dead man's switch: it touches the host's heartbeat file)."""
    log = chief / "supervisor.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            f"{h}: watching" in (log.read_text() if log.exists() else "") for h in hosts):  # fmt: skip
        time.sleep(0.1)
    while time.monotonic() < deadline and not all(
            any((chief.parent.parent / h).glob(f"*/{P.HEARTBEAT}")) for h in hosts):  # fmt: skip
        time.sleep(0.1)
    time.sleep(0.5)


def test_dead_chief_every_job_stops_by_its_own_agent(tmp_path: Path) -> None:
    """The dead man's switch on each host: the guards and the supervisor die at once (a dead
    chief); each host's agent hears no heartbeat and stops its job by itself."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    wait_watching(chief, ("h1", "h2"))
    t0 = time.monotonic()
    for line in ours(dirs):
        if "agent.py guard" in line:
            os.kill(int(line.split()[0]), signal.SIGKILL)
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait()
    assert wait_clean(dirs, P.HEARTBEAT_STALE + 6) == []
    took = time.monotonic() - t0
    print(f"every job gone {took:.1f}s after the chief died")
    assert took < P.HEARTBEAT_STALE + 6
    assert "no heartbeat" in (dirs[1] / "lost").read_text()


def test_silent_supervisor_its_guards_stop_the_jobs(tmp_path: Path) -> None:
    """A chief that vanishes from the network sends no EOF: the guards stop on silence."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    wait_watching(chief, ("h1", "h2"))
    t0 = time.monotonic()
    os.kill(sup.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + P.HEARTBEAT_STALE + 5
        while any("sleep 300" in line for line in ours(dirs)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any("sleep 300" in line for line in ours(dirs))
        print(f"every job gone {time.monotonic() - t0:.1f}s after the supervisor went silent")
    finally:
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
    assert wait_clean(dirs, 5) == []


def test_a_host_that_did_not_run_for_longer_than_the_switch_goes_on(tmp_path: Path) -> None:
    """A frozen (or CPU-starved) chief: the supervisor, its guards, the agents and the jobs all
    stop running for longer than HEARTBEAT_STALE, then go on. The silence was no one's: each
    guard and agent sees its own wait overrun (protocol.late) and does not count it, and the run
    goes on."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    wait_watching(chief, ("h1", "h2"))
    frozen = [int(line.split()[0]) for line in ours(dirs)]
    assert len(frozen) >= 5, frozen  # the supervisor, 2 guards, 2 agents (and their jobs)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(P.HEARTBEAT_STALE + 2)
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    time.sleep(3)
    assert sum("sleep 300" in line for line in ours(dirs)) == 2, ours(dirs)
    assert not any((d / "lost").exists() for d in dirs)
    (chief / "stop_request").touch()
    res = result_of(chief, sup)
    assert res["outcome"] == "stopped", res
    assert wait_clean(dirs) == []


# A rank that saves its work on SIGTERM (0.5 s) under a launcher whose own ending takes 1.5 s
# (torchrun's shutdown and interpreter teardown: CPU-bound, ~0.6 s a node, longer when starved)
SLOW_RANK = """import signal, sys, time
def saved(*_):
    time.sleep(0.5)
    open("saved", "w").write("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, saved)
open("rank-up", "w").write("1")
while True:
    time.sleep(0.1)
"""
SLOW_LAUNCHER = """trap 'sleep 1.5; : > launcher-ended; exit 143' TERM
RANK=0 {python} rank.py &
wait
"""


def test_a_stop_waits_for_the_ranks_not_for_the_launchers_own_ending(tmp_path: Path) -> None:
    """After the SIGTERM, the agent waits (up to GRACE) for the ranks that were alive: each may
    save its work. Once they have ended, what is left (the launcher ending) is SIGKILLed at once."""
    chief, dirs = make_run(tmp_path, {"h1": SLOW_LAUNCHER.format(python=sys.executable)})
    (dirs[0] / "rank.py").write_text(SLOW_RANK)
    sup = start(dirs)
    deadline = time.monotonic() + 20
    while not (dirs[0] / "rank-up").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (chief / "stop_request").touch()
    res = result_of(chief, sup)
    assert res["outcome"] == "stopped", res
    assert wait_clean(dirs) == []
    assert (dirs[0] / "saved").exists()  # the rank's SIGTERM handler ran to its end
    time.sleep(2)  # (the launcher's ending would have written its file by now)
    assert not (dirs[0] / "launcher-ended").exists()  # SIGKILLed once its rank had ended, before GRACE


def test_a_kill_where_no_job_of_ours_runs_leaves_the_first_signal_to_the_ranks_launcher(tmp_path: Path) -> None:
    """mpirun's and DeepSpeed's other hosts run ranks but no job of ours: their kill sends the
    ranks no SIGTERM of its own (the MPI shim takes a rank that died with no signal from outside
    for the one that failed first), and SIGKILLs them after GRACE."""
    d = tmp_path / "h" / f"20261122-000000-{os.getpid() % 0xFFFF:04x}9"
    d.mkdir(parents=True)
    ship(d)
    rank = subprocess.Popen(["bash", "-c", "trap ': > termed; exit 143' TERM; while :; do sleep 0.1; done"],
                            cwd=d, env={"PATH": os.environ["PATH"], "RANK": "3", P.TAG_VAR: d.name},
                            start_new_session=True)  # fmt: skip
    try:
        p = subprocess.run([sys.executable, str(d / "agent.py"), "kill"], capture_output=True, text=True, timeout=30,
                           check=True)  # fmt: skip
        assert P.STOPPED in p.stdout, p.stdout
        assert rank.wait(timeout=5) == -signal.SIGKILL
        assert not (d / "termed").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            rank.kill()
        rank.wait()


def test_stop_request_stops_all_and_says_so(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    time.sleep(1)
    (chief / "stop_request").touch()
    res = result_of(chief, sup)
    assert res["outcome"] == "stopped" and res["first_failure"] is None
    assert {h["ended"] for h in res["hosts"].values()} == {"killed"}  # type: ignore[attr-defined]
    assert wait_clean(dirs) == []


def test_nodeops_stop_signals_its_own_supervisor_and_no_other_process(tmp_path: Path) -> None:
    """`nodeops stop` touches the request and signals the supervisor its pid file names, so it
    acts now rather than at its next look, but only a supervisor.py whose cwd is that run dir:
    a pid file naming another run's supervisor, or a pid reused by another process, is a
    request and nothing more."""
    chief, dirs = make_run(tmp_path / "run", {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    deadline = time.monotonic() + 20
    while "h2: watching" not in ((chief / P.SUPERVISOR_LOG).read_text() if (chief / P.SUPERVISOR_LOG).exists() else ""):
        assert time.monotonic() < deadline, "the guards never watched"
        time.sleep(0.1)
    other, stranger = tmp_path / "other-run", tmp_path / "stranger"
    for d in (other, stranger):
        d.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"], cwd=stranger)
    try:
        for d, pid in ((other, sup.pid), (stranger, sleeper.pid)):
            (d / P.SUPERVISOR_PID).write_text(f"{pid}\n")
            subprocess.run(["bash", "-c", ssh_run.ASK_STOP], cwd=d, check=True, timeout=10)
            assert (d / P.STOP_REQUEST).exists()
        time.sleep(1)
        assert sup.poll() is None and sleeper.poll() is None
        assert not (chief / P.STOP_REQUEST).exists()
        log = (chief / P.SUPERVISOR_LOG).read_text()
        assert "stopping every host" not in log and "woken by a signal" not in log
    finally:
        sleeper.kill()
        sleeper.wait()
    subprocess.run(["bash", "-c", ssh_run.ASK_STOP], cwd=chief, check=True, timeout=10)
    res = result_of(chief, sup)
    assert res["outcome"] == "stopped" and res["first_failure"] is None, res
    log = (chief / P.SUPERVISOR_LOG).read_text()
    assert "stopping every host: stop requested" in log
    assert "woken by a signal" in log  # the request came with the signal, not only as the file
    assert wait_clean(dirs) == []


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_a_supervisor_that_does_not_catch_the_signal_is_not_sent_it(tmp_path: Path, shell: str) -> None:
    """A run started by an older nodeops has a supervisor without a USR1 handler, and USR1's
    default ends a process: `nodeops stacks` must leave it alone (its ask is still read from the
    file), on the login shell of any host (POSIX sh too)."""
    fake = (
        "import signal, time\nsignal.signal(signal.SIGTERM, lambda *_: open('termed', 'w').close())\n"
        "open('up', 'w').close()\ntime.sleep(60)\n"
    )
    (tmp_path / "supervisor.py").write_text(fake)
    old = subprocess.Popen([sys.executable, "supervisor.py"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "up").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (tmp_path / P.SUPERVISOR_PID).write_text(f"{old.pid}\n")
        for sig in ("USR1", "TERM"):  # TERM it catches: that one is sent
            subprocess.run([shell, "-c", ssh_run.signal_supervisor(sig)], cwd=tmp_path, check=True, timeout=10)
        deadline = time.monotonic() + 10
        while not (tmp_path / "termed").exists():  # the TERM it catches came
            assert time.monotonic() < deadline, "the caught TERM was not sent"
            time.sleep(0.05)
        assert old.poll() is None  # and no USR1 ended it
    finally:
        old.kill()
        old.wait()


def test_torchrun_failure_line_starts_the_teardown_before_the_exit(tmp_path: Path) -> None:
    line = "[E] failed (exitcode: 1) local_rank: 0 (pid: 7) of binary: python"
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": f"echo '{line}'; sleep 3; exit 1\n"},
                           agent_final=True)  # fmt: skip
    t0 = time.monotonic()
    res = result_of(chief, start(dirs))
    assert res["first_failure"] == {
        "host": "h2",
        "code": 1,
        "kind": "script",
        "why": "torchrun reported a failed worker (exit code 1)",
    }
    log = (chief / "supervisor.log").read_text()
    assert log.index("stopping every host") < log.index("h2: exit 1"), log
    assert time.monotonic() - t0 < 15
    assert wait_clean(dirs) == []


@pytest.mark.parametrize(("where", "kind", "after"), [
    ("raised", "script", ", after an uncaught exception"),  # the ranks' hook marked pid 7's exception
    ("peer", "peer", ", after losing a peer"),  # its exception was a lost peer's: infrastructure
    ("stale", "signal", ""),  # a mark older than this attempt's job (a previous attempt's pid 7)
    ("other", "signal", ""),  # another rank's mark, and a traceback only in the lines: not this worker's
])  # fmt: skip
def test_a_rank_aborted_after_an_uncaught_exception_is_the_scripts_own_error(tmp_path: Path, where: str, kind: str,
                                                                             after: str) -> None:  # fmt: skip
    """gloo's teardown after an exception can abort the rank ("terminate called without an active
    exception", exit code -6): that is still the script's error, which restart_on: infra must not
    restart (a CI run restarted it once, when this host's report came first). The guard trusts
    the mark the ranks' hook leaves (raised/HOST-PID.txt), not a traceback in the text."""
    host = S.host_name()
    text = {"raised": "RuntimeError: rank 1: a bug at step 2", "stale": "RuntimeError: old",
            "peer": "RuntimeError: Connection closed by peer [10.0.0.2]:5",
            "other": "RuntimeError: x"}[where]  # fmt: skip
    pid = "8" if where == "other" else "7"
    prep = f"mkdir -p raised && printf '%s' '{text}' > raised/{host}-{pid}.txt"
    prep += "; touch -d '1 hour ago' raised/*" if where == "stale" else ""
    prep += "; echo '[rank1]:[rank1]: Traceback (most recent call last):'" if where == "other" else ""
    line = "[E] failed (exitcode: -6) local_rank: 1 (pid: 7) of binary: python"
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": f"{prep}; echo '{line}'; sleep 3; exit 1\n"},
                           agent_final=True)  # fmt: skip
    res = result_of(chief, start(dirs))
    assert res["first_failure"] == {"host": "h2", "code": 1, "kind": kind,
                                    "why": f"torchrun reported a failed worker (exit code -6{after})"}  # fmt: skip
    assert wait_clean(dirs) == []


def test_the_ranks_hook_marks_only_an_exception_the_script_did_not_catch(tmp_path: Path) -> None:
    run = tmp_path / "20261125-080000-ab12"
    (run / S.HOOK_DIR).mkdir(parents=True)
    (run / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(run / S.HOOK_DIR), "NODEOPS_RUN_ID": run.name, "RANK": "1"}
    scripts = {
        "uncaught": "raise ValueError('bad input at step 2')",
        "caught": "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.print_exc()",
        "thread": "import threading\nt = threading.Thread(target=lambda: 1 / 0)\nt.start()\nt.join()",
        "interrupt": "raise KeyboardInterrupt",
        "exit": "import sys\nsys.exit(3)",
    }
    marked = {}
    for name, code in scripts.items():
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
        assert name in ("caught", "thread") or p.returncode != 0, (name, p.stderr)
        assert name in ("caught", "thread", "exit") or "Traceback (most recent call last)" in p.stderr, p.stderr
        marks = sorted((run / S.RAISED_DIR).glob(f"{os.uname()[1]}-*.txt")) if (run / S.RAISED_DIR).is_dir() else []
        marked[name] = [m.read_text() for m in marks]
        for m in marks:
            m.unlink()
    assert marked == {"uncaught": ["ValueError: bad input at step 2"], "caught": [], "thread": [], "interrupt": [],
                      "exit": []}  # fmt: skip
    other = subprocess.run([sys.executable, "-c", scripts["uncaught"]], env={**env, "NODEOPS_RUN_ID": "another-run"},
                           capture_output=True, check=False)  # fmt: skip
    assert other.returncode == 1 and not any((run / S.RAISED_DIR).iterdir())  # not a rank of this run: no mark


def test_the_ranks_hook_marks_finished_only_a_script_that_ended_without_failing(tmp_path: Path) -> None:
    """finished/ (a crash after it is a teardown crash, exit 3) is for a script that ended: its
    last line, or an exit asking for status 0. A non-zero sys.exit (argparse's usage error) or
    exit() in the main thread is the script's failure; a later exit replaces what an earlier,
    caught one asked (a caught one the script then ran past counts as failed: no mark)."""
    run = tmp_path / "20261127-080000-ab12"
    (run / S.HOOK_DIR).mkdir(parents=True)
    (run / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(run / S.HOOK_DIR), "NODEOPS_RUN_ID": run.name, "RANK": "0"}
    scripts = {
        "last line": ("print('done')", 0),
        "exit 0": ("import sys\nsys.exit(0)", 0),
        "exit None": ("import sys\nsys.exit()", 0),
        "exit False": ("import sys\nsys.exit(False)", 0),
        "exit 3": ("import sys\nsys.exit(3)", 3),
        "exit message": ("import sys\nsys.exit('cannot read the dataset')", 1),
        "argparse": ("import argparse\nargparse.ArgumentParser().parse_args(['--no-such-flag'])", 2),
        "builtin exit": ("exit(4)", 4),
        "builtin quit": ("quit(5)", 5),
        "caught, then 0": ("import sys\ntry:\n    sys.exit(2)\nexcept SystemExit:\n    pass\nsys.exit(0)", 0),
        "caught, then the last line": ("import sys\ntry:\n    sys.exit(2)\nexcept SystemExit:\n    pass", 0),
        "a thread's exit": (
            "import sys, threading\nt = threading.Thread(target=sys.exit, args=(3,))\nt.start()\nt.join()",
            0,
        ),
        "exit 0.0": ("import sys\nsys.exit(0.0)", 1),  # CPython: only None or an int 0 exits 0
        "raised": ("raise ValueError('bad')", 1),
        "pickled": (
            "import pickle, sys\nassert pickle.loads(pickle.dumps(sys.exit)) is sys.exit\n"
            "assert sys.exit.__module__ == 'sys'",
            0,
        ),
    }
    finished = {}
    for name, (code, rc) in scripts.items():
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
        assert p.returncode == rc, (name, p.returncode, p.stderr)
        marks = sorted((run / S.FINISHED_DIR).glob(f"{os.uname()[1]}-*.txt")) if (run / S.FINISHED_DIR).is_dir() else []
        finished[name] = len(marks)
        for m in marks:
            m.unlink()
    assert finished == {
        "last line": 1,
        "exit 0": 1,
        "exit None": 1,
        "exit False": 1,
        "exit 3": 0,
        "exit message": 0,
        "argparse": 0,
        "builtin exit": 0,
        "builtin quit": 0,
        "caught, then 0": 1,
        "caught, then the last line": 0,
        "a thread's exit": 1,
        "exit 0.0": 0,
        "raised": 0,
        "pickled": 1,
    }


def victim_and_cause(tmp: Path, *, victim_code: int, then: str, cause_after: float,
                     cause_then: str) -> tuple[dict[str, object], list[Path]]:  # fmt: skip
    """h1's rank reports a lost peer (torchrun: exitcode ``victim_code``); ``cause_after`` s later
    h2's rank fails by itself (exitcode 1); h3 runs on. Each job then runs its ``then`` and exits 1."""
    victim = (
        "echo '[rank0]: RuntimeError: Connection closed by peer [10.0.0.2]:17112'; "
        f"echo '[E] failed (exitcode: {victim_code}) local_rank: 0 (pid: 7) of binary: python'; {then}; exit 1\n"
    )
    cause = (
        f"sleep {cause_after}; echo 'rank 1: failing on purpose'; "
        f"echo '[E] failed (exitcode: 1) local_rank: 0 (pid: 8) of binary: python'; {cause_then}; exit 1\n"
    )
    chief, dirs = make_run(tmp, {"h1": victim, "h2": cause, "h3": "exec sleep 300\n"}, agent_final=True)
    return result_of(chief, start(dirs)), dirs


def test_a_victim_reported_first_is_not_the_root_cause(tmp_path: Path) -> None:
    """The CI race: h2's rank fails by itself and h1's rank, losing its peer, aborts within the
    same instant; either report may reach the supervisor first (on a cluster the chief's guard
    has no ssh hop). The teardown starts at once, and h2 is named either way."""
    res, dirs = victim_and_cause(tmp_path, victim_code=-6, then="sleep 3", cause_after=0.05, cause_then="sleep 3")
    assert res["first_failure"] == {
        "host": "h2",
        "code": 1,
        "kind": "script",
        "why": "torchrun reported a failed worker (exit code 1)",
    }
    assert res["hosts"]["h3"]["ended"] == "killed"  # type: ignore[index]
    assert wait_clean(dirs) == []


def test_a_victim_reporting_well_before_the_cause_holds_the_teardown_for_it(tmp_path: Path) -> None:
    """The CI race seen later: the victim's report came first by more than an instant, the stop
    reached the failing host before its torchrun reported, and that host ended "killed" with the
    victim named. A victim's report now holds the teardown (PEER_GRACE) for the cause to speak."""
    res, dirs = victim_and_cause(tmp_path, victim_code=1, then="true", cause_after=0.8, cause_then="sleep 0.2")
    assert res["first_failure"] == {
        "host": "h2",
        "code": 1,
        "kind": "script",
        "why": "torchrun reported a failed worker (exit code 1)",
    }
    hosts = res["hosts"]
    assert hosts["h2"]["ended"] == "1" and hosts["h3"]["ended"] == "killed", hosts  # type: ignore[index]
    assert wait_clean(dirs) == []


def test_which_later_report_replaces_the_first_failure() -> None:
    from nodeops.node import protocol as P

    assert P.replaces_first(P.CAUSE_PEER, 0.5, P.CAUSE_OWN, after_stop=False)  # a victim, then the culprit
    assert P.replaces_first(P.CAUSE_EXIT, 0.5, P.CAUSE_LOST, after_stop=False)
    assert not P.replaces_first(P.CAUSE_LOST, 0.5, P.CAUSE_PEER, after_stop=False)  # a lost host is not a victim
    assert not P.replaces_first(P.CAUSE_EXIT, 0.5, P.CAUSE_OWN, after_stop=True)  # exit 1 from its SIGTERM handler
    assert not P.replaces_first(P.CAUSE_PEER, P.ROOT_CAUSE_WINDOW + 1, P.CAUSE_OWN, after_stop=False)
    assert not P.replaces_first(P.CAUSE_OWN, 0.5, P.CAUSE_OWN, after_stop=False)  # the first of equals stays


def test_a_host_stopped_outside_the_supervisor_is_a_failure_not_ok(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    time.sleep(1.5)
    subprocess.run([sys.executable, str(dirs[1] / "agent.py"), "kill"], check=True, capture_output=True)
    res = result_of(chief, sup)
    assert res["outcome"] == "failed"
    assert res["first_failure"]["host"] == "h2" and "outside the supervisor" in res["first_failure"]["why"]  # type: ignore[index]
    assert wait_clean(dirs) == []


def test_a_dead_host_agent_ends_the_run_instead_of_hanging_it(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup = start(dirs)
    time.sleep(1.5)
    os.kill(int((dirs[1] / "agent.pid").read_text()), signal.SIGKILL)  # OOM killer, say
    res = result_of(chief, sup)
    assert res["first_failure"] == {"host": "h2", "code": None, "why": "its host agent died", "kind": "lost"}
    assert wait_clean(dirs) == []


def test_strays_of_a_job_that_exited_0_are_swept(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"h1": "setsid sleep 300 </dev/null >/dev/null 2>&1 &\nexit 0\n"})
    res = result_of(chief, start(dirs))
    assert res["outcome"] == "ok"
    assert wait_clean(dirs) == []


# Each rank prints one line with torchrun's `[rankN]:` prefix (the hang watchdog's clock starts
# once every host's ranks printed), then blocks in its function.
RANK_JOB = """export RANK={rank} PYTHONPATH="$PWD/hook"
exec {python} -c '
import time
def {func}():
    while True:
        time.sleep(0.2)
print("[rank{rank}]:up", flush=True)
{func}()
'
"""


def hang_run(tmp: Path, funcs: dict[str, str], timeout: float) -> tuple[Path, list[Path]]:
    jobs = {n: RANK_JOB.format(rank=i, func=f, python=sys.executable) for i, (n, f) in enumerate(funcs.items())}
    chief, dirs = make_run(tmp, jobs)
    for d in dirs:  # what start.sh does on every host
        (d / "hook").mkdir()
        (d / "hook" / "sitecustomize.py").write_text(S.HOOK)
    cfg = json.loads((chief / "run.json").read_text())
    (chief / "run.json").write_text(json.dumps({**cfg, "hang_timeout": timeout}))
    return chief, dirs


def test_the_hang_watchdog_names_the_rank_whose_stack_differs(tmp_path: Path) -> None:
    chief, dirs = hang_run(tmp_path, {"a": "wait_in_all_reduce", "b": "wait_in_all_reduce", "c": "stuck_forever"}, 3)
    t0 = time.monotonic()
    res = result_of(chief, start(dirs), timeout=60)
    assert res["outcome"] == "hung", res
    first = res["first_failure"]
    assert isinstance(first, dict) and first["host"] == "c", res
    assert "rank 2 stuck in stuck_forever (<string>:5)" in first["why"], first
    hang = res["hang"]
    assert isinstance(hang, dict)
    assert hang["suspects"] == ["rank 2 (c): stuck_forever (<string>:5) <- <module> (<string>:7)"], hang
    assert "ranks 0-1 (a, b): wait_in_all_reduce (<string>:5) <- <module> (<string>:7)" in hang["groups"], hang
    dumps = json.loads((chief / "hang.json").read_text())["dumps"]
    assert sorted((d["rank"], d["host"]) for d in dumps) == [(0, "a"), (1, "b"), (2, "c")]
    assert {d["method"] for d in dumps} <= {"py-spy", "signal"} and all(d["raw"] for d in dumps)
    assert time.monotonic() - t0 < 30
    assert wait_clean(dirs) == []


def test_the_watchdog_counts_from_the_first_progress(tmp_path: Path) -> None:
    # silent from the start (imports, rendezvous) for twice the timeout: start-up, not a hang
    chief, dirs = make_run(tmp_path, {"a": "sleep 7; echo done; exit 0\n", "b": "sleep 7; exit 0\n"})
    cfg = json.loads((chief / "run.json").read_text())
    (chief / "run.json").write_text(json.dumps({**cfg, "hang_timeout": 3}))
    res = result_of(chief, start(dirs), timeout=60)
    assert res["outcome"] == "ok", res
    assert wait_clean(dirs) == []


def test_a_run_silent_from_the_start_is_hung_once_the_start_up_grace_is_over(tmp_path: Path) -> None:
    chief, dirs = make_run(tmp_path, {"a": "exec sleep 60\n", "b": "exec sleep 60\n"})
    for d in dirs:  # a grace of 4 s instead of 300 (the shipped stacks.py is what the supervisor reads)
        shipped = (d / "stacks.py").read_text()
        assert "HANG_STARTUP_GRACE = 300.0" in shipped
        (d / "stacks.py").write_text(shipped.replace("HANG_STARTUP_GRACE = 300.0", "HANG_STARTUP_GRACE = 4.0"))
    cfg = json.loads((chief / "run.json").read_text())
    (chief / "run.json").write_text(json.dumps({**cfg, "hang_timeout": 2}))
    t0 = time.monotonic()
    res = result_of(chief, start(dirs), timeout=60)
    assert res["outcome"] == "hung", res
    assert time.monotonic() - t0 >= 4
    assert wait_clean(dirs) == []


def test_a_launcher_still_ending_after_its_ranks_is_not_a_hang(tmp_path: Path) -> None:
    # the rank printed its last line and ended; its launcher takes 5 s more (torchrun's exit barrier)
    ended = (
        f'RANK=0 PYTHONPATH="$PWD/hook" {sys.executable} -c \'print("[rank0]:done", flush=True)\'\nsleep 5\nexit 0\n'
    )
    chief, dirs = make_run(tmp_path, {"a": ended})
    (dirs[0] / "hook").mkdir()
    (dirs[0] / "hook" / "sitecustomize.py").write_text(S.HOOK)
    cfg = json.loads((chief / "run.json").read_text())
    (chief / "run.json").write_text(json.dumps({**cfg, "hang_timeout": 2}))
    res = result_of(chief, start(dirs), timeout=60)
    assert res["outcome"] == "ok", res
    assert "not a hang; watching on" in (chief / "supervisor.log").read_text()
    assert wait_clean(dirs) == []


def test_progress_without_output_keeps_the_watchdog_quiet(tmp_path: Path) -> None:
    quiet = "for i in $(seq 1 16); do touch progress; sleep 0.5; done; exit 0\n"
    chief, dirs = make_run(tmp_path, {"a": quiet, "b": "sleep 8; exit 0\n"})
    cfg = json.loads((chief / "run.json").read_text())
    (chief / "run.json").write_text(json.dumps({**cfg, "hang_timeout": 3}))
    res = result_of(chief, start(dirs), timeout=60)
    assert res["outcome"] == "ok", res
    assert wait_clean(dirs) == []


def ask_stacks(home: Path, chief: Path, native: bool = False, method: str = "auto") -> subprocess.CompletedProcess[str]:
    """What `nodeops stacks` runs on the chief over ssh (its home: ``home``, where the run dir of
    ``chief`` is linked at the path the controller names)."""
    run_id = "20261122-000000-abcd"  # the test's run dirs have ids of their own (one per host)
    link = home / remote_dir(run_id)
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(chief)
    script = ssh_run.stacks_ask_script(run_id, "0123abcd4567ef89", native, method)
    return subprocess.run(["bash", "-c", script], cwd=home, capture_output=True, text=True, timeout=60, check=False)


def test_nodeops_stacks_is_answered_by_the_guards_through_the_supervisor(tmp_path: Path) -> None:
    chief, dirs = hang_run(tmp_path / "run", {"a": "serving_a", "b": "serving_b"}, 0)
    extra = tmp_path / "run" / "c" / f"{chief.name[:-1]}9"  # a host whose job runs no rank (its own run id)
    extra.mkdir(parents=True)
    ship(extra)
    (extra / "job.sh").write_text("exec sleep 300\n")
    cfg = json.loads((chief / "run.json").read_text())
    cfg["hosts"].append({"name": "c", "local": True, "dir": str(extra), "job": True})
    (chief / "run.json").write_text(json.dumps(cfg))
    (chief / (P.STACKS_ASK + "not-an-id")).write_text("{}")  # not a valid ask: left alone
    sup = start([*dirs, extra])
    deadline = time.monotonic() + 30

    def ready() -> bool:  # every rank printed, and every guard is watching
        logs = [(d / P.LOG).read_text() if (d / P.LOG).exists() else "" for d in dirs]
        sup = (chief / P.SUPERVISOR_LOG).read_text() if (chief / P.SUPERVISOR_LOG).exists() else ""
        return all("[rank" in t for t in logs) and all(f"{h}: watching" in sup for h in "abc")

    while not ready():
        assert time.monotonic() < deadline, "the ranks never printed, or a guard never watched"
        time.sleep(0.2)
    p = ask_stacks(tmp_path / "home", chief)
    head, _, body = p.stdout.partition("\n")
    assert (p.returncode, head) == (0, "answer"), (p.stdout, p.stderr)
    assert "woken by a signal" in (chief / P.SUPERVISOR_LOG).read_text()  # the ask's SIGUSR1
    hosts = json.loads(body)["hosts"]
    assert sorted(hosts) == ["a", "b", "c"]
    got = {h: S.read_answer(text, h) for h, text in hosts.items()}
    assert [d["rank"] for d in got["a"][0]] == [0] and [d["rank"] for d in got["b"][0]] == [1]
    assert "serving_a" in got["a"][0][0]["raw"] and "serving_b" in got["b"][0][0]["raw"]
    assert got["c"] == ([], "running")  # no rank there: the host's state, as `agent.py stacks` says
    assert not list(chief.glob(P.STACKS_ANSWER + "*")), "the answer is removed once read"
    assert not (chief / (P.STACKS_ASK + "0123abcd4567ef89")).exists()
    assert (chief / (P.STACKS_ASK + "not-an-id")).exists()
    assert S.MARK not in (chief / P.SUPERVISOR_LOG).read_text()  # the dumps are not logged
    (chief / P.STOP_REQUEST).touch()
    assert result_of(chief, sup)["outcome"] == "stopped"
    assert wait_clean([*dirs, extra]) == []


def test_a_stacks_ask_no_supervisor_takes_is_taken_back(tmp_path: Path) -> None:
    run = tmp_path / "chief" / "20261122-000000-abcd"
    run.mkdir(parents=True)
    p = ask_stacks(tmp_path / "home", run)  # no supervisor.pid: not asked at all
    assert (p.returncode, p.stdout) == (0, "none\n")
    assert not list(run.iterdir())
    # a supervisor that does not take it (between two attempts of a restarting run)
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(run / "supervisor.py")])
    try:
        (run / P.SUPERVISOR_PID).write_text(str(busy.pid))
        t0 = time.monotonic()
        p = ask_stacks(tmp_path / "home", run)
        assert (p.returncode, p.stdout) == (0, "none\n")
        assert ssh_run.STACKS_TAKEN_WAIT <= time.monotonic() - t0 < ssh_run.STACKS_TAKEN_WAIT + 5
        assert sorted(f.name for f in run.iterdir()) == [P.SUPERVISOR_PID], "the ask was taken back"
    finally:
        busy.kill()
        busy.wait()


def test_a_guards_switch_counts_silence_only_once_the_supervisor_armed_it(tmp_path: Path) -> None:
    """A starved chief may send its first heartbeats late while it starts its guards: a guard stops
    on silence (HEARTBEAT_STALE) only after ``arm``; before it, only after ATTACH_DEADLINE. Both
    shortened here (2 s and 6 s) in the shipped protocol.py the guard reads."""

    def guard_in(name: str) -> tuple[Path, subprocess.Popen[bytes]]:
        d = tmp_path / name / f"20261124-{os.getpid() % 1_000_000:06d}-{len(name):04x}"
        d.mkdir(parents=True)
        ship(d)
        shipped = (d / "protocol.py").read_text()
        assert "HEARTBEAT_STALE = 15.0" in shipped and "ATTACH_DEADLINE = 300.0" in shipped
        (d / "protocol.py").write_text(shipped.replace("HEARTBEAT_STALE = 15.0", "HEARTBEAT_STALE = 2.0")
                                       .replace("ATTACH_DEADLINE = 300.0", "ATTACH_DEADLINE = 6.0"))  # fmt: skip
        g = subprocess.Popen([sys.executable, str(d / "agent.py"), "guard"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
        return d, g

    def send(g: subprocess.Popen[bytes], line: str) -> None:
        assert g.stdin is not None
        g.stdin.write(line.encode() + b"\n")
        g.stdin.flush()

    d, armed = guard_in("armed")
    _, never = guard_in("never")
    try:
        for g in (armed, never):
            send(g, "")  # a heartbeat, then 3 s of silence: more than the switch, not yet armed
        time.sleep(3.5)
        assert armed.poll() is None and never.poll() is None
        assert not (d / P.HEARTBEAT).exists()  # the agent's switch is not armed either
        send(armed, "arm")
        t0 = time.monotonic()
        armed.wait(timeout=10)  # not communicate(): its stdin closed would be the supervisor gone
        assert 1.5 < time.monotonic() - t0 < 5
        assert armed.stdout is not None and never.stdout is not None
        assert b"lost-stopped 0 no heartbeat from the supervisor for 2s" in armed.stdout.read()
        assert (d / P.HEARTBEAT).exists()
        never.wait(timeout=10)
        assert b"no heartbeat from the supervisor armed within 6s of its start" in never.stdout.read()
    finally:
        for g in (armed, never):
            if g.poll() is None:
                g.kill()
                g.wait()


def test_the_supervisor_arms_the_switches_only_once_every_guard_is_watching(tmp_path: Path) -> None:
    """``arm`` waits for every guard's first line, not only for its process: h2's guard starts 3 s
    late here (as a guard whose ssh connection a starved chief makes last), and h1's switch, with
    the heartbeat file it touches, stays unarmed until then."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    slow = dirs[1] / "agent.py"
    code = slow.read_text()
    assert code.count('    say("watching")\n') == 1
    slow.write_text(code.replace('    say("watching")\n', '    time.sleep(3)\n    say("watching")\n'))
    sup = start(dirs)
    try:
        beat = dirs[0] / P.HEARTBEAT
        deadline = time.monotonic() + 20
        while not beat.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.exists(), "h1's switch was never armed"
        log = (chief / P.SUPERVISOR_LOG).read_text()
        assert "h2: watching" in log, f"h1 was armed before h2's guard was watching:\n{log}"
        assert log.index("h2: watching") < log.index("every guard is watching: their switches are armed"), log
    finally:
        (chief / P.STOP_REQUEST).touch()
        res = result_of(chief, sup)
    assert res["outcome"] == "stopped"
    assert wait_clean(dirs) == []


def test_a_guard_that_never_says_watching_does_not_keep_the_others_unarmed(tmp_path: Path) -> None:
    """A guard stuck before its first line (a hung home directory, a slow host): the others are
    armed ARM_WAIT after the guards were started (3 s here, in the chief's shipped supervisor.py),
    and the supervisor's log names the late one."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "exec sleep 300\n"})
    sup_py = chief / "supervisor.py"
    assert sup_py.read_text().count("ARM_WAIT = 150.0\n") == 1
    sup_py.write_text(sup_py.read_text().replace("ARM_WAIT = 150.0\n", "ARM_WAIT = 3.0\n"))
    slow = dirs[1] / "agent.py"
    slow.write_text(slow.read_text().replace('    say("watching")\n', '    time.sleep(10)\n    say("watching")\n'))
    t0 = time.monotonic()
    sup = start(dirs)
    try:
        beat = dirs[0] / P.HEARTBEAT
        while not beat.exists() and time.monotonic() - t0 < 9:
            time.sleep(0.05)
        assert beat.exists(), "h1 was not armed while h2's guard said nothing"
        assert 2.5 < time.monotonic() - t0 < 9
        log = (chief / P.SUPERVISOR_LOG).read_text()
        assert "not watching 3s after their start: h2; every switch armed anyway" in log, log
        assert "h2: watching" not in log
    finally:
        (chief / P.STOP_REQUEST).touch()
        res = result_of(chief, sup, timeout=45)
    assert res["outcome"] == "stopped"
    assert wait_clean(dirs, 15) == []


def wakes(pid: int) -> int:
    """How many times process ``pid`` has gone to sleep and been woken (its voluntary context
    switches): a loop that looks every 0.2 s adds five a second, one that waits adds none."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for {pid}")


@pytest.fixture
def no_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python the test starts (agents, supervisor, guards) as on a node without pidfds (Linux
    < 5.3, Python < 3.9) or ctypes: a sitecustomize first on PYTHONPATH takes both away."""
    site = tmp_path / "no-events"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\ndel os.pidfd_open\nsys.modules['ctypes'] = None\n")
    monkeypatch.setenv("PYTHONPATH", str(site))


@pytest.mark.parametrize("events", ["events", "no events"])
def test_the_agent_and_the_guard_sleep_until_something_happens(
    tmp_path: Path, request: pytest.FixtureRequest, events: str
) -> None:
    """The agent and the guard run on every host for the whole run: they wait on the job's and the
    agent's pidfds, stdin and host.log's inotify, and look only every IDLE (3 s, as often as the
    heartbeats come) besides. Over 6 s of a quiet job the agent wakes about twice (6 times when
    it looked every second, 30 every 0.2 s), the guard about twice (the supervisor's heartbeats,
    which came every second before). Without pidfds and ctypes both look every 0.2 s, as before.
    Either way the job's end ends the run."""
    if events == "no events":
        request.getfixturevalue("no_events")
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n"})
    sup = start(dirs)
    try:
        deadline = time.monotonic() + 20
        sup_log = chief / P.SUPERVISOR_LOG
        while not sup_log.exists() or "every guard is watching" not in sup_log.read_text():
            assert time.monotonic() < deadline, "the guard never said watching"
            time.sleep(0.1)
        agent = int((chief / P.AGENT_PID).read_text())
        (guard,) = [int(e.split()[0]) for e in ours(dirs) if "agent.py guard" in e]
        before = wakes(agent), wakes(guard)
        time.sleep(6)
        agent_wakes, guard_wakes = wakes(agent) - before[0], wakes(guard) - before[1]
        if events == "events":
            assert agent_wakes <= 4, f"the agent woke {agent_wakes} times in 6 s"
            # a heartbeat and the IDLE timeout may both wake it in one period: up to 4, and 6 before
            assert guard_wakes <= 5, f"the guard woke {guard_wakes} times in 6 s"
        else:  # the fallback is what ran
            assert agent_wakes >= 20 and guard_wakes >= 20, (agent_wakes, guard_wakes)
        os.killpg(int((chief / P.PGID).read_text()), signal.SIGTERM)
        res = result_of(chief, sup)
    finally:
        if sup.poll() is None:
            (chief / P.STOP_REQUEST).touch()
            sup.wait(timeout=30)
    assert res["outcome"] == "failed"
    assert wait_clean(dirs) == []


def read_word(g: subprocess.Popen[bytes], word: bytes, timeout: float) -> float:
    """Seconds until the guard ``g`` says ``word`` (a line of its own), within ``timeout``."""
    assert g.stdout is not None
    t0 = time.monotonic()
    buf = b""
    while time.monotonic() - t0 < timeout:
        if select.select([g.stdout], [], [], 0.05)[0]:
            buf += os.read(g.stdout.fileno(), 4096)
            if word in buf.split(b"\n"):
                return time.monotonic() - t0
    raise AssertionError(f"no {word!r} within {timeout}s: {buf!r}")


def test_a_guard_looks_at_the_progress_file_every_second_once_the_script_touches_it(tmp_path: Path) -> None:
    """A quiet guard looks only as often as the heartbeats come (3 s); once the script has touched
    its progress file, it looks every second. Each touch just after a ``progress`` word is the next
    word about a second later (about 3 s if it waited for the next heartbeat)."""
    d = tmp_path / "h1" / "20261128-000000-0001"
    d.mkdir(parents=True)
    ship(d)
    g = subprocess.Popen([sys.executable, str(d / "agent.py"), "guard", "--watch-progress"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        read_word(g, b"watching", 10)
        time.sleep(0.5)  # the guard looks at the file a first time after it says watching: a touch before is no news
        (d / P.PROGRESS).touch()
        assert read_word(g, b"progress", 5) < 4  # the first touch: the next look (every 3 s) sees it
        took = []
        for _ in range(3):
            time.sleep(0.1)
            os.utime(d / P.PROGRESS)
            took.append(read_word(g, b"progress", 5))
        assert max(took) < 1.8, took
    finally:
        g.kill()
        g.wait()


def test_a_rank_exiting_1_stops_every_host_without_pidfds_or_inotify(tmp_path: Path, no_events: None) -> None:
    """The fallback (every look every 0.2 s) decides as the waits do."""
    chief, dirs = make_run(tmp_path, {"h1": "exec sleep 300\n", "h2": "sleep 0.5; exit 1\n"})
    res = result_of(chief, start(dirs))
    assert res["outcome"] == "failed"
    assert res["first_failure"] == {"host": "h2", "code": 1, "why": "exited 1", "kind": "script"}
    assert without_sent_stop(res) == {"h1": {"ended": "killed", "left": 0, "lost": ""},
                                      "h2": {"ended": "1", "left": None, "lost": ""}}  # fmt: skip
    assert res["hosts"]["h1"]["sent_stop"] is True  # type: ignore[index]
    assert wait_clean(dirs) == []


def test_a_guard_reports_the_exit_though_agent_pid_names_another_process(tmp_path: Path) -> None:
    """agent.pid names a live process that is not the agent (its pid reused after the agent ended,
    before a starved chief's guard started): the guard must not wait on it, and reports the exit
    the agent wrote at once."""
    d = tmp_path / "h1" / "20261127-000000-0001"
    d.mkdir(parents=True)
    ship(d)
    other = subprocess.Popen(["sleep", "30"])
    try:
        (d / P.AGENT_PID).write_text(str(other.pid))
        (d / P.PGID).write_text(str(other.pid))
        (d / P.EXIT).write_text("0")
        guard = subprocess.Popen([sys.executable, str(d / "agent.py"), "guard", "--job", "--watch-progress"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
        try:
            guard.wait(timeout=10)
        finally:
            if guard.poll() is None:
                guard.kill()
                guard.wait()
        assert guard.stdout is not None
        assert b"exit 0" in guard.stdout.read()
    finally:
        other.kill()
        other.wait()


def test_growth_wakes_a_wait_when_its_file_is_written(tmp_path: Path) -> None:
    """The guard's wait on host.log: no descriptor until the file exists (the guard looks every
    0.2 s meanwhile), then one that turns readable on a write and quiet again once drained."""
    log = tmp_path / "host.log"
    growth = agent_mod.Growth(str(log))
    assert growth.fd() is None
    log.write_text("")
    fd = growth.fd()
    assert fd is not None and growth.fd() == fd
    try:
        assert select_ready(fd) is False
        with log.open("a") as f:
            f.write("a line\n")
        assert select_ready(fd) is True
        growth.drain()
        assert select_ready(fd) is False
    finally:
        os.close(fd)


def select_ready(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0.2)[0])


def test_a_pidfd_turns_readable_when_its_process_ends(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"])
    fd = agent_mod.pidfd(child.pid)
    assert fd is not None  # this machine's kernel has pidfds (Linux >= 5.3); a node without them polls
    try:
        assert select_ready(fd) is False
        child.terminate()
        assert select.select([fd], [], [], 5)[0] == [fd]
    finally:
        child.wait()
        os.close(fd)
