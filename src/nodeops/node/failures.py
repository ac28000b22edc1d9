"""Failure analysis of a finished run: which host's failure started it (the root cause), its
exit code, and which of its lines to show. Pure functions over each host's last lines; the ssh
follower and the Slurm backend both use them."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodeops.node import mpi_split as M
from nodeops.node import protocol as P

TAIL_LINES = P.TAIL_LINES
SHOWN_LINES = 20  # of them, the failing rank's own last lines shown under FAILED
HUNG_EXIT = 124  # a run the hang watchdog stopped (as timeout(1) exits when its command timed out)
TEARDOWN_EXIT = 3  # every rank finished its work, then one crashed in its teardown (the results are complete)


def exit_code_for(outcome: str, code: int | None = None, kind: str = "") -> int | None:
    """The one exit-code rule of a run, on every backend: 0 when it succeeded; 130 when it was
    stopped (Ctrl-C, `nodeops stop`, scancel); 124 when the hang watchdog stopped it; for a
    failure, the failing rank's own code, except the codes nodeops keeps for itself (2: bad
    usage, nothing was run; 130: interrupted) and codes a process cannot exit with, which become
    1; TEARDOWN_EXIT when every rank had finished its work before one crashed in its teardown
    (``kind`` teardown). None: the outcome is not known."""
    if outcome == "ok":
        return 0
    if outcome == "stopped":
        return 130
    if outcome == "hung":
        return HUNG_EXIT
    if outcome != "failed":
        return None
    if kind == "teardown":
        return TEARDOWN_EXIT
    return code if isinstance(code, int) and 0 < code < 256 and code not in (2, 130) else 1


@dataclass
class HostState:
    host: str
    exit_code: int | None = None  # None: still running; -1: lost (ssh died or job killed)
    lost_reason: str = ""
    stopped: bool = False  # stopped by a teardown (the supervisor's or ours): a victim, never a cause
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ended_at: float = 0.0


# torchrun's word that it was told to stop (torch.distributed.elastic's agent: "Received
# Signals.SIGTERM death signal, shutting down workers"); its SignalException traceback follows.
TEARDOWN_LINE = re.compile(r"death signal, shutting down workers")


def blame_mpi_rank(root: HostState, rank_tails: dict[int, deque[str]], rank_hosts: Sequence[str]) -> HostState:
    """mpirun reports the first rank that failed ("Process name: [[job,1],R]", "Exit code: N"):
    name that rank's own host, with that rank's own lines, instead of mpirun's host; or the rank
    that failed by itself first, where mpirun's only lost its peer (mpi_split.cause)."""
    failed = M.cause("\n".join(root.tail), rank_tails) if rank_hosts else None
    if failed is None:
        return root
    rank, code = failed
    host = rank_hosts[rank] if rank < len(rank_hosts) else root.host
    st = HostState(f"{host} [rank{rank}]")
    st.exit_code = root.exit_code if code is None else code
    st.tail.extend(text for text, _ in map(M.exited, rank_tails.get(rank, [])) if text)  # without the exit mark
    st.ended_at = root.ended_at
    return st


_BLAMED_PEER = re.compile(r"by peer \[([0-9A-Fa-f.:]+)\]")
_DS_RANK_EXIT = re.compile(r"exits with return code = (-?\d+)")


def blame_peers(states: dict[str, HostState], remote_tails: dict[str, deque[str]], addresses: dict[str, str]) -> None:
    """pdsh may report a peer's failure before the node that caused it, and the teardown can
    end pdsh before it reports the cause at all. gloo names the peer that went away
    ("Connection closed by peer [ADDR]"): that node becomes a failed host too, with its own
    lines and DeepSpeed's "exits with return code = N" as its code."""
    for st in list(states.values()):
        for line in list(st.tail):
            m = _BLAMED_PEER.search(line)
            name = addresses.get(m.group(1)) if m else None
            if m is None or name is None or states.get(name, HostState(name)).exit_code not in (None, 0):
                continue
            b = states.setdefault(name, HostState(name))
            b.tail.extend(remote_tails.get(m.group(1), []))
            b.exit_code = _first_code(b.tail, _DS_RANK_EXIT) or -1
            b.lost_reason = b.lost_reason or f"the peer that {st.host}'s ranks lost first"
            b.ended_at = st.ended_at


def pdsh_split(line: str, addresses: dict[str, str]) -> tuple[str, str] | None:
    """pdsh prefixes each node's lines with `ADDRESS: `: (address, rest), or None."""
    addr, sep, rest = line.partition(": ")
    return (addr, rest) if sep and addr in addresses else None


def pdsh_failure(line: str, addresses: dict[str, str]) -> tuple[str, int] | None:
    """pdsh's report of a node whose command failed: (host, exit code), or None."""
    m = P.PDSH_EXIT.match(line)
    if not m or m.group(2) == "0":
        return None
    return addresses.get(m.group(1), m.group(1)), int(m.group(2))


def _address_of(host: str, addresses: dict[str, str] | None) -> str:
    return next((a for a, h in (addresses or {}).items() if h == host), host)


# torchrun's failure summary: "exitcode  : 1 (pid: 123)" for a rank that exited by itself,
# "exitcode  : -6 (pid: 123)  (SIGABRT)" for one killed by a signal (often a peer's failure).
_RANK_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def failure_code(st: HostState) -> int | None:
    """The host's job exit code, or when the job was stopped (fail-fast may stop the failing
    host too, when a peer's torchrun reported first) its rank's own code from torchrun's lines."""
    if st.exit_code is not None and st.exit_code > 0:
        return st.exit_code
    return _first_code(st.tail, _RANK_EXIT)


def rank_code(tail: Sequence[str]) -> int | None:
    """The first code > 0 a rank here exited with by itself, as its launcher said it: torchrun's
    summary, or DeepSpeed's launcher's "exits with return code = N"."""
    return _first_code(tail, _RANK_EXIT, _DS_RANK_EXIT)


def _first_code(tail: Sequence[str], *found: re.Pattern[str]) -> int | None:
    """The first exit code > 0 that one of the ``found`` patterns reads in ``tail``, in order."""
    codes = (int(c) for line in tail for rx in found for c in rx.findall(line))
    return next((c for c in codes if c > 0), None)


def own_failure(st: HostState) -> bool:
    """The launcher's lines (torchrun's, DeepSpeed's) say a rank here exited with a code of its
    own (> 0): it failed by itself, even when the supervisor's stop then reached this host."""
    return rank_code(st.tail) is not None


def root_cause(states: Sequence[HostState], named: str = "") -> HostState | None:
    """The failure that started it. A host whose ranks report a lost peer (gloo and NCCL abort
    the others within the same second) ranks after one that failed by itself; a rank that
    exited with a real code beats one that died of a signal; then the supervisor's choice
    (``named``: it classified each report as it came); then the earliest. A host the supervisor
    stopped is not a cause, unless the supervisor named it (its rank had failed by itself before
    the stop came, as the host's guard reported)."""
    failed = [s for s in states if s.exit_code not in (0, None) and (not s.stopped or s.host == named)]
    if not failed:
        return None

    def key(s: HostState) -> tuple[int, int, int, float]:
        victim = any(P.PEER_LOST.search(line) for line in s.tail)
        return (1 if victim else 0, 0 if own_failure(s) else 1, 0 if s.host == named else 1, s.ended_at)

    return min(failed, key=key)


# torchrun's own lines (its agent logs in glog form, its ChildFailedError traceback and summary),
# as opposed to what the ranks printed.
_AGENT_LINE = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
_RANK_LINE = re.compile(r"^\[rank\d+\]:")
# DeepSpeed's per-node launcher's own log lines ("[2026-11-25 05:59:46,165] [INFO] [launch.py:145:main] ...")
_DS_LAUNCHER_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\] \[(launch|real_accelerator)\.py:\d+:")


def failure_lines(tail: Sequence[str]) -> tuple[list[str], list[str]]:
    """A failed host's lines split in two: what its ranks printed (up to torchrun's first
    failure line, the last SHOWN_LINES of it, torchrun's own log lines and NCCL's INFO lines left
    out), and torchrun's failure report from there on (its summary, shown with -v)."""
    lines = list(tail)
    at = next((i for i, line in enumerate(lines) if P.AGENT_FAILED.search(line)), len(lines))
    # torchrun echoes the ranks' files with a delay: their `[rankN]:` lines may come after its own
    late = [line for line in lines[at:] if _RANK_LINE.match(line)]
    # NCCL_DEBUG=INFO chatter (its teardown lines included) would push the traceback out of view
    own = [
        line
        for line in lines[:at]
        if not _AGENT_LINE.match(line) and not _DS_LAUNCHER_LINE.match(line) and "NCCL INFO" not in line
    ] + [line for line in late if "NCCL INFO" not in line]
    return own[-SHOWN_LINES:], [line for line in lines[at:] if not _RANK_LINE.match(line)]


# torch.distributed's exception hook prefixes each line of a rank's traceback with `[rankN]: `;
# torchrun's tee adds its own `[rankN]:` before it.
_DOUBLE_PREFIX = re.compile(r"^(\[rank(\d+)\]:)\[rank\2\]:")
_PREFIXES = re.compile(r"^(?:\[rank\d+\]: ?)+")


def one_prefix(line: str) -> str:
    """A rank's line with one `[rankN]:` prefix where torchrun's and torch's own both stand."""
    m = _DOUBLE_PREFIX.match(line)
    return m.group(1) + line[m.end() :] if m else line


# Inside a traceback: the chaining lines between two exceptions, and c10d's own log lines
# (`[E1126 ...] ProcessGroupNCCL ...`) that a rank prints while it unwinds.
_CHAINED = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")
_IN_BLOCK = re.compile(
    r"^(Traceback \(most recent call last\):|During handling of the above exception|"
    r"The above exception was the direct cause|\[[EWIF]\d{4}|\^+\s*$|~+)"
)


@dataclass
class _Block:
    """A rank's traceback held by LiveFold: since when, its lines, its exceptions' lines, and
    whether the last line was an exception's (the chain may still go on)."""

    since: float
    lines: list[str]
    last: float = 0.0  # when its last line came
    errors: list[str] = field(default_factory=list)
    ended: bool = False


class LiveFold:
    """What an attached launch shows live while a run fails, so that the failure is not buried:

    - a rank's traceback is held until its last line: one that ends in a lost peer
      (``protocol.PEER_LOST``: the rank is a victim of another's failure) is folded, any other
      is shown whole;
    - torchrun's failure report (from its ``failed (exitcode: N)`` line on, its own lines) is
      folded: the verdict's summary counts it and shows it with -v;
    - once a host's torchrun was told to stop, or any host's job failed, the other hosts'
      lines are held; a held host whose own job then fails gets them shown at that moment.

    Every line stays in the logs and the tails; ``folded`` counts what was not shown."""

    BLOCK_WAIT = 3.0  # seconds a traceback is held without its last line before it is shown
    CHAIN_WAIT = 0.5  # seconds after an exception's line in which a chained one may follow

    def __init__(self) -> None:
        self.failed: list[str] = []  # hosts whose job failed, in the order it was seen
        self.held: dict[str, list[str]] = {}
        self.victims: dict[str, int] = {}  # host -> lines of tracebacks that end in a lost peer
        self.report: dict[str, int] = {}  # host -> lines of torchrun's failure report
        self.blocks: dict[tuple[str, str], _Block] = {}  # (host, rank prefix) -> its traceback so far

    def line(self, host: str, line: str, now: float) -> list[tuple[str, str]]:
        """The (host, line) pairs to show now for this line of ``host``'s log."""
        m = _RANK_LINE.match(line)
        if m is None:
            if host in self.report or P.AGENT_FAILED.search(line):
                self.report[host] = self.report.get(host, 0) + 1
                return []
            return self._show(host, line)
        key, text = (host, m.group(0)), _PREFIXES.sub("", line)
        block = self.blocks.get(key)
        if block is not None:
            if block.ended and not (text.strip() == "" or _CHAINED.match(text) or text.startswith("Traceback")):
                out = self._settle(key)  # the chain ended at its last exception: this line is not the block's
                return out + self.line(host, line, now)
            block.lines.append(line)
            block.last = now
            if text and not text[0].isspace() and not _IN_BLOCK.match(text):
                block.errors.append(text)  # an exception's line: the chain may go on ("During handling ...")
                block.ended = True
            elif text.startswith("Traceback"):
                block.ended = False
            return []
        if text.startswith("Traceback (most recent call last):"):
            self.blocks[key] = _Block(now, [line], now)
            return []
        return self._show(host, line)

    def job_failed(self, host: str) -> list[tuple[str, str]]:
        """``host``'s job failed on its own: its held lines are its failure's, shown now."""
        self.failed.append(host)
        return [(host, line) for line in self.held.pop(host, [])]

    def due(self, now: float) -> list[tuple[str, str]]:
        """Tracebacks settled by time: one that ended (no chained exception followed within
        CHAIN_WAIT), or one held BLOCK_WAIT without its last line (shown)."""
        out: list[tuple[str, str]] = []
        for key in [k for k, b in self.blocks.items()
                    if now - b.since >= self.BLOCK_WAIT or (b.ended and now - b.last >= self.CHAIN_WAIT)]:  # fmt: skip
            out += self._settle(key)
        return out

    def flush(self) -> list[tuple[str, str]]:
        return self.due(float("inf"))

    def folded(self, root: str = "") -> dict[str, int]:
        """Lines not shown, by host: held, victims' tracebacks, and torchrun's failure report of
        every host but ``root`` (whose report the verdict counts itself)."""
        out: dict[str, int] = {}
        open_blocks: dict[str, int] = {}  # not settled (the follow was interrupted): not shown either
        for (h, _), b in self.blocks.items():
            open_blocks[h] = open_blocks.get(h, 0) + len(b.lines)
        for counts in ({h: len(v) for h, v in self.held.items()}, self.victims, open_blocks,
                       {h: n for h, n in self.report.items() if h != root}):  # fmt: skip
            for h, n in counts.items():
                if n:
                    out[h] = out.get(h, 0) + n
        return out

    def _settle(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        """A traceback (with its chained ones) is a victim's when every exception in it is a lost
        peer's; any other is shown whole, as is one that never got its last line."""
        b = self.blocks.pop(key)
        if b.ended and b.errors and all(P.PEER_LOST.search(e) for e in b.errors):
            self.victims[key[0]] = self.victims.get(key[0], 0) + len(b.lines)
            return []
        return [pair for line in b.lines for pair in self._show(key[0], line)]

    def _show(self, host: str, line: str) -> list[tuple[str, str]]:
        if host not in self.failed and (host in self.held or self.failed or TEARDOWN_LINE.search(line)):
            self.held.setdefault(host, []).append(line)
            return []
        return [(host, line)]
