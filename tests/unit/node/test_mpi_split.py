"""mpi_split.py: mpirun's --tag-output lines back into each rank's lines, by node, and the first
failed rank mpirun reports (runner mpirun on Slurm; the ssh backend's emitter reads with the
same Lines). The shipped file is run as the batch script runs it: python3, stdin, no package."""

from __future__ import annotations

import math
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeops.launch import plan as _launch_plan
from nodeops.node import mpi_split
from nodeops.node import protocol as P
from nodeops.node import slurm_failures as SF

SPLIT = Path(mpi_split.__file__)

# What mpirun 4.1 printed on the Slurm sandbox when rank 2 exited 1 (trimmed), with two ranks'
# pieces on one physical line, as Open MPI writes them when ranks' writes interleave.
MPIRUN_OUT = """\
[1,0]<stdout>:rank 0/4 on node1
[1,2]<stdout>:rank 2/4 on node2
[1,1]<stdout>:rank 1/[1,3]<stdout>:rank 3/4 on node3
[1,1]<stdout>:4 on node1
[1,2]<stderr>:rank 2: failing on purpose at step 3
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[20161,1],2]
  Exit code:    1
--------------------------------------------------------------------------
"""


def shipped(tmp_path: Path) -> Path:
    """mpi_split.py as the Slurm run dir holds it: protocol.py beside it and nothing else of nodeops."""
    ship = tmp_path / "ship"
    ship.mkdir(exist_ok=True)
    (ship / "protocol.py").write_text(Path(P.__file__).read_text())
    (ship / "mpi_split.py").write_text(SPLIT.read_text())
    return ship / "mpi_split.py"


def run_split(tmp_path: Path, text: str, *nodes: str) -> subprocess.CompletedProcess[str]:
    """As the batch script runs it (python3 -I: no user site, no PYTHON* variables, no script dir
    first on sys.path)."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-I", str(shipped(tmp_path)), str(tmp_path), *nodes], input=text,
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip


def test_each_rank_line_goes_to_its_own_node_log_and_mpiruns_own_to_the_batch_log(tmp_path: Path) -> None:
    p = run_split(tmp_path, MPIRUN_OUT, "node1", "node1", "node2", "node3")
    assert p.returncode == 0, p.stderr
    logs = {f.stem: f.read_text() for f in (tmp_path / "logs").iterdir()}
    assert logs == {
        "node1": "[rank0]:rank 0/4 on node1\n[rank1]:rank 1/4 on node1\n",
        "node2": "[rank2]:rank 2/4 on node2\n[rank2]:rank 2: failing on purpose at step 3\n",
        "node3": "[rank3]:rank 3/4 on node3\n",
    }
    out = p.stdout.splitlines()
    assert "  Process name: [[20161,1],2]" in out and not any("<stdout>" in line for line in out)
    assert out[-1] == "nodeops: mpirun: first failure: rank 2 on node2 (exit code 1)"
    # what launch and status then report: the node and the code from that line
    assert SF.first_failure(out) == ("node2", 1)


def test_a_rank_a_signal_ended_is_named_with_its_shell_exit_code(tmp_path: Path) -> None:
    text = ("[1,0]<stdout>:step 1\n"
            "mpirun noticed that process rank 1 with PID 0 on node node2 exited on signal 9 (Killed).\n")  # fmt: skip
    p = run_split(tmp_path, text, "node1", "node2")
    assert p.stdout.splitlines()[-1] == "nodeops: mpirun: first failure: rank 1 on node2 (exit code 137)"
    assert (tmp_path / "logs" / "node1.log").read_text() == "[rank0]:step 1\n"


# What mpirun 4.1 printed in CI (trimmed) when rank 2 on node2 exited 1 at step 3: rank 1, on
# mpirun's own node, lost its gloo peer and aborted, and mpirun heard of that first. The exit
# marks are the MPI shim's (rank 3's is the earliest, but rank 3 lost a peer too).
VICTIM_NAMED = """\
[1,2]<stderr>:rank 2: failing on purpose at step 3
[1,2]<stderr>:@@nodeops-rank-exit 1 1795629711.250000000 -
[1,1]<stderr>:[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.220.0.12]:29877.
[1,1]<stderr>:terminate called without an active exception
[1,1]<stderr>:@@nodeops-rank-exit 134 1795629711.251000000 -
[1,3]<stderr>:[rank3]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.220.0.12]:15772.
[1,3]<stdout>:half a line[1,3]<stderr>:@@nodeops-rank-exit 1 1795629711.249000000 -
--------------------------------------------------------------------------
mpirun noticed that process rank 1 with PID 0 on node node1 exited on signal 6 (Aborted).
--------------------------------------------------------------------------
"""
# mpirun's other form of the same report: the shim ended with a code, not by the signal
REPORT = MPIRUN_OUT[MPIRUN_OUT.rindex("-" * 74, 0, MPIRUN_OUT.index("mpirun detected")) :]
EXIT_FORM = REPORT.replace("],2]", "],1]").replace("Exit code:    1\n", "Exit code:    134\n")
assert EXIT_FORM != REPORT and "],1]" in EXIT_FORM


@pytest.mark.parametrize("report", ["signal", "exit code"])
def test_a_rank_mpirun_names_that_only_lost_its_peer_gives_way_to_the_rank_that_failed_first(
    tmp_path: Path, report: str
) -> None:
    """The CI failure of stop 38's resubmission: mpirun named rank 1 (signal 6), whose own lines say
    its peer closed the connection. Rank 2 failed without saying so: it is the first failure.
    Rank 3 lost a peer too, so its earlier mark does not count. The marks stay out of the logs."""
    text = VICTIM_NAMED if report == "signal" else VICTIM_NAMED.split("-" * 74)[0] + EXIT_FORM
    p = run_split(tmp_path, text, "node1", "node1", "node2", "node3")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "nodeops: mpirun: first failure: rank 2 on node2 (exit code 1)"
    logs = {f.stem: f.read_text() for f in (tmp_path / "logs").iterdir()}
    assert "@@nodeops" not in "".join(logs.values())
    assert logs["node2"] == "[rank2]:rank 2: failing on purpose at step 3\n"
    assert logs["node3"].endswith("[rank3]:half a line\n")  # a rank's piece before the mark is its own


def test_mpiruns_choice_stands_where_it_did_not_lose_a_peer_or_no_rank_failed_by_itself() -> None:
    report = "mpirun noticed that process rank 1 with PID 0 on node node1 exited on signal 9 (Killed)."
    lost = "RuntimeError: Connection reset by peer"

    def mark(code: int, at: float, sig: str = "-") -> str:
        return f"@@nodeops-rank-exit {code} {at} {sig}"

    # rank 1 did not lose a peer (the OOM killer, say): it stands, though rank 2 has an earlier mark
    assert mpi_split.cause(report, {1: ["x", mark(137, 5)], 2: [mark(1, 4)]}) == (1, 137)
    # rank 1 lost a peer, but every other rank that failed did too: mpirun's choice stands
    assert mpi_split.cause(report, {1: [lost, mark(134, 5)], 2: [lost, mark(1, 4)]}) == (1, 137)
    # the earliest of those that failed by themselves; a mark of 0 is no failure
    tails = {1: [lost], 2: [mark(1, 9)], 3: [mark(3, 7)], 0: [mark(0, 1)]}
    assert mpi_split.cause(report, tails) == (3, 3)
    assert mpi_split.cause("no report", tails) is None  # mpirun named no rank: nothing to refine
    # one that ended before any outside signal comes first, whatever the clocks and codes: the
    # OOM killer's 137 (no signal to the shim) beats a rank whose SIGTERM handler then exited 1
    tails = {1: [lost], 2: [mark(137, 9)], 3: [mark(1, 7, "TERM")], 4: [mark(143, 1, "TERM")]}
    assert mpi_split.cause(report, tails) == (2, 137)
    # a rank the teardown ended is still named over a victim, with the code it ended with
    assert mpi_split.cause(report, {1: [lost], 4: [mark(143, 1, "TERM")]}) == (4, 143)
    # only the rank's last line is the shim's mark: a rank that printed one earlier did not end there
    assert mpi_split.cause(report, {1: [lost], 5: [mark(1, 0), "later output"]}) == (1, 137)
    # a node whose date gave no time: the mark still counts (after any with a time) and is hidden
    assert mpi_split.exited("abc@@nodeops-rank-exit 1 - -") == ("abc", mpi_split.Exit(1, math.inf, False))
    assert mpi_split.cause(report, {1: [lost], 2: ["@@nodeops-rank-exit 1 - -"], 3: [mark(3, 7)]}) == (3, 3)
    assert mpi_split.exited("@@nodeops-rank-exit 1 x -") == ("@@nodeops-rank-exit 1 x -", None)  # not a mark


def test_a_clean_run_adds_no_failure_line_and_appends_to_existing_logs(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node1.log").write_text("nodeops: requeued, restart 1\n")  # a requeued job's log goes on
    p = run_split(tmp_path, "[1,0]<stdout>:done\n", "node1")
    assert p.returncode == 0 and p.stdout == ""
    assert (tmp_path / "logs" / "node1.log").read_text() == "nodeops: requeued, restart 1\n[rank0]:done\n"


def test_a_rank_beyond_the_map_and_bad_bytes_go_to_the_batch_log_unharmed(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    p = subprocess.run([sys.executable, "-I", str(shipped(tmp_path)), str(tmp_path), "node1"],
                       input=b"[1,5]<stdout>:odd \xff\n", capture_output=True, timeout=30, check=False)  # fmt: skip
    assert p.returncode == 0 and p.stdout.decode() == "[rank5]:odd \ufffd\n"
    assert not (tmp_path / "logs" / "node1.log").exists()


def test_a_carriage_return_a_last_line_without_newline_and_a_dead_ranks_piece_are_kept(tmp_path: Path) -> None:
    """A progress bar's \\r stays inside its line; the output's last line may have no newline; a
    rank's piece still waiting for its newline when the output ends (the rank died) is written."""
    text = "[1,0]<stderr>:\r 10%[1,0]<stderr>:\r 20%\n[1,1]<stdout>:last words[1,0]<stdout>:x\n[1,0]<stdout>:end"
    p = run_split(tmp_path, text, "node1", "node2")
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr
    assert (tmp_path / "logs" / "node1.log").read_bytes() == b"[rank0]:\r 10%\r 20%\n[rank0]:x\n[rank0]:end\n"
    assert (tmp_path / "logs" / "node2.log").read_text() == "[rank1]:last words\n"
    # any output is progress for the hang watchdog, newline or not
    assert (tmp_path / "progress").exists()


def test_a_rank_line_that_looks_like_mpiruns_report_names_no_failure(tmp_path: Path) -> None:
    """Only mpirun's own (untagged) lines are read for its failure report."""
    text = "[1,0]<stdout>:  Process name: [[1,1],1]\n[1,0]<stdout>:  Exit code:    3\n"
    p = run_split(tmp_path, text, "node1", "node2")
    assert p.stdout == "" and "first failure" not in (tmp_path / "logs" / "node1.log").read_text()


def test_without_its_arguments_it_says_how_to_call_it(tmp_path: Path) -> None:
    p = run_split(tmp_path, "")  # the run dir, no node
    assert p.returncode == 2 and "usage: mpi_split.py RUN_DIR NODE_OF_RANK_0" in p.stderr


texts = st.text(st.characters(blacklist_characters="\n\r[", blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), texts, st.booleans()), max_size=30))
def test_lines_reassembles_any_interleaving_of_rank_pieces(writes: list[tuple[int, str, bool]]) -> None:
    """Each write is a chunk of one rank's output, which Open MPI tags; a chunk that ends its
    rank's line (its newline) ends the physical line too, so a physical line can hold other
    ranks' partial chunks before it. Lines gives every rank's lines back whole and in order."""
    physical: list[str] = []
    expected: list[tuple[int, str]] = []
    current, partial = "", {}
    for rank, chunk, ends in writes:
        current += f"[1,{rank}]<stdout>:{chunk}"
        partial[rank] = partial.get(rank, "") + chunk
        if ends:
            physical.append(current)
            expected.append((rank, partial.pop(rank)))
            current = ""
    lines = mpi_split.Lines()
    assert [item for line in physical for item in lines.feed(line)] == expected


M = "\x1e"  # the mark before torchrun's "[rankN]:" (_launch_plan.RANK_PREFIX)
chunks = st.text(st.characters(blacklist_characters="\n\x1e", blacklist_categories=("Cs",)), min_size=1, max_size=20)


def test_the_mark_readers_look_for_is_the_prefix_torchrun_is_given() -> None:
    prefix = string.Template(_launch_plan.RANK_PREFIX).substitute(rank=3)
    assert mpi_split.RANK.fullmatch(prefix) and prefix.startswith(M)
    env = _launch_plan.job_env("torchrun", {}, "/r")
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == _launch_plan.RANK_PREFIX


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), chunks, st.booleans()), max_size=30))
def test_rank_lines_reassembles_torchruns_tee_of_lines_written_in_pieces(
    writes: list[tuple[int, str, bool]],
) -> None:
    """torchrun's tee echoes each rank's log by readline, so a line the rank is still writing
    (unbuffered Python writes a print's text and its newline apart) comes out as its start with
    the rank's prefix and no newline; the next write, of any rank, follows on the same physical
    line. RankLines gives every rank's lines back whole, in order, whatever the ranks' text
    holds (their own "[rank1]:" included), and at the end the pieces still waiting."""
    physical: list[str] = []
    expected: list[str] = []
    current, pieces, fed = "", [], {}  # fed: the pieces read of lines not ended yet
    for rank, chunk, ends in writes:
        current += f"{M}[rank{rank}]:{chunk}"
        pieces.append((rank, chunk))
        if ends:  # the physical line ends with this rank's newline: it is read
            physical.append(current)
            for r, text in pieces[:-1]:
                fed[r] = fed.get(r, "") + text
            expected.append(f"[rank{rank}]:{fed.pop(rank, '')}{chunk}")
            current, pieces = "", []
    joined = mpi_split.RankLines()
    assert [w for line in physical for w in joined.feed(line)] == expected
    assert joined.flush() == [f"[rank{r}]:{t}" for r, t in fed.items()]


def test_rank_lines_joins_the_cut_line_ci_saw_and_leaves_other_lines_alone() -> None:
    out = mpi_split.rank_lines([
        # a CI run's node log (torch 2.13): rank 2's print cut in two by the tee
        f"{M}[rank2]:rank 2 restart 1 attempt 2{M}[rank2]:",
        f"{M}[rank2]:rank 2 done",
        # a rank's own text that looks like the prefix, and torch's own prefixed warning: as they came
        f"{M}[rank0]:12:00 INFO [rank0]: loss 3.1 from [rank3]: ok",
        f"{M}[rank0]:[rank0]:[W1125 16:00:04.674000 ProcessGroupGloo.cpp:42] Warning: x",
        # torchrun's own lines and mpirun's whole rank lines (no mark) pass as they are
        "E1125 16:00:04 api.py:1002] failed [rank2]: exitcode 1",
        "[rank1]:an mpirun rank's line",
        f"{M}[rank1]:a piece{M}[rank3]:b",
        f"{M}[rank3]:c{M}[rank1]: and its end",
        # rank 3 dies mid-line; nodeops' mark of the next attempt gives its piece back first
        f"{M}[rank3]:cut short{M}[rank0]:zero",
        "==> nodeops: attempt 2/2 on node1,node3",
        f"{M}[rank3]:attempt 2",
        f"{M}[rank0]:the end, with no newline",
    ])  # fmt: skip
    assert out == [
        "[rank2]:rank 2 restart 1 attempt 2",
        "[rank2]:rank 2 done",
        "[rank0]:12:00 INFO [rank0]: loss 3.1 from [rank3]: ok",
        "[rank0]:[rank0]:[W1125 16:00:04.674000 ProcessGroupGloo.cpp:42] Warning: x",
        "E1125 16:00:04 api.py:1002] failed [rank2]: exitcode 1",
        "[rank1]:an mpirun rank's line",
        "[rank3]:b",
        "[rank1]:a piece and its end",
        "[rank0]:zero",
        "[rank3]:ccut short",
        "==> nodeops: attempt 2/2 on node1,node3",
        "[rank3]:attempt 2",
        "[rank0]:the end, with no newline",
    ]


def test_a_piece_that_never_ends_is_given_back_past_max_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mpi_split, "MAX_LINE", 8)
    joined = mpi_split.RankLines()
    assert joined.feed(f"{M}[rank0]:\r 10%{M}[rank1]:x") == ["[rank1]:x"]
    assert joined.feed(f"{M}[rank0]:\r 20%{M}[rank0]:\r 30%{M}[rank1]:y") == ["[rank0]:\r 10%\r 20%", "[rank1]:y"]
    assert joined.flush() == ["[rank0]:\r 30%"]
