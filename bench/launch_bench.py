#!/usr/bin/env python3
"""Benchmark: launch overhead vs pdsh fan-out, and teardown latency, on 4 sandbox nodes.

1. Launch overhead. The same trivial torchrun job (init gloo, barrier, exit) on every node:
   - pdsh: the torchrun command fanned out with `pdsh -R ssh` and `--node-rank %n`, as
     DeepSpeed's PDSH runner does (same ssh_config, env file and venv as nodeops);
   - nodeops: `nodeops launch --no-check` (run dirs, job scripts, agents, the chief's supervisor
     and its guards, live log streaming), the same `--via ansible`, and `nodeops launch` with
     its preflight.
   Runs alternate; medians are compared. Goals: nodeops/pdsh <= 1.3 (--via ssh), <= 2 (--via ansible).
2. Teardown latency. Rank 3 (node4) writes time.time() to a file and exits 1 mid-training;
   a poller runs `ps` in every container (docker exec) until no rank is left anywhere.
   Latency = last rank gone - failure. Attached and detached (the chief's supervisor decides in
   both). Goal: <= 3 s. The poller's resolution is printed with the result.
3. Leftovers: after every run above, the processes of any run (jobs, agents, supervisors,
   guards, tail, ssh clients) still alive in each container. Goal: 0.

    python bench/launch_bench.py [--runs 3] [--keep]

Needs the torch 2.13.0 CPU wheelhouse in .cache/wheelhouse-torch (the demo makes it) and pdsh
on this machine (installed with apt when missing and running as root).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _bench import NODEOPS, need_wheels, set_up_project, sh, time_in_marker  # noqa: E402  (bench/, beside this script)

from nodeops.sandbox import cluster as sandbox  # noqa: E402
from nodeops.spec.loading import load_spec  # noqa: E402

NAME = "benchl"
SUBNET = "10.218.0.0/24"
TRIVIAL = "import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\nd.destroy_process_group()\n"
FAIL = """import os, sys, time
import torch, torch.distributed as d
d.init_process_group('gloo')
r = d.get_rank()
t = torch.ones(1)
for step in range(100000):
    if r == int(sys.argv[1]) and step == 10:
        open(sys.argv[2], 'w').write(repr(time.time()))
        sys.exit(1)
    d.all_reduce(t)
    time.sleep(0.05)
"""
JOB = re.compile(r"fail\.py|trivial\.py|torch\.distributed\.run|job\.sh")  # every process of a job
RANK = re.compile(r"python3? (-u )?fail\.py")  # the training processes themselves (torchrun's workers)


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    took = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return took


def alive(sb: sandbox.Sandbox) -> tuple[int, int]:
    """(rank processes, all job processes) left on all nodes, seen with ps in the containers."""

    def one(n: sandbox.NodeInfo) -> tuple[int, int]:
        ps = sh("docker", "exec", n.container, "ps", "-eo", "cmd").stdout.splitlines()
        return sum(1 for line in ps if RANK.search(line)), sum(1 for line in ps if JOB.search(line))

    with concurrent.futures.ThreadPoolExecutor(len(sb.nodes)) as pool:
        counts = list(pool.map(one, sb.nodes))
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def teardown_latency(sb: sandbox.Sandbox, spec: Path, detach: bool) -> tuple[float, float, float]:
    """Seconds from rank 3's failure until no rank is left anywhere, until no process of the job
    is left (torchrun agents included), and the poll interval."""
    marker = f"/tmp/nodeops-bench-failed-{time.time_ns()}"
    node4 = sb.nodes[3]
    argv = [NODEOPS, "launch", str(spec), "--no-check", *(["--detach"] if detach else []), "--", "fail.py", "3", marker]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    failed_at = time_in_marker(node4.container, marker)
    if failed_at is None:
        proc.kill()
        raise SystemExit(f"rank 3 never failed: {proc.communicate()[1][-2000:]}")
    polls: list[float] = []
    ranks_gone = None
    while time.time() - failed_at < 60:
        t0 = time.time()
        ranks, procs = alive(sb)
        polls.append(time.time() - t0)
        if ranks == 0 and ranks_gone is None:
            ranks_gone = time.time()
        if procs == 0:
            all_gone = time.time()
            break
    else:
        raise SystemExit(f"job processes still alive 60 s after the failure: {ranks} ranks, {procs} in all")
    proc.wait(timeout=120)
    sh("docker", "exec", node4.container, "rm", "-f", marker)
    assert ranks_gone is not None
    return ranks_gone - failed_at, all_gone - failed_at, statistics.median(polls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the bench sandbox up")
    ap.add_argument("--teardown-only", action="store_true", help="skip the launch-overhead part")
    args = ap.parse_args()
    need_wheels("torch-2.13.0*.whl", "numpy-*.whl")
    if shutil.which("pdsh") is None:
        print("==> installing pdsh (apt)", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "pdsh"], check=True, capture_output=True)
    sb = sandbox.up(name=NAME, n=4, subnet=SUBNET, say=lambda m: print(f"==> {m}", flush=True))
    try:
        with tempfile.TemporaryDirectory(prefix="nodeops-bench-") as tmp:
            work = Path(tmp)
            spec = set_up_project(sb.spec_path, work, {"trivial.py": TRIVIAL, "fail.py": FAIL})
            # pdsh gets the same ssh_config (strict host keys) and the same env/venv as nodeops' jobs.
            cfg = work / "ssh_config"
            cfg.write_text(sb.ssh_config.read_text())
            env = {**os.environ, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS": f"-F {cfg} -x %h"}
            chief = sb.nodes[0].address
            cluster = load_spec(spec).cluster_name
            remote = (
                f"cd /srv/bench && . ~/.nodeops/{cluster}/env.sh && . ~/.venvs/bench/bin/activate && "
                f"python3 -m torch.distributed.run --nnodes 4 --nproc-per-node 1 --node-rank %n "
                f"--master-addr {chief} --master-port 29500 trivial.py"
            )
            hosts = ",".join(n.name for n in sb.nodes)
            runs = {
                "pdsh": (["pdsh", "-S", "-w", hosts, remote], env),
                "nodeops --no-check": ([NODEOPS, "launch", str(spec), "--no-check", "--", "trivial.py"], None),
                "nodeops --via ansible": (
                    [NODEOPS, "launch", str(spec), "--no-check", "--via", "ansible", "--", "trivial.py"],
                    None,
                ),
                "nodeops (preflight)": ([NODEOPS, "launch", str(spec), "--", "trivial.py"], None),
            }
            times: dict[str, list[float]] = {k: [] for k in runs}
            for argv, e in runs.values() if not args.teardown_only else []:  # warm-up: page cache, ssh sockets
                timed(argv, e)
            for i in range(0 if args.teardown_only else args.runs):
                for label, (argv, e) in runs.items():
                    took = timed(argv, e)
                    times[label].append(took)
                    print(f"    run {i + 1} {label:20} {took:6.2f}s", flush=True)
            lat: dict[str, list[float]] = {"attached": [], "detached": []}
            lat_all: dict[str, list[float]] = {"attached": [], "detached": []}
            polls: list[float] = []
            for i in range(args.runs):
                for mode in ("attached", "detached"):
                    ranks_s, all_s, poll = teardown_latency(sb, spec, mode == "detached")
                    lat[mode].append(ranks_s)
                    lat_all[mode].append(all_s)
                    polls.append(poll)
                    print(f"    teardown {i + 1} {mode:9} no rank left {ranks_s:5.2f}s, no job process left "
                          f"{all_s:5.2f}s", flush=True)  # fmt: skip
            time.sleep(8)  # let the last run's helpers end (ControlPersist masters are ssh's, not counted)
            left = leftover_count(sb)
    finally:
        if not args.keep:
            sandbox.down(NAME)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"\nlaunch of a trivial torchrun job on 4 nodes, {args.runs} runs each (median):")
    for k, v in med.items():
        print(f"  {k:20} {v:6.2f}s")
    for k, goal in (("nodeops --no-check", 1.3), ("nodeops --via ansible", 2.0), ("nodeops (preflight)", 1.3)):
        if k in med and med.get("pdsh"):
            r = med[k] / med["pdsh"]
            print(f"  ratio {k}/pdsh: {r:.2f}  goal <= {goal}: {'ok' if r <= goal else 'MISSED'}")
    print(f"\nteardown latency from rank 3's failure (poll interval ~{statistics.median(polls):.2f}s):")
    for k, vals in lat.items():
        m = statistics.median(vals)
        print(f"  {k:9} no rank left: median {m:5.2f}s, max {max(vals):5.2f}s, goal <= 3s: "
              f"{'ok' if max(vals) <= 3 else 'MISSED'}; no job process left (torchrun agents too): "
              f"median {statistics.median(lat_all[k]):5.2f}s")  # fmt: skip
    print(f"\nprocesses of any run left on the nodes after every run: {left} (goal 0)")
    return 0


LEFTOVER = re.compile(r"agent\.py|supervisor\.py|watch\.py|wait\.sh|follow\.sh|kill\.sh|job\.sh|tail -n|"
                      r"grep -m1|fail\.py|trivial\.py|torch\.distributed\.run|(^|\s)ssh\s")  # fmt: skip


def leftover_count(sb: sandbox.Sandbox) -> dict[str, int]:
    out = {}
    for n in sb.nodes:
        ps = subprocess.run(["docker", "exec", n.container, "ps", "-eo", "args"], capture_output=True, text=True,
                            check=False).stdout.splitlines()  # fmt: skip
        out[n.name] = sum(1 for line in ps if LEFTOVER.search(line))
    return out


if __name__ == "__main__":
    sys.exit(main())
