"""The Slurm batch driver's heartbeats (nodeops.node.slurm_batch): each node's task says it is
alive, how its log grows and whether its ranks printed or failed; the batch node tells a lost
node from a live one and records the step's timeline. The rules are fed datagrams and a clock
here; a real UDP socket on this machine carries them in the last tests. The live path (a node's
container killed on a real Slurm) is tests/integration/test_slurm.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from nodeops.node import protocol as P
from nodeops.node import slurm_batch as B
from nodeops.node import slurm_failures as SF


def beat(node: str, *, token: str = "t0k", grown: int = 0, up: bool = False, failed: bool = False,
         progress: float = 0.0, end: int | None = None) -> bytes:  # fmt: skip
    return json.dumps({"token": token, "node": node, "seq": 1, "grown": grown, "up": up, "failed": failed,
                       "progress": progress, "end": end}).encode()  # fmt: skip


def test_the_drivers_own_patterns_are_the_protocols() -> None:
    # the driver imports no nodeops module: its copies must not drift
    assert B.RANK_OUTPUT.pattern == P.RANK_OUTPUT.pattern
    assert B.AGENT_FAILED.pattern == P.AGENT_FAILED.pattern


def test_the_heartbeat_target_is_address_port_token() -> None:
    assert B.beat_target("10.0.0.1 40123 abc") == ("10.0.0.1", 40123, "abc")
    assert B.beat_target("fe80::1 9 abc") == ("fe80::1", 9, "abc")
    for bad in ("", "10.0.0.1 40123", "10.0.0.1 port abc", "a b c d"):
        assert B.beat_target(bad) is None, bad


def test_a_node_silent_for_lost_after_is_lost_and_one_never_heard_or_ended_is_not() -> None:
    b = B.Beats("t0k", ["node1", "node2", "node3"])
    b.take(beat("node1"), 100.0, 1000.0)
    b.take(beat("node2"), 100.0, 1000.0)
    # node3 never spoke (its task did not start, or UDP does not reach here): srun alone judges it
    assert b.lost(100.0 + B.LOST_AFTER - 0.1) == []
    b.take(beat("node1"), 104.0, 1004.0)
    assert b.lost(100.0 + B.LOST_AFTER) == [("node2", B.LOST_AFTER)]
    # a task that said its end is not lost, whatever its silence after
    b.take(beat("node2", end=0), 105.5, 1005.5)
    assert b.lost(200.0) == [("node1", 96.0)]


def test_once_a_rank_failed_a_silent_node_is_lost_sooner() -> None:
    b = B.Beats("t0k", ["node1", "node2"])
    b.take(beat("node1"), 100.0, 1000.0)
    b.take(beat("node2"), 100.0, 1000.0)
    b.take(beat("node1", failed=True), 101.5, 1001.5)  # torchrun's failure line in node1's log
    assert b.lost(100.0 + B.LOST_QUICK) == [("node2", B.LOST_QUICK)]
    assert b.times["failed"] == 1001.5 and "stop_sent" not in b.times  # srun stops nothing until a task ends
    # a task's failed exit: srun's --kill-on-bad-exit stops the others as it hears of it
    b.take(beat("node1", end=1), 102.0, 1002.0)
    assert (b.times["failed"], b.times["stop_sent"]) == (1001.5, 1002.0)
    assert b.settled(102.0, "node2") and not b.settled(100.5, "node1")  # node2 spoke 0.5 s ago


def test_the_timeline_every_node_up_then_progress_then_the_first_failure() -> None:
    b = B.Beats("t0k", ["node1", "node2"])
    b.take(beat("node1"), 1.0, 1001.0)
    assert "last_progress" not in b.times  # nothing grew yet
    b.take(beat("node1", grown=10, up=True), 2.0, 1002.0)
    assert b.times == {"last_progress": 1002.0}  # node2's ranks have not printed: not up yet
    b.take(beat("node2", grown=5, up=True), 3.0, 1003.0)
    assert b.times == {"last_progress": 1003.0, "ranks_up": 1003.0}
    b.take(beat("node1", grown=10, up=True), 4.0, 1004.0)  # the same again: no progress
    b.take(beat("node2", grown=5, up=True, progress=1003.5), 5.0, 1005.0)  # the progress file, touched
    assert b.times == {"last_progress": 1005.0, "ranks_up": 1003.0}
    b.take(beat("node2", grown=9, up=True, progress=1003.5, end=3), 6.0, 1006.0)
    assert b.times == {"last_progress": 1006.0, "ranks_up": 1003.0, "failed": 1006.0, "stop_sent": 1006.0}
    want = {"began": 1000.0, "last_progress": 1006.0, "ranks_up": 1003.0, "failed": 1006.0, "stop_sent": 1006.0,
            "ended": 1007.25}  # fmt: skip
    assert B.step_times(1000.0, b.times, 1007.25) == want


def test_a_heartbeat_of_another_job_or_node_or_garbage_is_ignored() -> None:
    b = B.Beats("t0k", ["node1"])
    for data in (beat("node1", token="other"), beat("node9"), b"not json", b"[1]", b'{"token": "t0k"}',
                 json.dumps({"token": "t0k", "node": "node1", "grown": "x", "progress": 0}).encode()):  # fmt: skip
        b.take(data, 1.0, 1.0)
    assert b.heard == {} and b.times == {}


def test_a_nodes_log_says_its_ranks_printed_and_torchruns_failure_in_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "node1.log"
    log.write_text("[rank0]:an earlier attempt's line\n")
    nl = B.NodeLog(str(log))
    assert (nl.look(), nl.up, nl.failed) == (0, False, False)  # what came before the task is not its
    with log.open("a") as f:
        f.write("W1127 torchrun's warning\n\x1e[rank1]:ste")
    assert (nl.look(), nl.up) == (37, False)  # half a line: not yet
    with log.open("a") as f:
        f.write("p 0\n")
    assert (nl.look(), nl.up, nl.failed) == (41, True, False)
    with log.open("a") as f:
        f.write("E1127 00:00:00.1 9 torch/distributed/elastic/multiprocessing/api.py:1] failed (exitcode: 1) "
                "local_rank: 0 (pid: 7) of binary: python\n")  # fmt: skip
    nl.look()
    assert nl.failed
    assert B.NodeLog(str(tmp_path / "none.log")).look() == 0


def test_the_hang_watchdogs_times_and_the_step_record(tmp_path: Path) -> None:
    (tmp_path / "hang.json").write_text(json.dumps({"why": "x", "fired": 1000.5, "stop_sent": 1041.25}))
    assert B.hang_times(str(tmp_path / "hang.json")) == {"failed": 1000.5, "stop_sent": 1041.25}
    (tmp_path / "hang.json").write_text(json.dumps({"why": "an older watchdog's report"}))
    assert B.hang_times(str(tmp_path / "hang.json")) == {}
    assert B.hang_times(str(tmp_path / "none.json")) == {}
    # decide reads the driver's record of its own attempt only
    (tmp_path / SF.STEP).write_text(json.dumps({"attempt": 2, "times": {"began": 1.0}, "lost": None}))
    assert SF._step(str(tmp_path), 2)["times"] == {"began": 1.0}
    assert SF._step(str(tmp_path), 1) == {}


def test_heartbeats_over_udp_from_a_task_to_the_batch_node(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node1.log").write_text("")
    listener = B.Listener("127.0.0.1", ["node1"])
    try:
        heart = B.Heart(listener.env, "node1", str(tmp_path))
        with (tmp_path / "logs" / "node1.log").open("a") as f:
            f.write("\x1e[rank0]:step 0\n")
        heart.send(None)
        heart.end(0)
        deadline = time.monotonic() + 10
        while "node1" not in listener.beats.ended and time.monotonic() < deadline:
            listener.drain(0.2)
        assert listener.beats.ended == {"node1": 0}
        assert set(listener.beats.times) == {"last_progress", "ranks_up"}
    finally:
        listener.stop()
    # nowhere to send: the task runs on without heartbeats
    quiet = B.Heart("", "node1", str(tmp_path))
    quiet.start()
    quiet.end(0)
