#!/usr/bin/env python3
"""Benchmark: how fast a Slurm launch shows its first log line, and how fast `stop` clears a job.

On a 3-node Slurm sandbox (`nodeops sandbox up --slurm`, started here unless it is up), set up
once with torch from a wheelhouse, each of R rounds measures:

- baseline: `srun --nodes=3 --ntasks-per-node=1 hostname` on the login node, over the same ssh: the
  scheduler's own floor for starting a step on every node and seeing it end;
- submit -> first rank line: `nodeops launch --attach` of the DDP example, from the command's
  start to the first line a rank printed (`nodeX [rankN]:...`), which includes sbatch, the
  scheduler, srun, torchrun's start, the rendezvous and Python importing torch;
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

from nodeops import sandbox  # noqa: E402

NAME = "slurmbench"
SUBNET = "10.221.0.0/24"
NODEOPS = [sys.executable, "-m", "nodeops"]
RANK_LINE = re.compile(r"^node\d \[rank\d+\]:")
LEFT = re.compile(r"torch\.distributed\.run|ddp_train|srun |slurmstepd")


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)


def leftovers(sb: sandbox.Sandbox) -> int:
    n = 0
    for node in sb.nodes:
        ps = sandbox.docker("exec", node.container, "ps", "-eo", "args", check=False)
        n += sum(1 for line in ps.splitlines() if LEFT.search(line))
    return n


def first_rank_line(spec: Path) -> float:
    t0 = time.monotonic()
    p = subprocess.Popen([*NODEOPS, "launch", str(spec), "--attach", "--", "ddp_train.py", "--steps", "3"],
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
            base, first, stop_ret, stop_clear = [], [], [], []
            for i in range(args.rounds):
                t0 = time.monotonic()
                b = run("ssh", "-F", str(sb.ssh_config), "node1", "srun --nodes=3 --ntasks-per-node=1 hostname")
                if b.returncode != 0 or sorted(b.stdout.split()) != ["node1", "node2", "node3"]:
                    raise SystemExit(f"srun failed: {b.stdout} {b.stderr}")
                base.append(time.monotonic() - t0)
                first.append(first_rank_line(spec))
                r, c = stop_latency(sb, spec)
                stop_ret.append(r)
                stop_clear.append(c)
                print(f"# round {i + 1}: srun {base[-1]:.2f}s, first rank line {first[-1]:.2f}s, "
                      f"stop {r:.2f}s / clear {c:.2f}s", file=sys.stderr)  # fmt: skip
        floor = statistics.median(base)
        print(f"{'measure (median of ' + str(args.rounds) + ')':42} {'seconds':>8} {'x srun floor':>13}")
        for label, values in (("baseline: srun -N3 hostname (ssh to login)", base),
                              ("launch --attach: submit -> first rank line", first),
                              ("stop: until the command returns", stop_ret),
                              ("stop: until no process is left on any node", stop_clear)):  # fmt: skip
            m = statistics.median(values)
            print(f"{label:42} {m:8.2f} {m / floor:13.1f}")
    finally:
        if not args.keep:
            sandbox.down(NAME)


if __name__ == "__main__":
    main()
