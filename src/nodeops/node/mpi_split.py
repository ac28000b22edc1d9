"""mpirun's output by rank (stdlib only, Python 3.8+): Open MPI's ``--tag-output`` pieces put back
into each rank's own lines, and the first failed rank mpirun reports.

Over ssh the controller reads the chief's mpirun output through :class:`Lines` (backends/ssh.py).
On Slurm it is shipped into the run dir as ``mpi_split.py``; the batch script pipes mpirun's
output through it on the batch node:

    python3 mpi_split.py RUN_DIR NODE_OF_RANK_0 NODE_OF_RANK_1 ...

Each rank's lines go, as ``[rankN]:LINE`` (torchrun's prefix), into ``RUN_DIR/logs/NODE.log`` of
its own node, where the training step's lines go under torchrun; mpirun's own lines go to
stdout (the batch log), and after mpirun's failure report one line names the rank and its node:
``nodeops: mpirun: first failure: rank R on NODE (exit code N)`` (:data:`FAILURE`). That rank
is mpirun's, unless its lines say it lost a peer and another rank failed by itself first
(:func:`cause`); protocol.py lies beside it in the run dir for that.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, TextIO

if __package__:
    from . import protocol as P
else:  # shipped: protocol.py lies beside this file in the run dir (run with -I: appended, the stdlib first)
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import protocol as P  # type: ignore[import-not-found,no-redef]

TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")
# torchrun's prefix of each rank's echoed lines, as nodeops sets it (_launch_plan.RANK_PREFIX:
# an ASCII record separator, then "[rankN]:"); RankLines shows them as "[rankN]:"
RANK = re.compile("\x1e" + r"\[rank(\d+)\]:")
# mpirun's report of the first rank that failed ("Process name: [[job,1],R]" ... "Exit code: N"),
# or of one that a signal ended ("... process rank R with PID P on node N exited on signal S")
FIRST = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
EXIT = re.compile(r"Exit code:\s+(-?\d+)")
REPORT = re.compile(FIRST.pattern + r"\s*" + EXIT.pattern)  # the two lines of one report
SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
OWN_LINES = 200  # of mpirun's own lines, kept for its failure report
CHUNK = 1 << 16  # bytes read at a time
MAX_LINE = 1 << 20  # bytes without a newline that are written out as a line anyway
FAILURE = re.compile(r"nodeops: mpirun: first failure: rank (\d+) on (\S+) \(exit code (-?\d+)\)")
# The MPI shim's last line on a rank's stderr when the rank exits non-zero: its code (a signal
# as 128 + N), when (seconds since the epoch; "-" where the node's date could not say) and the
# first signal the shim got from outside while it waited ("-": none; mpirun's teardown sends
# SIGTERM to the whole group). At the end of a rank's line: a piece of the rank's own output
# without its newline may come first.
EXITED = re.compile(r"@@nodeops-rank-exit (\d+) (\d+(?:\.\d+)?|-) ([A-Z0-9]+|-)$")


def pieces(line: str, tag: re.Pattern[str] = TAG) -> tuple[str, list[tuple[int, str]]]:
    """The tagged pieces of one physical line: the untagged text before the first tag, and
    (rank, text) for each tagged piece."""
    parts = tag.split(line)
    return parts[0], [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]


class Lines:
    """A tagged writer tags every chunk a rank writes, so one physical line can hold the pieces
    of several ranks' lines ("[1,1]<stdout>:a[1,0]<stdout>:b"); the newline that ends the
    physical line belongs to its last piece. Open MPI's --tag-output does this (``tag``
    :data:`TAG`), and so does torchrun's tee (:data:`RANK`): it echoes a rank's log file by
    ``readline``, which returns the start of a line the rank is still writing (unbuffered
    Python writes a print's text and its newline apart), so "<tag>text<tag>" and then the next
    line. ``feed`` gives back whole lines: (None, text) for the writer's own (untagged) text,
    (rank, text) for a rank's line. A piece waits for the rest of its line, but not for ever:
    past MAX_LINE characters (a progress bar's \\r updates) it is given back as a line."""

    def __init__(self, tag: re.Pattern[str] = TAG) -> None:
        self.tag = tag
        self.pending: dict[int, str] = {}

    def flush(self) -> list[tuple[int | None, str]]:
        """The pieces still waiting for their newline, each as a line (at the end of the output)."""
        out: list[tuple[int | None, str]] = list(self.pending.items())
        self.pending.clear()
        return out

    def feed(self, line: str) -> list[tuple[int | None, str]]:
        head, parts = pieces(line, self.tag)
        if not parts:
            return [(None, line)]
        out: list[tuple[int | None, str]] = [(None, head)] if head else []
        for n, (rank, text) in enumerate(parts):
            self.pending[rank] = self.pending.get(rank, "") + text
            if n == len(parts) - 1 or len(self.pending[rank]) > MAX_LINE:
                out.append((rank, self.pending.pop(rank)))
        return out


class RankLines:
    """torchrun's rank lines made whole again, one host's output at a time (:class:`Lines` with
    :data:`RANK`), and shown as ``[rankN]:text``. A line without the mark (torchrun's own,
    nodeops' marks between attempts, a Slurm restart's) first gives back what is pending, as
    lines: a rank that died mid-line never glues its piece onto the next attempt's line."""

    def __init__(self) -> None:
        self.lines = Lines(RANK)

    @staticmethod
    def _text(rank: int | None, text: str) -> str:
        return text if rank is None else f"[rank{rank}]:{text}"

    def feed(self, line: str) -> list[str]:
        if not line.startswith("\x1e"):
            return [*self.flush(), line]
        return [self._text(r, t) for r, t in self.lines.feed(line)]

    def flush(self) -> list[str]:
        return [self._text(r, t) for r, t in self.lines.flush()]


def rank_lines(lines: Iterable[str]) -> list[str]:
    """A whole log's lines with torchrun's rank lines made whole (:class:`RankLines`)."""
    joined = RankLines()
    return [whole for line in lines for whole in joined.feed(line)] + joined.flush()


def first_failure(text: str) -> tuple[int, int | None] | None:
    """(rank, exit code) of the first failed rank mpirun's report names (a signal as 128 + N,
    as a shell says it; None where the report gives no code), or None."""
    both = REPORT.search(text)
    if both:
        return int(both.group(1)), int(both.group(2))
    m = FIRST.search(text)
    if m:
        return int(m.group(1)), None
    s = SIGNALLED.search(text)
    return (int(s.group(1)), 128 + int(s.group(2))) if s else None


class Exit(NamedTuple):
    """A rank's exit, as the MPI shim marked it."""

    code: int
    at: float  # inf where the node's date gave no time
    signalled: bool  # a signal came from outside (the group's) before the rank ended


def exited(text: str) -> tuple[str, Exit | None]:
    """A rank's line without the MPI shim's exit mark, and the mark, if any."""
    m = EXITED.search(text)
    if m is None:
        return text, None
    at = float(m.group(2)) if m.group(2) != "-" else math.inf
    return text[: m.start()], Exit(int(m.group(1)), at, m.group(3) != "-")


def cause(text: str, tails: Mapping[int, Sequence[str]]) -> tuple[int, int | None] | None:
    """(rank, exit code) of the rank whose failure started it. mpirun names the first failed rank
    it heard of, which is often one that only lost its peer: a rank on mpirun's own node, say,
    whose collective call failed ("Connection closed by peer") before the news of the real
    failure arrived from another node. When the rank mpirun names printed that it lost a peer,
    the rank that failed without saying so is named instead (by the shim's exit mark, each
    rank's last line in ``tails``, its last lines); with none, mpirun's. Among them, one that
    ended before any signal came from outside comes first (a rank mpirun's teardown stopped
    comes after), then the earliest: the times come from each node's own clock. A rank is
    named with the code it ended with (143 where the teardown ended it first)."""
    named = first_failure(text)
    if named is None:
        return None

    def lost_peer(rank: int) -> bool:
        return any(P.PEER_LOST.search(line) for line in tails.get(rank, ()))

    if not lost_peer(named[0]):
        return named
    own = []
    for rank, lines in tails.items():
        mark = exited(lines[-1])[1] if lines else None  # the shim's mark is the rank's last line
        if mark is not None and mark.code != 0 and not lost_peer(rank):
            own.append((mark.signalled, mark.at, rank, mark.code))
    if not own:
        return named
    *_, rank, code = min(own)
    return rank, code


def touch(path: str) -> None:
    try:
        with open(path, "a"):
            os.utime(path)
    except OSError:  # progress only: the lines matter more
        pass


def split(read: Callable[[int], bytes], out: TextIO, run_dir: str, rank_nodes: Sequence[str]) -> None:
    """Each rank's lines into its node's log, mpirun's own to ``out``, then the failure line.
    Reads what arrives (not whole lines): any output touches the run's progress file, so a
    rank that writes without newlines (a progress bar's \\r) still shows the hang watchdog
    progress, as its node log's growth does under torchrun."""
    lines = Lines()
    own: collections.deque[str] = collections.deque(maxlen=OWN_LINES)  # mpirun's own, for its report
    tails: dict[int, collections.deque[str]] = {}  # each rank's last lines, its exit mark included
    progress = os.path.join(run_dir, "progress")
    touched = 0.0
    with contextlib.ExitStack() as stack:
        logs: dict[str, TextIO] = {}

        def put(rank: int | None, text: str) -> None:
            if rank is not None:
                tails.setdefault(rank, collections.deque(maxlen=P.TAIL_LINES)).append(text)
                text, mark = exited(text)
                if mark is not None and not text:
                    return
            node = rank_nodes[rank] if rank is not None and rank < len(rank_nodes) else None
            if node is None:
                if rank is None:
                    own.append(text)
                out.write(text + "\n" if rank is None else f"[rank{rank}]:{text}\n")
                out.flush()
                return
            if node not in logs:
                path = os.path.join(run_dir, "logs", node + ".log")
                logs[node] = stack.enter_context(open(path, "a", encoding="utf-8", errors="replace"))
            logs[node].write(f"[rank{rank}]:{text}\n")
            logs[node].flush()

        buf = b""
        while True:
            chunk = read(CHUNK)  # what has arrived, up to CHUNK bytes
            if not chunk:
                break
            now = time.monotonic()
            if now - touched >= 1.0:
                touch(progress)
                touched = now
            *done, buf = (buf + chunk).split(b"\n")
            if len(buf) > MAX_LINE:  # no newline for this long: what there is, as a line
                done.append(buf)
                buf = b""
            for raw in done:
                for rank, text in lines.feed(raw.decode("utf-8", "replace")):
                    put(rank, text)
        if buf:  # the last line had no newline
            for rank, text in lines.feed(buf.decode("utf-8", "replace")):
                put(rank, text)
        for rank, text in lines.flush():  # pieces of a line whose newline never came (a rank that died)
            put(rank, text)
    failed = cause("\n".join(own), tails)
    if failed is not None:
        rank, code = failed
        node = rank_nodes[rank] if rank < len(rank_nodes) else "?"
        out.write(f"nodeops: mpirun: first failure: rank {rank} on {node} (exit code {1 if code is None else code})\n")
        out.flush()


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: mpi_split.py RUN_DIR NODE_OF_RANK_0 [NODE_OF_RANK_1 ...]\n")
        return 2
    with open(sys.stdout.fileno(), "w", encoding="utf-8", errors="replace", closefd=False) as out:
        split(lambda n: os.read(0, n), out, argv[0], list(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
