#!/usr/bin/env python3
"""Benchmark: how fast a Slurm launch shows its first log line, and how fast `stop` clears a job.

On a 3-node Slurm sandbox (`nodeops sandbox up --slurm`, started here unless it is up), set up
once with torch from a wheelhouse, each of R rounds measures:

- floor: `srun --nodes=3 --ntasks-per-node=1 hostname` on the login node, over the same ssh: the
  scheduler's own floor for starting a step on every node and seeing it end;
- by hand (the fair baseline, issue 28): what a Slurm user writes today, a batch script of
  `#SBATCH` lines, the venv's activation, MASTER_ADDR from the first node and
  `srun torchrun --rdzv-backend=c10d ...` of the same DDP example with the same resources.
  Timed from the ssh that submits it (`sbatch`) until the first rank line is in its output file,
  watched on the login node every 0.1 s within that same ssh;
- submit -> first rank line: `nodeops launch --attach` of the DDP example, from the command's
  start to a rank's first line (`nodeX [rankN]:rank N/W on ...`, printed after the
  rendezvous), which includes sbatch, the scheduler, the preflight step (the node probe of
  `nodeops check` and its rules), srun,
  torchrun's start, the rendezvous and Python importing torch; the same with `--no-check`.
  Goal: nodeops (preflight included) within 1.2x of the hand-written job;
- stop: on a running job, `nodeops stop` until it returns, and until no process of the job
  (ranks, torchrun, srun, slurmstepd) is left on any node (polled with `docker exec ps`).

Medians are printed, with ratios against the baseline measured in the same run.

    python bench/slurm_bench.py [--rounds 3] [--torch-wheelhouse DIR] [--keep]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "slurmbench"
SUBNET = "10.221.0.0/24"
NODEOPS = [sys.executable, "-m", "nodeops"]
# the first line of the DDP example, after its rendezvous: the event the hand-written job waits for too
RANK_LINE = re.compile(r"^node\d \[rank\d+\]:rank \d+/\d+ on ")
LEFT = re.compile(r"torch\.distributed\.run|ddp_train|srun |slurmstepd")


def run(*args: str, timeout: float = 600, input_: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False, input=input_)


def leftovers(sb: sandbox.Sandbox) -> int:
    n = 0
    for node in sb.nodes:
        ps = sandbox.docker("exec", node.container, "ps", "-eo", "args", check=False)
        n += sum(1 for line in ps.splitlines() if LEFT.search(line))
    return n


# What a Slurm user writes by hand for the same job: the same shape as the spec (3 nodes, 4 GPUs,
# the sandbox's partition), the same venv and workdir, torchrun's c10d rendezvous on node 1.
BY_HAND = """#!/bin/bash
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --partition=main
#SBATCH --gpus=4
#SBATCH --time=00:30:00
source ~/.venvs/bench/bin/activate
cd /home/debian/bench
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node "$head" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
srun bash -c 'exec torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
  ddp_train.py --steps 3'
"""

# On the login node: submit, then watch the output file for a rank's first line (0.1 s steps).
SUBMIT_AND_WATCH = """set -eu
cd /home/debian/bench
rm -f hand.out
jid=$(sbatch --parsable --output=hand.out hand.sbatch)
until grep -qE 'rank [0-9]+/[0-9]+ on ' hand.out 2>/dev/null; do sleep 0.1; done
echo "first $jid"
while squeue -h -j "$jid" | grep -q .; do sleep 0.5; done
grep -c 'final param hash' hand.out
"""


def by_hand(sb: sandbox.Sandbox) -> float:
    """The hand-written sbatch + srun torchrun job: submission to its first rank line."""
    put = run("ssh", "-F", str(sb.ssh_config), "node1", "cat > /home/debian/bench/hand.sbatch", input_=BY_HAND)
    if put.returncode != 0:
        raise SystemExit(f"cannot write hand.sbatch: {put.stderr}")
    t0 = time.monotonic()
    p = subprocess.Popen(["ssh", "-F", str(sb.ssh_config), "node1", "bash", "-s"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(SUBMIT_AND_WATCH)
    p.stdin.close()
    first = None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if first is None and line.startswith("first "):
            first = time.monotonic() - t0
    err = p.stderr.read() if p.stderr else ""
    if p.wait() != 0 or first is None or lines[-1].strip() != "4":
        raise SystemExit(f"the hand-written job failed: {''.join(lines)} {err}")
    return first


def first_rank_line(spec: Path, *extra: str) -> float:
    t0 = time.monotonic()
    p = subprocess.Popen([*NODEOPS, "launch", str(spec), "--attach", *extra, "--", "ddp_train.py", "--steps", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert p.stdout is not None
    first = None
    for line in p.stdout:
        if first is None and RANK_LINE.match(line):
            first = time.monotonic() - t0
    if p.wait() != 0 or first is None:
        raise SystemExit(f"the DDP launch failed (exit {p.returncode})")
    return first


def stop_latency(sb: sandbox.Sandbox, spec: Path) -> tuple[float, float]:
    p = run(*NODEOPS, "launch", "--detach", str(spec), "--", "ddp_train.py", "--steps", "100000", "--sleep", "0.1")
    run_id = p.stdout.strip()
    deadline = time.monotonic() + 120
    while "step 2 " not in run(*NODEOPS, "logs", run_id).stdout:
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} did not start: {p.stderr}")
        time.sleep(0.5)
    t0 = time.monotonic()
    s = run(*NODEOPS, "stop", run_id)
    returned = time.monotonic() - t0
    if s.returncode != 0:
        raise SystemExit(f"stop failed: {s.stderr}")
    while leftovers(sb):
        if time.monotonic() - t0 > 120:
            raise SystemExit("processes of the job were still there 120 s after stop")
        time.sleep(0.2)
    return returned, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-wheelhouse", default=str(ROOT / ".cache" / "wheelhouse-torch"))
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up afterwards")
    args = ap.parse_args()
    sb = sandbox.up(name=NAME, n=3, subnet=SUBNET, slurm=True, say=lambda m: print(f"# {m}", file=sys.stderr))
    try:
        with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
            d = Path(tmp)
            (d / "ddp_train.py").write_text((ROOT / "examples" / "ddp_train.py").read_text())
            spec = d / "cluster.yaml"
            spec.write_text(sb.spec_path.read_text() + (
                "python:\n  venv: ~/.venvs/bench\n  packages: ['torch==2.13.0']\n"
                f"  wheelhouse: {args.torch_wheelhouse}\n"
                "workdir:\n  path: /home/debian/bench\nnetwork:\n  ib: 'off'\n"
            ))  # fmt: skip
            p = run(*NODEOPS, "setup", str(spec), timeout=1200)
            if p.returncode != 0:
                raise SystemExit(f"setup failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            base, hand, first, nocheck, stop_ret, stop_clear = [], [], [], [], [], []
            for i in range(args.rounds):
                t0 = time.monotonic()
                b = run("ssh", "-F", str(sb.ssh_config), "node1", "srun --nodes=3 --ntasks-per-node=1 hostname")
                if b.returncode != 0 or sorted(b.stdout.split()) != ["node1", "node2", "node3"]:
                    raise SystemExit(f"srun failed: {b.stdout} {b.stderr}")
                base.append(time.monotonic() - t0)
                hand.append(by_hand(sb))
                first.append(first_rank_line(spec))
                nocheck.append(first_rank_line(spec, "--no-check"))
                r, c = stop_latency(sb, spec)
                stop_ret.append(r)
                stop_clear.append(c)
                print(f"# round {i + 1}: srun {base[-1]:.2f}s, by hand {hand[-1]:.2f}s, first rank line "
                      f"{first[-1]:.2f}s ({nocheck[-1]:.2f}s with --no-check), "
                      f"stop {r:.2f}s / clear {c:.2f}s", file=sys.stderr)  # fmt: skip
        floor, manual = statistics.median(base), statistics.median(hand)
        print(f"{'measure (median of ' + str(args.rounds) + ')':46} {'seconds':>8} {'x srun floor':>13} "
              f"{'x by hand':>10}")  # fmt: skip
        for label, values in (("floor: srun -N3 hostname (ssh to login)", base),
                              ("by hand: sbatch + srun torchrun -> rank line", hand),
                              ("launch --attach: submit -> first rank line", first),
                              ("  the same, --no-check (no preflight step)", nocheck),
                              ("stop: until the command returns", stop_ret),
                              ("stop: until no process is left on any node", stop_clear)):  # fmt: skip
            m = statistics.median(values)
            print(f"{label:46} {m:8.2f} {m / floor:13.1f} {m / manual:10.2f}")
        print(f"goal: launch --attach (preflight included) / by hand <= 1.2: {statistics.median(first) / manual:.2f}")
    finally:
        if not args.keep:
            sandbox.down(NAME)


if __name__ == "__main__":
    main()
