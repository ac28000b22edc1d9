"""`nodeops check --fabric`: measure the links between the nodes and name the slow one.

The measurement (``fabric_probe.py``) runs as an ordinary run through the launch machinery:
torchrun on every node, with the spec's env file, Python env and interface settings, NCCL on
GPUs and gloo without. This module holds what the controller does with it: the pair schedule
sent to the probe, the bandwidth arithmetic (nccl-tests' definitions), the verdicts against the
spec's ``network.fabric`` thresholds, the interface NCCL reports, and the report.

Bandwidths are in Gbit/s (what NICs are sold in). For an all-reduce of ``S`` bytes taking
``t`` seconds over ``n`` ranks: algbw = S / t, busbw = algbw * 2(n-1)/n, as nccl-tests
defines them (busbw is comparable with the link's speed whatever ``n``).

Finding the slow node: each node is paired with its ring neighbours (N pairs for N nodes; one
at a time up to 8 nodes, beyond in 2 or 3 rounds of disjoint pairs that run at the same time,
see :func:`pair_rounds`). A slow node makes both of its pairs
slow, a healthy neighbour only one, so a node's score is its *best* pair. A node whose score is
below ``max_pair_spread`` times the best node's is a suspect, and the probe measures each
suspect again against a node that is not one (fabric_probe.confirm_rounds), so that a healthy
node between two slow ones is cleared. The verdict then compares each node's best pair, all
measurements included, with the reference: the upper quartile of the node scores (see
:func:`reference`). Scores are per node, not per pair: with 3 nodes one slow node makes two of
the three pairs slow, and the median pair would be a slow one. When every ring pair holds a
slow node (two slow nodes of three, every other node slow), no pair shows what a healthy link
reaches, and only ``min_busbw_gbps`` can fail the fabric.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nodeops.errors import NodeopsError
from nodeops.node.fabric_probe import MARKER, bus_factor, format_rounds, human_bytes, node_best

PROGRESS = "fabric: "  # the probe's own lines start so (after torchrun's [rankN]: prefix)
DEFAULT_SPREAD = 0.7
GATE_SECONDS = 30  # launch --fabric-check's measurement budget


class FabricError(NodeopsError):
    """The fabric measurement did not produce a result (the run failed, or said nothing)."""


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in Gbit/s: the bytes of the buffer over the time of one all-reduce."""
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def busbw_gbps(nbytes: float, seconds: float, ranks: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(ranks)


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Each node with its ring neighbour: N pairs for N >= 3, one for 2, none for 1."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def schedule(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Rounds of pairs that share no node (so a round's pairs run at once without sharing a
    NIC): greedy, in order; a ring takes 2 rounds (even N) or 3 (odd N)."""
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set[int]] = []
    for a, b in pairs:
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[i].append((a, b))
                used.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


# NCCL's INFO lines about the network (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), e.g.
#   host:123:456 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.4.2.31<0>
#   host:123:456 [0] NCCL INFO NET/Socket : Using [0]eth0:10.140.0.7<0>
#   host:123:456 [0] NCCL INFO Using network Socket
_NET_USING = re.compile(r"NCCL INFO NET/(\w+)\s*:\s*Using (.*)$")
_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_DEVICE = re.compile(r"\[\d+\]([^\s\[\]]+)")


def parse_nccl_net(lines: Iterable[str]) -> str | None:
    """What NCCL says it uses for the network on one node, from its INFO lines: the transport
    NCCL chose ("Using network X"), and the devices of that transport's "NET/... : Using" line
    (address parts dropped), with IB's out-of-band interface. None when NCCL said nothing."""
    using: dict[str, str] = {}
    network = None
    for line in lines:
        m = _NET_USING.search(line)
        if m:
            kind, rest = m.group(1), m.group(2)
            main, _, oob = rest.partition("; OOB ")
            devices = [d.split(":")[0] if kind == "Socket" else d.split("<")[0] for d in _DEVICE.findall(main)]
            text = ", ".join(devices) or "no device"
            if oob.strip():
                text += f" (OOB {oob.strip().split(':')[0]})"
            using[kind] = text
            continue
        m = _NETWORK.search(line)
        if m:
            network = m.group(1)
    if network is None and not using:
        return None
    kind = "IB" if network is not None and network.startswith("IB") else network
    if kind in using:
        return f"{network}: {using[kind]}"
    if network is not None:
        return network if len(using) != 1 else f"{network}: {next(iter(using.values()))}"
    return "; ".join(f"{k}: {v}" for k, v in using.items())


def reference(scores: Sequence[float]) -> float | None:
    """What a healthy node reaches: the upper quartile of the node scores. A slow node drags its
    two ring neighbours' pairs down too, so up to half of the scores can look slow (two slow
    nodes of five make three); the upper quartile stays on a healthy one where the median would
    not. (The probe picks suspects more generously, against the best node: a suspect only costs
    one more measurement.)"""
    if not scores:
        return None
    if len(scores) == 1:
        return float(scores[0])
    return float(statistics.quantiles(scores, n=4, method="inclusive")[2])


@dataclass
class SweepRow:
    bytes: int
    seconds: float
    iters: int
    algbw: float  # Gbit/s
    busbw: float  # Gbit/s


@dataclass
class PairRow:
    a: str
    b: str
    ranks: int
    seconds: float
    busbw: float  # Gbit/s
    confirm: bool = False  # a suspect measured again against a healthy node
    verdict: str = "ok"


@dataclass
class NodeRow:
    name: str
    best: float | None  # Gbit/s: the node's best pair (None: no pair, one node)
    interface: str
    verdict: str = "ok"
    why: str = ""


@dataclass
class FabricReport:
    backend: str
    world: int
    sweep: list[SweepRow]
    skipped: list[int]
    pairs: list[PairRow]
    nodes: list[NodeRow]  # slowest first
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    spread: float = DEFAULT_SPREAD
    min_busbw: float | None = None
    run_id: str = ""  # the measurement's run (`nodeops logs RUN`)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def latency(self) -> SweepRow | None:
        """The smallest all-reduce, when it is small enough (<= 64 KiB) to stand for latency."""
        small = [r for r in self.sweep if r.bytes <= 64 << 10]
        return min(small, key=lambda r: r.bytes) if small else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = "ok" if self.ok else "fail"
        lat = self.latency
        out["latency_us"] = None if lat is None else round(lat.seconds * 1e6, 1)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FabricReport:
        """The report :meth:`to_json` wrote (a Slurm job's gate writes it in the run dir)."""
        rows = {"sweep": SweepRow, "pairs": PairRow, "nodes": NodeRow}
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, **{k: [row(**r) for r in d.get(k, [])] for k, row in rows.items()}})


def evaluate(
    doc: Mapping[str, Any],
    *,
    spread: float = DEFAULT_SPREAD,
    min_busbw: float | None = None,
    interfaces: Mapping[str, str] | None = None,
) -> FabricReport:
    """Verdicts from the probe's document (see fabric_probe.py) and the thresholds."""
    names: list[str] = list(doc["nodes"])
    world = int(doc["world"])
    sweep = [SweepRow(int(r["bytes"]), float(r["seconds"]), int(r["iters"]), algbw_gbps(r["bytes"], r["seconds"]),
                      busbw_gbps(r["bytes"], r["seconds"], world)) for r in doc.get("sweep", [])]  # fmt: skip
    pair_bytes = int(doc.get("pair_bytes") or 0)
    measured = [p for p in doc.get("pairs", []) if "seconds" in p]
    pairs = [PairRow(names[p["pair"][0]], names[p["pair"][1]], int(p["ranks"]), float(p["seconds"]),
                     busbw_gbps(pair_bytes, p["seconds"], int(p["ranks"])), bool(p.get("confirm")))
             for p in measured]  # fmt: skip
    env = doc.get("env") or {}
    backend = str(doc.get("backend", "?"))

    def iface(name: str) -> str:
        said = (interfaces or {}).get(name)
        if said:
            return said
        e = env.get(name) or {}
        var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        return f"{e[var]} ({var})" if var in e else "not set (the default route's)"

    best = {names[i]: bw * 8 / 1e9 for i, bw in node_best(measured, pair_bytes).items()}  # Gbit/s
    nodes = [NodeRow(n, best.get(n), iface(n)) for n in names]
    problems: list[str] = []
    notes: list[str] = []
    if doc.get("skipped"):
        notes.append("all-reduce sizes skipped to keep to the time budget: "
                     + ", ".join(human_bytes(b) for b in doc["skipped"]))  # fmt: skip
    ref = reference([n.best for n in nodes if n.best is not None])
    if len(names) >= 3 and ref:
        for n in nodes:
            if n.best is not None and n.best < spread * ref:
                n.verdict = "slow"
                n.why = (f"its best pair reaches {n.best:.3g} Gbit/s, {share(n.best / ref)} of the reference "
                         f"{ref:.3g} (the nodes' upper quartile; below network.fabric.max_pair_spread "
                         f"{spread:g})")  # fmt: skip
        for p in pairs:
            if p.busbw < spread * ref:
                p.verdict = "slow"
    elif len(names) == 2:
        notes.append("2 nodes: one pair, so a slow node cannot be told from its partner; "
                     "network.fabric.min_busbw_gbps sets a floor")  # fmt: skip
    if min_busbw is not None:
        for n in nodes:
            if n.best is not None and n.best < min_busbw:
                n.verdict = "slow"
                n.why = (n.why + "; " if n.why else "") + (
                    f"its best pair reaches {n.best:.3g} Gbit/s, below network.fabric.min_busbw_gbps {min_busbw:g}"
                )
        for p in pairs:
            if p.busbw < min_busbw:
                p.verdict = "slow"
        if sweep and world > 1 and sweep[-1].busbw < min_busbw:  # one rank moves nothing over a link
            last = sweep[-1]
            problems.append(f"all nodes: all-reduce of {human_bytes(last.bytes)} reaches {last.busbw:.3g} Gbit/s "
                            f"bus bandwidth, below network.fabric.min_busbw_gbps {min_busbw:g}")  # fmt: skip
    nodes.sort(key=lambda n: (n.verdict == "ok", n.best if n.best is not None else float("inf"), n.name))
    pairs.sort(key=lambda p: (p.verdict == "ok", p.busbw))
    problems[:0] = [f"{n.name}: slow: {n.why}" for n in nodes if n.verdict != "ok"]
    return FabricReport(backend, world, sweep, [int(b) for b in doc.get("skipped", [])], pairs, nodes, problems,
                        notes, float(doc.get("elapsed", 0.0)), spread, min_busbw)  # fmt: skip


def share(ratio: float) -> str:
    """A ratio as a percentage that does not round a slow node down to 0%."""
    return f"{ratio:.0%}" if ratio >= 0.1 else f"{ratio:.1%}" if ratio >= 0.001 else "<0.1%"


class Collector:
    """Wraps a log-line printer for the fabric run: keeps the probe's result line and each
    host's NCCL network lines, prints the probe's own progress lines, and hides the rest (NCCL's
    INFO chatter, torch's warnings) unless ``verbose``. A failing run is still explained: launch
    names the first failing host with its last lines, whatever was printed."""

    def __init__(self, emit: Any, verbose: bool = False) -> None:
        self.emit, self.verbose = emit, verbose
        self.doc: dict[str, Any] | None = None
        self.nccl: dict[str, list[str]] = {}

    def __call__(self, host: str, line: str) -> None:
        at = line.find(MARKER + " ")
        if at >= 0:
            try:
                self.doc = json.loads(line[at + len(MARKER) + 1 :])
            except json.JSONDecodeError:
                self.emit(host, line)
            return
        if "NCCL INFO" in line:
            self.nccl.setdefault(host, []).append(line)
        if self.verbose or PROGRESS in line:
            self.emit(host, line)

    def interfaces(self) -> dict[str, str]:
        out = {}
        for host, lines in self.nccl.items():
            said = parse_nccl_net(lines)
            if said:
                out[host] = said
        return out


def backend(gpus_per_node: Sequence[int]) -> str:
    """NCCL when every node has GPUs in the (resolved) spec, else gloo for every rank: NCCL
    cannot run on a CPU-only rank, and one backend per run is what a job gets too."""
    return "nccl" if gpus_per_node and all(g > 0 for g in gpus_per_node) else "gloo"


# Up to this many nodes, pairs are measured one at a time: no pair shares the fabric (or, on the
# sandbox, the CPU) with another, so pairs that ran alone and pairs that ran together are never
# compared (on an oversubscribed fabric a lone pair is faster, and a healthy node measured
# together with others could be named). Beyond, disjoint pairs run at once to keep to the time.
SEQUENTIAL_MAX_NODES = 8


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The ring's pairs in the order the probe runs them: one per round up to
    SEQUENTIAL_MAX_NODES nodes, else in rounds of disjoint pairs (:func:`schedule`)."""
    pairs = ring_pairs(n)
    return [[p] for p in pairs] if n <= SEQUENTIAL_MAX_NODES else schedule(pairs)


def probe_args(names: Sequence[str] | int, seconds: float, spread: float, backend: str) -> list[str]:
    """The probe's arguments: ``names``, the nodes in node-rank order, or how many there are
    when the scheduler names them once the job runs (Slurm)."""
    n = names if isinstance(names, int) else len(names)
    rounds = pair_rounds(n)
    argv = ["--seconds", f"{seconds:g}", "--spread", f"{spread:g}", "--backend", backend,
            *(["--count", str(names)] if isinstance(names, int) else ["--nodes", ",".join(names)])]  # fmt: skip
    if n <= SEQUENTIAL_MAX_NODES:
        argv.append("--sequential")
    return argv + (["--rounds", format_rounds(rounds)] if rounds else [])


GATE_LOG_TAIL = 4 << 20  # bytes of each node log the gate reads for NCCL's lines (the fabric step wrote last)


def gate_main(argv: Sequence[str]) -> int:
    """``python3 -m nodeops.node.fabric CONFIG DOC REPORT LOG...``: `launch --fabric-check` judged on a
    Slurm job's batch node, before its training step (this module, ``errors`` and
    ``fabric_probe`` shipped as a package of their own into the run dir; stdlib only, Python
    3.8+). CONFIG holds the thresholds, DOC is the probe's document (``--out``, written on
    another node: waited for, a shared filesystem's cache may not show it yet), the end of each
    node log gives NCCL's network lines; the report goes to REPORT, its verdict to stdout (the
    batch log). 0: the fabric passed, 1: it did not, 2: there was no measurement to judge,
    3: the gate itself broke (never taken for a verdict on the fabric)."""
    try:
        return _gate(argv)
    except Exception as e:
        print(f"nodeops: fabric: the gate failed: {type(e).__name__}: {e}", flush=True)
        return 3


def _gate(argv: Sequence[str]) -> int:
    with open(argv[0]) as fh:
        cfg = json.load(fh)
    doc = None
    deadline = time.monotonic() + 10
    while doc is None:
        try:
            with open(argv[1]) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                print("nodeops: fabric: the measurement gave no result (its lines are in the node logs)", flush=True)
                return 2
            time.sleep(0.5)
    nccl: dict[str, list[str]] = {}
    for log in argv[3:]:
        try:
            with open(log, "rb") as fb:
                fb.seek(max(0, os.fstat(fb.fileno()).st_size - GATE_LOG_TAIL))
                text = fb.read().decode(errors="replace")
        except OSError:
            continue
        host = os.path.basename(log)[: -len(".log")]  # logs/NODE.log (no str.removesuffix: Python 3.8)
        nccl[host] = [line for line in text.splitlines() if "NCCL INFO" in line]
    interfaces = {host: said for host, lines in nccl.items() if (said := parse_nccl_net(lines))}
    report = evaluate(doc, spread=float(cfg["spread"]), min_busbw=cfg.get("min_busbw"), interfaces=interfaces)
    with open(argv[2] + ".tmp", "w") as fh:
        json.dump(report.to_json(), fh)
    os.replace(argv[2] + ".tmp", argv[2])
    for note in report.notes:
        print(f"nodeops: fabric: note: {note}")
    for problem in report.problems:
        print(f"nodeops: fabric: {problem}")
    slowest = report.nodes[0] if report.nodes else None
    pairs = f"; slowest node {slowest.name}, best pair {slowest.best:.3g} Gbit/s" if slowest and slowest.best else ""
    print(f"nodeops: fabric: {'ok' if report.ok else 'fail'} ({report.world} rank(s), {report.backend}, "
          f"measured in {report.elapsed:.1f}s{pairs})", flush=True)  # fmt: skip
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(gate_main(sys.argv[1:]))
