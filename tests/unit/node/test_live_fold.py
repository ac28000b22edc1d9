"""What an attached launch shows live while a run fails (``failures.LiveFold``), on the lines a
real gloo run printed on the demo sandbox when rank 1 (node2) exited at step 3: its peers'
tracebacks of the lost connection, torchrun's failure report on node2, then the exit marks."""

from __future__ import annotations

from nodeops.node.failures import LiveFold, one_prefix

VICTIM = [
    "[rank{r}]:[rank{r}]: Traceback (most recent call last):",
    '[rank{r}]:[rank{r}]:   File "/srv/demo/ddp_train.py", line 90, in main',
    "[rank{r}]:[rank{r}]:     loss.backward()",
    "[rank{r}]:[rank{r}]:            ^^^^^^^^^^^^^^^^",
    "[rank{r}]:[rank{r}]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.213.0.12]:24501. This is typically caused by a remote worker crash",
]
REPORT = [
    "E1126 23:01:09.263000 1346 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
    "local_rank: 0 (pid: 1536) of binary: /home/debian/.nodeops/venv/bin/python3",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "ddp_train.py FAILED",
]


def victim(rank: int) -> list[str]:
    return [line.format(r=rank) for line in VICTIM]


def test_victims_tracebacks_and_torchruns_report_are_folded_and_the_failing_rank_shown() -> None:
    fold, shown, now = LiveFold(), [], 0.0
    feed = [("node2", "[rank1]:rank 1: failing on purpose at step 3")]
    feed += [("node3", line) for line in victim(2)] + [("node1", line) for line in victim(0)]
    feed += [("node2", line) for line in REPORT]
    for host, line in feed:
        shown += fold.line(host, line, now)
    shown += fold.job_failed("node2")
    shown += fold.flush()
    assert shown == [("node2", "[rank1]:rank 1: failing on purpose at step 3")]
    assert fold.folded("node2") == {"node3": 5, "node1": 5}  # node2's report: the verdict counts it
    assert fold.folded() == {"node3": 5, "node1": 5, "node2": 6}


def test_a_traceback_of_the_scripts_own_error_is_shown_whole() -> None:
    fold = LiveFold()
    own = ["[rank1]:[rank1]: Traceback (most recent call last):", '[rank1]:[rank1]:   File "t.py", line 3',
           "[rank1]:[rank1]: ValueError: bad batch"]  # fmt: skip
    for line in own:
        assert fold.line("node2", line, 0.0) == []
    assert fold.due(0.4) == []  # a chained exception may still follow
    assert fold.due(LiveFold.CHAIN_WAIT) == [("node2", line) for line in own]
    assert fold.folded() == {}
    # the rank's next line settles it at once
    for line in own:
        fold.line("node2", line, 1.0)
    assert fold.line("node2", "[rank1]:bye", 1.1) == [("node2", line) for line in [*own, "[rank1]:bye"]]


def test_a_chain_is_one_block_folded_only_when_every_exception_is_a_lost_peer() -> None:
    own_then_peer = ["[rank0]: Traceback (most recent call last):", "[rank0]: ValueError: bad shard", "[rank0]: ",
                     "[rank0]: During handling of the above exception, another exception occurred:", "[rank0]: ",
                     "[rank0]: Traceback (most recent call last):",
                     "[rank0]: [E1126 10:00:00.1 ProcessGroupNCCL.cpp:1] [PG 0] watchdog",  # c10d's log line
                     "[rank0]: RuntimeError: Connection closed by peer [10.0.0.2]:1"]  # fmt: skip
    fold = LiveFold()
    for line in own_then_peer:
        assert fold.line("node1", line, 0.0) == []
    assert fold.flush() == [("node1", line) for line in own_then_peer]
    peer_twice = [own_then_peer[0], "[rank0]: RuntimeError: Connection reset by peer", "[rank0]: ",
                  "[rank0]: The above exception was the direct cause of the following exception:", "[rank0]: ",
                  *own_then_peer[5:]]  # fmt: skip
    fold = LiveFold()
    for line in peer_twice:
        fold.line("node1", line, 0.0)
    assert fold.flush() == [] and fold.folded() == {"node1": len(peer_twice)}


def test_tracebacks_still_held_when_the_follow_is_interrupted_are_counted() -> None:
    fold = LiveFold()
    fold.line("node3", "[rank2]: Traceback (most recent call last):", 0.0)
    fold.line("node3", '[rank2]:   File "t.py", line 3', 0.0)
    assert fold.folded() == {"node3": 2}


def test_a_traceback_without_its_last_line_is_shown_after_a_while() -> None:
    fold = LiveFold()
    fold.line("node1", "[rank0]: Traceback (most recent call last):", 10.0)
    fold.line("node1", '[rank0]:   File "t.py", line 3', 10.5)
    assert fold.due(11.0) == []
    assert fold.due(10.0 + LiveFold.BLOCK_WAIT) == [("node1", "[rank0]: Traceback (most recent call last):"),
                                                    ("node1", '[rank0]:   File "t.py", line 3')]  # fmt: skip


def test_after_a_failure_the_other_hosts_lines_are_held_unless_their_own_job_fails() -> None:
    fold = LiveFold()
    assert fold.job_failed("node2") == []
    assert fold.line("node1", "[rank0]:step 4", 0.0) == []
    assert fold.line("node3", "[rank2]:step 4", 0.0) == []
    assert fold.job_failed("node3") == [("node3", "[rank2]:step 4")]  # its own failure's lines
    assert fold.folded() == {"node1": 1}
    assert fold.line("node3", "[rank2]:after", 0.0) == [("node3", "[rank2]:after")]


def test_torchruns_teardown_word_holds_that_hosts_lines() -> None:
    fold = LiveFold()
    line = (
        "W1126 torch/distributed/elastic/agent/server/api.py] Received Signals.SIGTERM death signal, shutting down "
        "workers"
    )
    assert fold.line("node1", line, 0.0) == []
    assert fold.line("node1", "[rank0]:bye", 0.0) == []
    assert fold.folded() == {"node1": 2}


def test_one_prefix() -> None:
    assert one_prefix("[rank0]:[rank0]: Traceback") == "[rank0]: Traceback"
    assert one_prefix("[rank0]:step 1") == "[rank0]:step 1"
    assert one_prefix("[rank0]:[rank1]: odd") == "[rank0]:[rank1]: odd"  # another rank's prefix is kept
    assert one_prefix("plain") == "plain"
