#!/usr/bin/env python3
"""Benchmark: a second (no-op) `nodeops setup` on 4 sandbox nodes, tuned vs stock ansible.cfg.

Both sides run the same setup playbook through the same runner (ansible-runner, same
inventory, same events); only ansible.cfg differs. "stock" is Ansible's defaults plus the
roles path; "tuned" is what nodeops generates (pipelining, ControlPersist, forks per host,
no implicit facts, mitogen for plays of up to 2 hosts). Runs alternate, best and median are printed,
and every timed run must report changed=0. Goals: ratio >= 2x and tuned < 10 s.

    python bench/setup_bench.py [--nodes 4] [--runs 3] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nodeops.resources import data_dir  # noqa: E402
from nodeops.sandbox import cluster as sandbox  # noqa: E402
from nodeops.setup import runner  # noqa: E402
from nodeops.setup.render import inventory  # noqa: E402
from nodeops.spec.loading import load_spec  # noqa: E402

NAME = "bench"
SUBNET = "10.217.0.0/24"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the bench sandbox up")
    args = ap.parse_args()
    sb = sandbox.up(name=NAME, n=args.nodes, subnet=SUBNET, say=lambda m: print(f"==> {m}", flush=True))
    try:
        with tempfile.TemporaryDirectory(prefix="nodeops-bench-") as tmp:
            work = Path(tmp)
            (work / "project").mkdir()
            (work / "project" / "train.py").write_text("print('train')\n")
            subprocess.run([sys.executable, str(ROOT / "roles/python_env/molecule/default/make_wheel.py"),
                            str(work / "wheels")], check=True)  # fmt: skip
            spec = work / "cluster.yaml"
            spec.write_text(sb.spec_path.read_text() + (
                "env: {OMP_NUM_THREADS: 1}\n"
                f"python: {{packages: [nodeops-probe==1.0], wheelhouse: {work / 'wheels'}}}\n"
                f"workdir: {{path: /srv/bench, source: {work / 'project'}}}\n"
                "network: {ib: 'off'}\n"
            ))  # fmt: skip
            inv = inventory(load_spec(spec), os.environ)
            print("==> converging once (not timed)", flush=True)
            first = runner.run_playbook("setup.yml", inv, kind="bench")
            assert first.ok, [h.errors for h in first.hosts.values()]
            stock = f"[defaults]\nroles_path = {data_dir('roles')}\n"
            times: dict[str, list[float]] = {"stock": [], "tuned": []}
            for i in range(args.runs):
                for label, cfg in (("stock", stock), ("tuned", None)):
                    r = runner.run_playbook("setup.yml", inv, kind="bench", cfg=cfg)
                    assert r.ok and r.changed == 0, f"{label} run {i}: ok={r.ok} changed={r.changed}"
                    times[label].append(r.seconds)
                    print(f"    run {i + 1} {label:5} {r.seconds:6.2f}s  changed=0", flush=True)
    finally:
        if not args.keep:
            sandbox.down(NAME)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    mitogen = "on" if runner.mitogen_strategy_dir(args.nodes) else "off"
    print(f"\nsecond setup, {args.nodes} nodes, {args.runs} runs each (mitogen {mitogen}):")
    print(f"{'config':8} {'best s':>8} {'median s':>9}")
    for k in ("stock", "tuned"):
        print(f"{k:8} {best[k]:8.2f} {med[k]:9.2f}")
    ratio = med["stock"] / med["tuned"]
    print(f"ratio stock/tuned (median): {ratio:.2f}x  goal >= 2x: {'ok' if ratio >= 2 else 'MISSED'}")
    print(f"tuned median {med['tuned']:.2f}s  goal < 10s: {'ok' if med['tuned'] < 10 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
