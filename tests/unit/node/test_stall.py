"""The stall watch (stall.py): its pace and verdict rules as pure functions, then the supervisor
reporting a stall live (without stopping the run) and telling a quiet phase from a stall, run for
real on this machine as test_supervisor.py runs it (each "host" a run dir with its own agent)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nodeops.node import stacks as S
from nodeops.node import stall as ST
from tests.unit.node.test_supervisor import make_run, result_of, start, wait_clean


def frame(func: str, file: str = "train.py", line: int = 1) -> dict[str, Any]:
    return {"func": func, "file": file, "line": line}


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def dump(rank: int, host: str, *frames: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, "host": host, "frames": list(frames), "method": "signal"}


def test_the_pace_is_learned_after_start_up_and_has_a_floor() -> None:
    r = ST.Rhythm()
    r.beat("a", 0.0)  # start-up: not learned
    assert r.suspect(100.0, ["a"]) is None
    r.start(100.0)
    for t in (101.0, 102.0, 103.0):
        r.beat("a", t)
    assert r.limit() == ST.FLOOR  # 4 x 1 s is under the floor
    assert r.suspect(103.0 + ST.FLOOR - 0.1, ["a"]) is None
    idle, hosts, overall = r.suspect(103.0 + ST.FLOOR + 0.1, ["a"]) or (0.0, [], False)
    assert idle == pytest.approx(ST.FLOOR + 0.1) and hosts == ["a"] and overall
    r.beat("a", 105.5)  # a slower step (2.5 s): 4 x 2.5 s
    assert r.limit() == pytest.approx(10.0)
    r.quiet = 20.0  # a quiet phase of 20 s ended by itself: silences up to 30 s are not suspected
    assert r.limit() == pytest.approx(30.0)


def test_one_host_whose_own_pace_broke_while_the_others_go_on_is_suspected() -> None:
    r = ST.Rhythm()
    r.start(0.0)
    for t in range(1, 12):
        r.beat("a", float(t))
        if t <= 4:
            r.beat("b", float(t))
    got = r.suspect(11.0, ["a", "b"])
    assert got is not None and got[1:] == (["b"], False) and got[0] == pytest.approx(7.0)


def test_a_rank_busy_while_the_others_wait_in_a_collective_is_the_stall() -> None:
    dumps = [dump(r, f"node{r + 1}", frame("all_reduce", C10D, 2501), frame("step", "train.py", 18)) for r in range(3)]
    dumps.append(dump(3, "node4", frame("fetch_batch_from_remote", "train.py", 11), frame("step", "train.py", 16)))
    v = ST.verdict(dumps, 12.4)
    assert v["kind"] == "stall" and v["host"] == "node4"
    assert v["line"] == ("rank 3 (node4) has made no progress for 12s, in fetch_batch_from_remote (train.py:11); "
                         "ranks 0-2 wait in all_reduce (torch/distributed/distributed_c10d.py:2501)")  # fmt: skip


def test_two_ranks_one_stuck_one_waiting_names_the_stuck_one_though_there_is_no_majority() -> None:
    dumps = [dump(0, "node1", frame("barrier", C10D, 4100)), dump(1, "node2", frame("load_shard", "data.py", 7))]
    v = ST.verdict(dumps, 9)
    assert v["kind"] == "stall" and v["host"] == "node2" and v["line"].startswith("rank 1 (node2) has made no")


def test_every_rank_in_the_same_frame_is_a_quiet_phase() -> None:
    dumps = [dump(r, "node1", frame("all_reduce", C10D, 2501)) for r in range(4)]
    v = ST.verdict(dumps, 30)
    assert v["kind"] == "quiet" and "every rank waits in the same place" in v["line"]


def test_rank_0_writing_a_checkpoint_while_the_others_wait_is_a_quiet_phase() -> None:
    saving = dump(0, "node1", frame("_write", "torch/serialization.py", 600), frame("save", "torch/serialization.py"))
    dumps = [saving] + [dump(r, "node2", frame("barrier", C10D, 4100)) for r in (1, 2, 3)]
    v = ST.verdict(dumps, 25)
    assert v["kind"] == "quiet" and "rank 0 (node1)" in v["line"] and "ranks 1-3 wait in barrier" in v["line"]


def test_no_rank_alive_is_no_stall_and_a_rank_without_a_stack_is_named() -> None:
    assert ST.verdict([], 8)["kind"] == "none"
    # ranks whose main thread has no Python frame ended their script (the interpreter's teardown)
    ending = [dump(0, "node1"), dump(1, "node2")]
    assert ST.verdict(ending, 8)["kind"] == "none" and S.running(ending) == []
    dumps = [dump(0, "node1", frame("a")), dump(1, "node1", frame("b")), {"rank": 2, "host": "node2",
             "frames": [], "error": "ptrace refused", "method": "py-spy"}]  # fmt: skip
    v = ST.verdict(dumps, 8)
    assert v["kind"] == "stall" and "rank 2 (node2): no stack (ptrace refused)" in v["line"]


def test_a_notice_is_one_marked_line() -> None:
    assert ST.note("stall:  rank 1\n(node2)") == "@@nodeops-note stall: rank 1 (node2)\n"
    assert S.MARK != ST.NOTE_MARK


# --------------------------------------------------------------------------- the supervisor
# Each "rank" prints a step every 0.3 s for 3 s (the pace), sits in FUNC for PAUSE seconds, prints
# again, and (with REPEAT) does it twice; its stack is read through the ranks' hook.
STEPS_JOB = """export RANK={rank} PYTHONPATH="$PWD/hook"
exec {python} -c '
import time
def {func}(t):
    end = time.time() + t
    while time.time() < end:
        time.sleep(0.1)
for k in range({repeat}):
    for i in range(10):
        print("[rank{rank}]:step", k, i, flush=True)
        time.sleep(0.3)
    {func}({pause})
print("[rank{rank}]:done", flush=True)
'
"""


def steps_run(tmp: Path, funcs: dict[str, str], pause: float, repeat: int = 1) -> tuple[Path, list[Path]]:
    jobs = {n: STEPS_JOB.format(rank=i, func=f, python=sys.executable, pause=pause, repeat=repeat)
            for i, (n, f) in enumerate(funcs.items())}  # fmt: skip
    chief, dirs = make_run(tmp, jobs)
    for d in dirs:
        (d / "hook").mkdir()
        (d / "hook" / "sitecustomize.py").write_text(S.HOOK)
    return chief, dirs


@pytest.mark.slow
def test_a_stall_is_reported_once_live_naming_the_rank_and_the_run_goes_on(tmp_path: Path) -> None:
    chief, dirs = steps_run(tmp_path, {"a": "wait_for_peers", "b": "wait_for_peers", "c": "fetch_batch"}, pause=14)
    res = result_of(chief, start(dirs), timeout=90)
    assert res["outcome"] == "ok", res  # a stall is reported, never stopped by the stall watch
    stalls = json.loads((chief / "stalls.json").read_text())
    assert len(stalls) == 1, stalls  # reported once, though the silence went on well past a second look
    st = stalls[0]
    assert st["host"] == "c" and st["line"].startswith("rank 2 (c) has made no progress for "), st
    assert "in fetch_batch (<string>:6); ranks 0-1 are in wait_for_peers (<string>:6)" in st["line"], st
    assert st["ended"] is not None and 10 < st["lasted"] < 20, st
    assert st["at"] - st["since"] < 15, st  # the report came within 15 s of the last progress
    log = (chief / "host.log").read_text()
    notes = [ln for ln in log.splitlines() if ln.startswith(ST.NOTE_MARK)]
    assert len(notes) == 2 and notes[0].startswith(ST.NOTE_MARK + "stall: rank 2 (c) has made"), notes
    assert notes[1].startswith(ST.NOTE_MARK + "stall over: progress again after"), notes
    assert res["stalls"] == [{k: v for k, v in st.items() if k != "dumps"}]
    assert wait_clean(dirs) == []


@pytest.mark.slow
def test_a_quiet_phase_is_said_once_learned_and_not_suspected_again(tmp_path: Path) -> None:
    chief, dirs = steps_run(tmp_path, {"a": "checkpoint_wait", "b": "checkpoint_wait"}, pause=8, repeat=2)
    t0 = time.monotonic()
    res = result_of(chief, start(dirs), timeout=90)
    assert res["outcome"] == "ok", res
    assert not (chief / "stalls.json").exists()
    sup = (chief / "supervisor.log").read_text()
    assert sup.count("a quiet phase, not a stall") == 1, sup
    assert "the quiet phase ended after" in sup, sup
    assert time.monotonic() - t0 > 20
    assert wait_clean(dirs) == []


# --------------------------------------------------------------------------- finished, then crashed
# A rank that printed its result and ended its script, then died of SIGABRT in the interpreter's
# teardown (as gloo's "terminate called without an active exception" kills one): an object whose
# __del__ aborts when the module's globals are cleared, after atexit (the hook's mark) ran.
TEARDOWN_JOB = """export RANK={rank} PYTHONPATH="$PWD/hook"
exec {python} -c '
import os
class Teardown:
    def __del__(self):
        if {crash}:
            os.abort()
keep = Teardown()
print("[rank{rank}]:final result 42", flush=True)
{more}
'
"""


def teardown_run(tmp: Path, *, unfinished: bool) -> dict[str, Any]:
    more = "import time; time.sleep(30)" if unfinished else ""
    jobs = {"a": TEARDOWN_JOB.format(rank=0, python=sys.executable, crash=True, more=""),
            "b": TEARDOWN_JOB.format(rank=1, python=sys.executable, crash=False, more=more)}  # fmt: skip
    chief, dirs = make_run(tmp, jobs)
    for d in dirs:
        (d / "hook").mkdir()
        (d / "hook" / "sitecustomize.py").write_text(S.HOOK)
    res = result_of(chief, start(dirs), timeout=60)
    assert wait_clean(dirs) == []
    return res


@pytest.mark.slow
def test_a_rank_crashing_in_teardown_after_every_rank_finished_is_told_apart(tmp_path: Path) -> None:
    res = teardown_run(tmp_path, unfinished=False)
    first = res["first_failure"]
    assert res["outcome"] == "failed" and isinstance(first, dict), res
    assert first["host"] == "a" and first["kind"] == "teardown", first
    assert "after every rank had finished its work (it crashed in its teardown)" in first["why"], first


@pytest.mark.slow
def test_a_crash_while_another_rank_still_works_is_no_teardown(tmp_path: Path) -> None:
    res = teardown_run(tmp_path, unfinished=True)
    first = res["first_failure"]
    assert isinstance(first, dict) and first["host"] == "a" and first["kind"] == "signal", res


def test_a_stack_signal_at_a_ranks_end_does_not_end_it(tmp_path: Path) -> None:
    """A dump asked for while a rank ends (the stall watch meeting a teardown slowed by load, seen
    as a finished rank's exit 169 = 128 + SIGRTMIN + 7): once faulthandler has let go of the signal,
    as it does at the interpreter's end, the signal is ignored and the rank keeps its own exit
    status. A dump asked for before that still comes."""
    run = tmp_path / "20261128-073000-ab12"
    (run / S.HOOK_DIR).mkdir(parents=True)
    (run / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    code = (
        "import faulthandler, os, signal, time\n"
        "sig = signal.SIGRTMIN + 7\n"
        "os.kill(os.getpid(), sig)\n"  # registered: a dump
        "time.sleep(0.2)\n"
        "faulthandler.unregister(sig)\n"  # what the interpreter's end does
        "os.kill(os.getpid(), sig)\n"
        "time.sleep(0.2)\n"
        "print('alive')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(run / S.HOOK_DIR), "NODEOPS_RUN_ID": run.name, "RANK": "0"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30,
                       cwd=tmp_path, check=False)  # fmt: skip
    assert (p.returncode, p.stdout) == (0, "alive\n"), p.stderr
    (dump,) = (run / "stacks").glob("*.txt")
    assert 'File "<string>", line 3' in dump.read_text()  # the first signal's dump
