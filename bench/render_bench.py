#!/usr/bin/env python3
"""Benchmark: `render` of a 1,000-node spec (goal < 1 s) and `nodeops --help` start-up (goal < 0.3 s).

Each figure is the best of several runs, printed next to a baseline measured in the same run
(a bare `python -c pass` start-up), so a noisy machine shows up in both columns.

    python bench/render_bench.py [--nodes 1000] [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_spec(n: int) -> str:
    lines = ["name: bench", "nodes:"]
    for i in range(n):
        a, b = divmod(i + 1, 250)
        lines.append(f"  - address: 10.{a // 250}.{a % 250}.{b + 1}")
        lines.append(f"    name: node-{i:04d}")
        lines.append("    gpus: [0, 1, 2, 3, 4, 5, 6, 7]")
        lines.append("    ssh_config: gpu")
        if i == 0:
            lines.append("    chief: true")
    lines += [
        "ssh:",
        "  gpu: {username: ubuntu, port: 22, shared_envs: {LD_LIBRARY_PATH: '$LD_LIBRARY_PATH:/usr/local/cuda/lib64'}}",
        "env: {OMP_NUM_THREADS: 4, TOKEN: {from_env: HOME, secret: true}}",
        "python: {venv: /opt/venv, packages: [torch==2.13.0]}",
        "workdir: {path: /srv/train}",
        "network: {ib: 'off', nccl: {NCCL_DEBUG: WARN}}",
    ]
    return "\n".join(lines) + "\n"


def best(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    nodeops = shutil.which("nodeops") or str(Path(sys.executable).parent / "nodeops")
    tmp = Path(tempfile.mkdtemp(prefix="nodeops-bench-"))
    try:
        spec = tmp / "big.yaml"
        spec.write_text(make_spec(args.nodes))
        python = best([sys.executable, "-c", "pass"], args.runs * 2)
        help_t = best([nodeops, "--help"], args.runs * 2)
        render_t = best([nodeops, "render", str(spec), "-o", str(tmp / "out")], args.runs)

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        from nodeops.setup.render import render
        from nodeops.spec.loading import load_spec

        inproc = []
        for _ in range(args.runs):
            t = time.perf_counter()
            render(load_spec(spec), {"HOME": "/root"})
            inproc.append(time.perf_counter() - t)
        lines = (tmp / "out" / "hostfile").read_text().count("\n")
        assert lines == args.nodes, f"hostfile has {lines} hosts, expected {args.nodes}"
    finally:
        shutil.rmtree(tmp)

    rows = [
        ("python -c pass (baseline)", python, None),
        ("nodeops --help", help_t, 0.3),
        (f"nodeops render ({args.nodes} nodes, process)", render_t, 1.0),
        (f"load+render in-process ({args.nodes} nodes)", min(inproc), None),
    ]
    print(f"{'what':48} {'best s':>8} {'x baseline':>11} {'goal':>8}")
    ok = True
    for what, secs, goal in rows:
        verdict = "" if goal is None else (f"<{goal}s " + ("ok" if secs < goal else "MISSED"))
        ok &= goal is None or secs < goal
        print(f"{what:48} {secs:8.3f} {secs / python:10.1f}x {verdict:>8}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
