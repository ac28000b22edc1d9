#!/usr/bin/env python3
"""Benchmark: automatic recovery after a lost node (launch.restarts), on 4 sandbox nodes (node4
a spare), restart_backoff 0 (the back-off is the user's choice; it adds to the total as written).

Each run launches a DDP-like job (gloo all_reduce every 50 ms; every rank writes time.time()
to /tmp/bench-first-<restart> when it starts) detached, `docker kill`s node3 once every rank
runs, and reads the chief supervisor's log (its own time.time() stamps; the containers share this
machine's clock). From the kill to the first line of the relaunched ranks, split into:

- detection: the kill -> the supervisor's first failure report;
- teardown: -> every other rank stopped (the attempt's end);
- preflight: -> the new set (node1, node2, node4) checked from the chief;
- start: -> every host's job started (agent.py begin + start.sh);
- first line: -> rank 0 of the new attempt running the script (its marker file).

Baseline, measured in the same run: a fresh `nodeops launch --detach` of the same job on the
same 3 nodes (what a user does by hand once they noticed, edited the spec and came back: here
with zero human delay), from the command to rank 0's first line. The goal is under 30 s on 4
nodes before the script's own checkpoint load.

    python bench/recovery_bench.py [--runs 3] [--keep]

Needs the torch 2.13.0 CPU wheelhouse with numpy and py-spy in .cache/wheelhouse-torch (the demo
makes it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _bench import NODEOPS, need_wheels, set_up_project, sh, time_in_marker  # noqa: E402  (bench/, beside this script)

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "benchr"
SUBNET = "10.223.0.0/24"
JOB = """import os, time
import torch, torch.distributed as d

restart = os.environ.get("NODEOPS_RESTART_COUNT", "0")
d.init_process_group('gloo')
open(f"/tmp/bench-first-{restart}", "w").write(repr(time.time()))
t = torch.ones(1)
for step in range(10**9):
    d.all_reduce(t)
    if d.get_rank() == 0 and step % 20 == 0:
        print('step', step, flush=True)
    time.sleep(0.05)
"""
PHASES = ("detection", "teardown", "preflight", "start", "first line")


def stamps(chief: str, run_id: str) -> dict[str, float]:
    """The supervisor's own time stamps for each phase of the first restart."""
    log = sh("docker", "exec", chief, "cat", f"/home/{sandbox.USER}/.nodeops/runs/{run_id}/supervisor.log").stdout
    out: dict[str, float] = {}
    for line in log.splitlines():
        t, _, msg = line.partition(" ")
        for key, start in (("detected", "first failure:"), ("ended", "attempt 1 ended"),
                           ("preflight", "preflight ok on"), ("started", "attempt 2 started")):  # fmt: skip
            if msg.startswith(start) and key not in out:
                out[key] = float(t)
    return out


def one_recovery(sb: sandbox.Sandbox, spec: Path) -> dict[str, float] | None:
    chief, victim = sb.nodes[0].container, sb.nodes[2].container
    for n in sb.nodes:
        sh("docker", "exec", n.container, "sh", "-c", "rm -f /tmp/bench-first-*")
    p = sh(NODEOPS, "launch", "--detach", str(spec), "--", "job.py")
    if p.returncode != 0:
        print(p.stderr[-2000:])
        return None
    run_id = p.stdout.strip().splitlines()[-1]
    if time_in_marker(chief, "/tmp/bench-first-0", 120) is None:
        print("the job never started")
        return None
    time.sleep(2)
    killed = time.time()
    sh("docker", "kill", victim)
    first = time_in_marker(chief, "/tmp/bench-first-1", 120)
    st = stamps(chief, run_id)
    sh("docker", "start", victim)
    sandbox._wait_for_sshd(sb.nodes[2].address, time.monotonic() + 60)
    sh(NODEOPS, "stop", run_id)
    if first is None or len(st) < 4:
        print(f"no recovery seen: {st}")
        return None
    return {"detection": st["detected"] - killed, "teardown": st["ended"] - st["detected"],
            "preflight": st["preflight"] - st["ended"], "start": st["started"] - st["preflight"],
            "first line": first - st["started"], "total": first - killed}  # fmt: skip


def one_fresh_launch(sb: sandbox.Sandbox, spec: Path) -> float | None:
    chief = sb.nodes[0].container
    sh("docker", "exec", chief, "rm", "-f", "/tmp/bench-first-0")
    t0 = time.time()
    p = sh(NODEOPS, "launch", "--detach", "--no-check", str(spec), "--", "job.py")
    first = time_in_marker(chief, "/tmp/bench-first-0", 120)
    if p.returncode == 0:
        sh(NODEOPS, "stop", p.stdout.strip().splitlines()[-1])
    return None if first is None else first - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = ap.parse_args()
    need_wheels("torch-2.13.0*.whl")
    sb = sandbox.up(name=NAME, n=4, subnet=SUBNET, say=lambda m: print(f"==> {m}", flush=True))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sb_spec = Path(tmp) / "sandbox.yaml"
            spare = sb.spec_path.read_text().replace("    name: node4\n", "    name: node4\n    spare: true\n")
            launch = "launch: {restarts: 1, restart_backoff: 0}\n"
            sb_spec.write_text(spare + launch)
            spec = set_up_project(sb_spec, Path(tmp), {"job.py": JOB})
            plain = Path(tmp) / "three.yaml"  # the baseline: the same job on the 3 nodes left
            plain.write_text(_without_node(spec.read_text(), "node4").replace(launch, ""))
            rec: list[dict[str, float]] = []
            fresh: list[float] = []
            for i in range(args.runs):
                got = one_recovery(sb, spec)
                if got:
                    rec.append(got)
                    print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in got.items()), flush=True)
                base = one_fresh_launch(sb, plain)
                if base is not None:
                    fresh.append(base)
                    print(f"run {i + 1}: fresh launch to the first line {base:.2f}s", flush=True)
            if not rec or not fresh:
                print("not enough runs to compare")
                return 1
            med = {k: statistics.median(r[k] for r in rec) for k in (*PHASES, "total")}
            base = statistics.median(fresh)
            print("\nmedians over", len(rec), "recoveries (node3 killed, spare node4 in, backoff 0):")
            for k in PHASES:
                print(f"  {k:11} {med[k]:6.2f}s")
            print(f"  {'total':11} {med['total']:6.2f}s  (goal: under 30 s)")
            print(f"baseline: a fresh `nodeops launch --detach --no-check` to the first line: {base:.2f}s")
            print(f"ratio recovery / fresh launch: {med['total'] / base:.2f}")
    finally:
        if not args.keep:
            sandbox.down(NAME)
    return 0


def _without_node(text: str, name: str) -> str:
    """The spec text without the node named ``name`` (its entry's lines)."""
    out, skip = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("  - address: "):
            skip = False
        if line.strip() == f"name: {name}":
            out.pop()  # its address line
            skip = True
        if not skip:
            out.append(line)
        elif not line.startswith("    "):
            skip = False
            out.append(line)
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
