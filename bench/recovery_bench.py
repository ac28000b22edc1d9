#!/usr/bin/env python3
"""Benchmark: automatic recovery after a lost node (launch.restarts), over ssh and on Slurm, in
the same run (interleaved: this machine's load is shared), restart_backoff 0 (the back-off is
the user's choice; it adds to the total as written).

Over ssh: 4 sandbox nodes (node4 a spare). Each run launches a DDP-like job (gloo all_reduce
every 50 ms; every rank writes time.time() to /tmp/bench-first-<restart> when it starts)
detached, `docker kill`s node3 once every rank runs, and reads the chief supervisor's log (its
own time.time() stamps; the containers share this machine's clock). From the kill to the first
line of the relaunched ranks, split into:

- detection: the kill -> the supervisor's first failure report;
- teardown: -> every other rank stopped (the attempt's end);
- preflight: -> the new set (node1, node2, node4) checked from the chief;
- start: -> every host's job started (agent.py begin + start.sh);
- first line: -> rank 0 of the new attempt running the script (its marker file).

Baseline, measured in the same run: a fresh `nodeops launch --detach` of the same job on the
same 3 nodes (what a user does by hand once they noticed, edited the spec and came back: here
with zero human delay), from the command to rank 0's first line. The goal is under 30 s on 4
nodes before the script's own checkpoint load.

On Slurm (`--backend slurm` or `both`): a 3-node Slurm sandbox, the job on 2 nodes and 1 spare
(slurm.spare_nodes), the same job; node2 (not the batch node) `docker kill`ed once every rank
runs. The phases come from the run's attempts.json (the batch node's own stamps):

- detection: the kill -> the batch node named node2 lost (its heartbeats stopped);
- teardown: -> srun ended (the attempt's end);
- decision: -> the restart rules chose the next nodes (Slurm's preflight step probed the spare
  when the job began);
- start: -> attempt 2's srun step started;
- first line: -> rank 0 of the new attempt running the script (its marker file).

The issue's goal: on Slurm, from the kill to the first line, within 2x the ssh figure.

    python bench/recovery_bench.py [--runs 3] [--backend ssh|slurm|both] [--fault kill|pause] [--keep]

``--fault pause`` freezes the node instead (``docker pause``): nothing breaks, its connections
stay open and go silent, as with a hung or unplugged machine. Over ssh the chief's link to it
then times out (ServerAliveInterval 2 s x 3); on Slurm its heartbeats stop (5 s, the peers' ranks
failing nothing).

Needs the torch 2.13.0 CPU wheelhouse with numpy and py-spy in .cache/wheelhouse-torch (the demo
makes it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _bench import NODEOPS, need_wheels, set_up_project, sh, time_in_marker  # noqa: E402  (bench/, beside this script)

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "benchr"
SUBNET = "10.223.0.0/24"
SLURM_NAME = "benchrs"
SLURM_SUBNET = "10.232.0.0/24"
SLURM_WORKDIR = f"/home/{sandbox.USER}/bench"  # in the shared home: every node sees what setup put there
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
SLURM_PHASES = ("detection", "teardown", "decision", "start", "first line")


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


def one_recovery(sb: sandbox.Sandbox, spec: Path, fault: str = "kill") -> dict[str, float] | None:
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
    sh("docker", fault, victim)
    first = time_in_marker(chief, "/tmp/bench-first-1", 120)
    st = stamps(chief, run_id)
    if fault == "pause":  # its agent finds the supervisor's heartbeat gone and stops its job
        sh("docker", "unpause", victim)
    else:
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


def slurm_record(login: str, run_id: str) -> dict[str, Any]:
    """The run's attempts.json, as the batch node wrote it."""
    text = sh("docker", "exec", login, "cat", f"/home/{sandbox.USER}/.nodeops/runs/{run_id}/attempts.json").stdout
    try:
        got = json.loads(text)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def slurm_revive(sb: sandbox.Sandbox, login: str, fault: str) -> None:
    """node2 back (unpaused; or its container, munged and slurmd: `sandbox up` again), and
    Slurm idle."""
    if fault == "pause":
        sh("docker", "unpause", sb.nodes[1].container)
    else:
        sh("docker", "start", sb.nodes[1].container)
        sandbox.up(name=SLURM_NAME, n=3, subnet=SLURM_SUBNET, slurm=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        nodes = sh("docker", "exec", login, "sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
        jobs = sh("docker", "exec", login, "squeue", "-h").stdout.strip()
        if not jobs and nodes.count("idle") == 3:
            return
        time.sleep(1)
    print("warning: Slurm did not settle within 120 s after node2 came back", flush=True)


def one_recovery_slurm(sb: sandbox.Sandbox, spec: Path, fault: str = "kill") -> dict[str, float] | None:
    login, victim = sb.nodes[0].container, sb.nodes[1].container  # rank 0 runs on the batch node, node1
    sh("docker", "exec", login, "sh", "-c", "rm -f /tmp/bench-first-*")
    p = sh(NODEOPS, "launch", "--detach", str(spec), "--", "job.py")
    if p.returncode != 0:
        print(p.stderr[-2000:])
        return None
    run_id = p.stdout.strip().splitlines()[-1]
    try:
        if time_in_marker(login, "/tmp/bench-first-0", 180) is None:
            print("the job never started")
            return None
        time.sleep(2)
        killed = time.time()
        sh("docker", fault, victim)
        first = time_in_marker(login, "/tmp/bench-first-1", 180)
        rec = slurm_record(login, run_id).get("attempts") or []
    finally:
        sh(NODEOPS, "stop", run_id)  # (COMPLETING on node2 until it is back)
        slurm_revive(sb, login, fault)
    if first is None or len(rec) < 2 or rec[0].get("kind") != "lost":
        print(f"no recovery seen: {rec}")
        return None
    a1, a2 = rec
    t = a1.get("times") or {}
    return {"detection": t["failed"] - killed, "teardown": t["ended"] - t["failed"],
            "decision": a1["preflight_done"] - t["ended"], "start": a2["started"] - a1["preflight_done"],
            "first line": first - a2["started"], "total": first - killed}  # fmt: skip


def ssh_project(tmp: Path) -> tuple[sandbox.Sandbox, Path, Path]:
    sb = sandbox.up(name=NAME, n=4, subnet=SUBNET, say=lambda m: print(f"==> {m}", flush=True))
    sb_spec = tmp / "sandbox.yaml"
    spare = sb.spec_path.read_text().replace("    name: node4\n", "    name: node4\n    spare: true\n")
    launch = "launch: {restarts: 1, restart_backoff: 0}\n"
    sb_spec.write_text(spare + launch)
    spec = set_up_project(sb_spec, tmp, {"job.py": JOB})
    plain = tmp / "three.yaml"  # the baseline: the same job on the 3 nodes left
    plain.write_text(_without_node(spec.read_text(), "node4").replace(launch, ""))
    return sb, spec, plain


def slurm_project(tmp: Path) -> tuple[sandbox.Sandbox, Path]:
    sb = sandbox.up(name=SLURM_NAME, n=3, subnet=SLURM_SUBNET, slurm=True, say=lambda m: print(f"==> {m}", flush=True))
    text = re.sub(r"(?m)^  gpus: \d+\n", "", sb.spec_path.read_text())  # a rank per node
    sb_spec = tmp / "sandbox.yaml"
    sb_spec.write_text(text.replace("  nodes: 3\n", "  nodes: 2\n  spare_nodes: 1\n")
                       + "launch: {restarts: 1, restart_backoff: 0}\n")  # fmt: skip
    return sb, set_up_project(sb_spec, tmp, {"job.py": JOB}, workdir=SLURM_WORKDIR)


def report(title: str, phases: Sequence[str], rec: list[dict[str, float]]) -> float:
    med = {k: statistics.median(r[k] for r in rec) for k in (*phases, "total")}
    print(f"\n{title}: medians over {len(rec)} recoveries (backoff 0):")
    for k in phases:
        print(f"  {k:11} {med[k]:6.2f}s")
    print(f"  {'total':11} {med['total']:6.2f}s")
    return med["total"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backend", choices=("ssh", "slurm", "both"), default="both")
    ap.add_argument("--fault", choices=("kill", "pause"), default="kill",
                    help="docker kill the node (its connections break), or pause it (silent: a hung or "
                    "unplugged machine)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="leave the sandboxes up")
    args = ap.parse_args()
    need_wheels("torch-2.13.0*.whl")
    ssh, slurm = args.backend in ("ssh", "both"), args.backend in ("slurm", "both")
    rec: list[dict[str, float]] = []
    fresh: list[float] = []
    srec: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp_ssh, tempfile.TemporaryDirectory() as tmp_slurm:
            if ssh:
                sb, spec, plain = ssh_project(Path(tmp_ssh))
            if slurm:
                ssb, sspec = slurm_project(Path(tmp_slurm))
            for i in range(args.runs):
                got = one_recovery(sb, spec, args.fault) if ssh else None
                if got:
                    rec.append(got)
                    print(f"run {i + 1}: ssh: " + ", ".join(f"{k} {v:.2f}s" for k, v in got.items()), flush=True)
                base = one_fresh_launch(sb, plain) if ssh else None
                if base is not None:
                    fresh.append(base)
                    print(f"run {i + 1}: ssh: fresh launch to the first line {base:.2f}s", flush=True)
                sgot = one_recovery_slurm(ssb, sspec, args.fault) if slurm else None
                if sgot:
                    srec.append(sgot)
                    print(f"run {i + 1}: Slurm: " + ", ".join(f"{k} {v:.2f}s" for k, v in sgot.items()), flush=True)
    finally:
        if not args.keep:
            for name, on in ((NAME, ssh), (SLURM_NAME, slurm)):
                if on:
                    sandbox.down(name)
    did = {"kill": "killed", "pause": "paused"}[args.fault]
    total = report(f"over ssh (node3 {did}, spare node4 in)", PHASES, rec) if rec else None
    if total is not None and fresh:
        base = statistics.median(fresh)
        print(f"baseline: a fresh `nodeops launch --detach --no-check` to the first line: {base:.2f}s")
        print(f"ratio recovery / fresh launch: {total / base:.2f} (goal: 1.1 at most)")
    stotal = report(f"on Slurm (node2 {did}, the spare in the allocation)", SLURM_PHASES, srec) if srec else None
    if total is not None and stotal is not None:
        print(f"ratio Slurm / ssh, kill to the first line: {stotal / total:.2f} (goal: 2 at most)")
    if (ssh and not rec) or (slurm and not srec):
        print("not enough runs to compare")
        return 1
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
