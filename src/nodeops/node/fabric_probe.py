"""The fabric measurement: shipped into a run's dir by `nodeops check --fabric` and started on
every node by the normal launch machinery (torchrun, the spec's env file, Python env and
interface settings). Needs only torch and the standard library; torch is imported inside
main(), so the planning functions below are importable (and unit-tested) without it.

Every rank takes part in:

1. an all-reduce over all ranks for a sweep of message sizes (each size repeated for the time
   the budget gives it; a size whose first run would overrun it is skipped and said so);
2. rounds of node pairs (all ranks of two nodes in a group of their own): a ring of N nodes
   needs N pairs, one at a time (``--sequential``, up to 8 nodes) or in 2 or 3 rounds of
   disjoint pairs that run at the same time.
   The pairs' message size is what fits their share of the budget at the rate the sweep saw;
3. suspects (a best pair below ``spread`` times the best node's) measured again, each against a
   different node that was not a suspect, concurrently as far as the healthy nodes allow.

Timings are the slowest rank's (a MAX all-reduce of each rank's own time; nccl-tests averages
over ranks by default, which hides one slow rank). Decisions that must agree on every rank
(sizes skipped, repetitions, the pair size) are made from those MAX-reduced values, so every
rank takes the same path. Rank 0 prints one line, ``NODEOPS_FABRIC {json}``, which the
controller reads from the run's log; the verdict is made there (nodeops.node.fabric).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

MARKER = "NODEOPS_FABRIC"
CPU_SIZES = [8 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
GPU_SIZES = [8 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
CPU_PAIR_BYTES = 4 << 20
GPU_PAIR_BYTES = 256 << 20
MAX_ITERS = 20
ENV_SHOWN = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET")


MIN_PAIR_BYTES = 64 << 10


def say(text: str) -> None:
    print(f"fabric: {text}", flush=True)


def pair_size(sweep: list[dict[str, Any]], share: float, cap: int) -> int:
    """The pairs' message size: the largest power of two up to ``cap`` whose two runs (the first
    and one timed) fit in ``share`` seconds at the all-nodes rate of the sweep's largest size (a
    pair moves less per rank than the all-nodes all-reduce, so this errs on the short side)."""
    if not sweep:
        return MIN_PAIR_BYTES
    last = sweep[-1]
    per_byte = last["seconds"] / last["bytes"]
    size = cap
    while size > MIN_PAIR_BYTES and 2 * size * per_byte > share:
        size //= 2
    return size


def bus_factor(ranks: int) -> float:
    """nccl-tests' all-reduce factor 2(n-1)/n: each rank sends and receives that many buffers."""
    return 2 * (ranks - 1) / ranks if ranks > 0 else 0.0


def human_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def node_best(pairs: list[dict[str, Any]], nbytes: int) -> dict[int, float]:
    """Each node's best pair (node index -> bus bandwidth in bytes/s): a node's score, here for
    picking suspects and in nodeops.node.fabric for the verdict."""
    best: dict[int, float] = {}
    for pr in pairs:
        bw = nbytes / pr["seconds"] * bus_factor(pr["ranks"])
        for x in pr["pair"]:
            best[x] = max(best.get(x, 0.0), bw)
    return best


def format_rounds(rounds: list[list[tuple[int, int]]]) -> str:
    """Rounds of node pairs as text (``--rounds`` and the suspects' broadcast): ``0-1,2-3;1-2``."""
    return ";".join(",".join(f"{a}-{b}" for a, b in r) for r in rounds)


def parse_rounds(text: str) -> list[list[tuple[int, int]]]:
    return [[(int(a), int(b)) for a, b in (p.split("-") for p in r.split(",") if p)] for r in text.split(";") if r]


def confirm_rounds(best: dict[int, float], spread: float, sequential: bool = False) -> list[list[tuple[int, int]]]:
    """Suspects (best pair below ``spread`` times the best node's; generous on purpose: being a
    suspect costs one more measurement, not a verdict) paired with the non-suspects, fastest
    first, one suspect per healthy node per round, so a round's pairs are disjoint and run at
    once, as the ring's did; with ``sequential``, one pair per round, as the ring's were. With no
    non-suspect there is nothing to compare with: no rounds."""
    if len(best) < 3:
        return []
    top = max(best.values())
    suspects = [x for x in sorted(best) if best[x] < spread * top]
    healthy = sorted((x for x in best if x not in suspects), key=lambda x: (-best[x], x))
    if not suspects or not healthy:
        return []
    rounds = [list(zip(suspects[i : i + len(healthy)], healthy, strict=False))
              for i in range(0, len(suspects), len(healthy))]  # fmt: skip
    return [[p] for r in rounds for p in r] if sequential else rounds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=40.0, help="the whole measurement's budget")
    nodes = ap.add_mutually_exclusive_group(required=True)
    nodes.add_argument("--nodes", help="the spec's node names, comma-separated, in node-rank order")
    nodes.add_argument("--count", type=int, help="how many nodes, named as the scheduler names them (Slurm)")
    ap.add_argument("--rounds", default="", help="pair rounds: 'a-b,c-d;b-c,d-a' (node indexes)")
    ap.add_argument("--spread", type=float, default=0.7, help="below this share of the best node: a suspect")
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True, help="chosen from the spec, for every rank")
    ap.add_argument("--sequential", action="store_true", help="measure suspects' pairs one at a time too")
    ap.add_argument("--out", default="", help="rank 0 also writes its document here (a Slurm job's gate reads it)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    # ssh: job.sh's NODE_RANK, the spec's node rank whatever the rendezvous. Slurm: the node's
    # index in the allocation, and its name is Slurm's (the nodes are known once the job runs).
    node = int(os.environ["SLURM_NODEID"] if args.count else os.environ["NODE_RANK"])
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    names = args.nodes.split(",") if args.nodes else [host if i == node else f"node{i}" for i in range(args.count)]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = args.backend
    gpu = backend == "nccl"
    if gpu:
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if seen <= local_rank:  # before any collective: launch stops every rank and names this one
            print(f"fabric: error: {names[node]}: local rank {local_rank} needs a GPU for NCCL, torch sees "
                  f"{seen}; the spec's gpus/nproc_per_node promise more than the node has", file=sys.stderr,
                  flush=True)  # fmt: skip
            return 3
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    # A hung collective (a dead link) ends the run instead of holding it: the budget plus a margin.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.seconds + 60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.monotonic()

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def slowest(value: float, group: object = None) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def timed(
        nbytes: int, share: float, group: object = None, prev: tuple[int, float] | None = None
    ) -> dict[str, Any] | None:
        """Seconds per all-reduce of ``nbytes`` in ``group`` (the slowest rank's), repeated for up
        to ``share`` seconds; None when the first run alone would overrun it (from ``prev``,
        the last size's (bytes, seconds), scaled by size)."""
        if prev is not None and prev[1] * nbytes / prev[0] > share:
            return None
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        slowest(0.0, group)  # line the group up
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        first = slowest(time.perf_counter() - t0, group)
        iters = max(1, min(MAX_ITERS, int(share / max(first, 1e-6)) - 1))
        slowest(0.0, group)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        sync()
        per = slowest((time.perf_counter() - t0) / iters, group)
        return {"bytes": x.numel() * 4, "seconds": per, "iters": iters}

    # Plain tensor collectives only: the *_object ones need numpy, which a job's env may lack.
    def gather_rows(values: list[float], width: int) -> list[list[float]]:
        t = torch.tensor(values + [0.0] * (width - len(values)), dtype=torch.float64, device=device)
        out = [torch.zeros(width, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(out, t)
        return [[float(v) for v in o.tolist()] for o in out]

    def gather_text(text: str, width: int = 512) -> list[str]:
        data = list(text.encode()[:width])
        rows = gather_rows([float(b) for b in data] + [-1.0], width + 1)
        return [bytes(int(v) for v in row[: row.index(-1.0)]).decode(errors="replace") for row in rows]

    # Which ranks live on which node (the rendezvous may order nodes differently from the spec).
    env = {k: os.environ[k] for k in ENV_SHOWN if k in os.environ}
    where = gather_text(json.dumps({"node": node, "host": host, "env": env}))
    ranks_of: dict[int, list[int]] = {}
    env_of: dict[int, dict[str, str]] = {}
    for r, text in enumerate(where):
        w = json.loads(text)
        ranks_of.setdefault(int(w["node"]), []).append(r)
        env_of.setdefault(int(w["node"]), w["env"])
        if not args.nodes and 0 <= int(w["node"]) < len(names):
            names[int(w["node"])] = w["host"]  # the names every rank now agrees on
    if rank == 0:
        say(f"{backend} on {world} rank(s) over {len(ranks_of)} node(s); budget {args.seconds:.0f}s")

    rounds = parse_rounds(args.rounds)
    sizes = GPU_SIZES if gpu else CPU_SIZES
    sweep_share = args.seconds * (0.35 if rounds else 0.9) / len(sizes)
    sweep: list[dict[str, Any]] = []
    skipped: list[int] = []
    prev: tuple[int, float] | None = None
    for nbytes in sizes:
        got = timed(nbytes, sweep_share, None, prev)
        if got is None:
            skipped.append(nbytes)
            continue
        sweep.append(got)
        prev = (got["bytes"], got["seconds"])
        if rank == 0:
            say(f"all-reduce {human_bytes(nbytes)}: {got['seconds'] * 1e3:.2f} ms x{got['iters']}")

    pairs: list[dict[str, Any]] = []
    ring_share = args.seconds * 0.4 / max(1, len(rounds))
    pair_bytes = pair_size(sweep, ring_share, GPU_PAIR_BYTES if gpu else CPU_PAIR_BYTES)
    if rounds and rank == 0:
        pairs_n = sum(len(r) for r in rounds)
        say(f"node pairs: {human_bytes(pair_bytes)} all-reduces, {pairs_n} pair(s) in {len(rounds)} round(s)")

    def pair_round(rnd: list[tuple[int, int]], share: float, confirm: bool = False) -> None:
        mine = None
        for a, b in rnd:
            # Every rank creates every group (new_group is collective over the world).
            g = dist.new_group(ranks_of.get(a, []) + ranks_of.get(b, []))
            if node in (a, b):
                mine = (a, b, g)
        row = [-1.0, -1.0, 0.0, 0.0, 0.0]  # a, b, ranks, seconds, iters (a = -1: in no pair this round)
        if mine is not None:
            a, b, g = mine
            n = len(ranks_of.get(a, [])) + len(ranks_of.get(b, []))
            got = timed(pair_bytes, share, g)
            assert got is not None  # without prev, timed always measures
            row = [float(a), float(b), float(n), got["seconds"], float(got["iters"])]
        gathered = gather_rows(row, len(row))
        if rank == 0:
            done = {(int(r[0]), int(r[1])): r for r in gathered if r[0] >= 0}
            for (a, b), r in done.items():
                pairs.append({"pair": [a, b], "ranks": int(r[2]), "seconds": r[3], "iters": int(r[4]),
                              "confirm": confirm})  # fmt: skip
                again = " (again)" if confirm else ""
                say(f"pair {names[a]}-{names[b]}{again}: {r[3] * 1e3:.1f} ms")

    for rnd in rounds:
        pair_round(rnd, ring_share)

    # Suspects are measured again against healthy nodes: a healthy node between two slow
    # neighbours is cleared by it. Rank 0 decides (it holds every pair) and tells the others.
    plan: list[list[tuple[int, int]]] = []
    if rank == 0:
        plan = confirm_rounds(node_best(pairs, pair_bytes), args.spread, args.sequential)
    plan = parse_rounds(gather_text(format_rounds(plan), width=16 * len(names) + 64)[0])  # rank 0's
    for rnd in plan:
        pair_round(rnd, args.seconds * 0.15 / len(plan), confirm=True)

    if rank == 0:
        doc = {
            "backend": backend, "world": world, "nodes": names,
            "ranks_per_node": {names[k]: len(v) for k, v in sorted(ranks_of.items())},
            "sweep": sweep, "skipped": skipped, "pairs": pairs,
            "pair_bytes": pair_bytes if rounds else 0,
            "env": {names[k]: v for k, v in sorted(env_of.items())},
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "elapsed": time.monotonic() - t_start,
        }  # fmt: skip
        print(f"{MARKER} {json.dumps(doc, separators=(',', ':'))}", flush=True)
        if args.out:
            with open(args.out + ".tmp", "w") as fh:
                json.dump(doc, fh)
            os.replace(args.out + ".tmp", args.out)
    slowest(0.0)  # nobody leaves while rank 0 still prints
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
