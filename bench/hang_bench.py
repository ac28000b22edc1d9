#!/usr/bin/env python3
"""Benchmark: the stall watch, the hang watchdog and `nodeops stacks`, on 4 sandbox nodes.

0. Without --timeout (the default): the stall watch, which has no number to choose. A job with
   a 0.5 s step (gloo all_reduce, a line per step) in which rank 3 blocks in
   `stuck_in_data_loader` at step 20: from the hung rank's last progress (the marker it writes)
   to the `==> stall:` line naming rank 3 in the attached launch's output (goal: <= 15 s; the
   run is not stopped by it: the bench stops it then, and checks nothing is left). Then a healthy
   job whose rank 0 spends 25 s in `save_checkpoint` while the others wait in a barrier: it must
   finish (exit 0) with no stall reported.
1. With --timeout T: hang -> report -> nothing left. A DDP-like job (gloo all_reduce every 50 ms) in which rank 3
   (node4) writes time.time() to a file and then blocks forever in `stuck_in_data_loader`,
   launched attached with `--hang-timeout T`. Measured, each run:
   - hang -> report: from the rank's hang to the line in which `launch` names the stuck rank.
     Its floor is T itself (no progress for T seconds is the rule), the baseline measured in
     the same run; the overhead is what nodeops adds (the watchdog's tick, taking every rank's
     stack on every host, the report reaching the controller).
   - report -> nothing left: from that line until no process of the job is left in any
     container (ps through docker exec, not through nodeops).
   - which stack method each rank's dump came from (py-spy or the signal hook).
2. `nodeops stacks` on a healthy running job vs the hand-made baseline it replaces: ssh to every
   node in parallel and `py-spy dump` each training process there (what users do today). Runs
   alternate; medians compared.

    python bench/hang_bench.py [--runs 3] [--timeout 10] [--keep]

Needs the torch 2.13.0 CPU wheelhouse with numpy and py-spy in .cache/wheelhouse-torch (the demo
makes it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _bench import NODEOPS, need_wheels, set_up_project, sh, time_in_marker  # noqa: E402  (bench/, beside this script)

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "benchh"
SUBNET = "10.219.0.0/24"
HANG = """import sys, time
import torch, torch.distributed as d


def stuck_in_data_loader(marker):
    open(marker, 'w').write(repr(time.time()))
    while True:
        time.sleep(1)


d.init_process_group('gloo')
r = d.get_rank()
t = torch.ones(1)
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
every = int(sys.argv[5]) if len(sys.argv) > 5 else 20
for step in range(10**9):
    if r == int(sys.argv[1]) and step == int(sys.argv[2]):
        stuck_in_data_loader(sys.argv[3])
    d.all_reduce(t)
    if step % every == 0:
        print(f'step {step}', flush=True)
    time.sleep(pause)
"""
# A healthy job with a long silent phase: rank 0 "writes a checkpoint" for 25 s at step 10 while
# the others wait in a barrier; then 10 more steps and the end.
CHECKPOINT = """import time
import torch, torch.distributed as d


def save_checkpoint(seconds):
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(0.1)


d.init_process_group('gloo')
r = d.get_rank()
t = torch.ones(1)
for step in range(20):
    if step == 10:
        if r == 0:
            save_checkpoint(25)
        d.barrier()
    d.all_reduce(t)
    print(f'step {step}', flush=True)
    time.sleep(0.5)
print('done', flush=True)
"""
JOB = re.compile(r"hang\.py|torch\.distributed\.run|job\.sh|agent\.py|supervisor\.py|py-spy")
RANK_PROC = "python3? -u hang[.]py"  # pgrep -f (ERE): torchrun's workers (its agent's line has -m torch...)


def job_processes(sb: sandbox.Sandbox) -> int:
    def one(n: sandbox.NodeInfo) -> int:
        ps = sh("docker", "exec", n.container, "ps", "-eo", "args").stdout.splitlines()
        return sum(1 for line in ps if JOB.search(line))

    with concurrent.futures.ThreadPoolExecutor(len(sb.nodes)) as pool:
        return sum(pool.map(one, sb.nodes))


def watch_stderr(
    argv: list[str], found: Callable[[str], bool]
) -> tuple[subprocess.Popen[str], threading.Thread, list[float], list[str]]:
    """Start ``argv``; a thread keeps its stderr lines and the time the first ``found`` one came."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reported: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if found(line) and not reported:
                reported.append(time.time())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, reader, reported, lines


def hang_once(sb: sandbox.Sandbox, spec: Path, timeout: float) -> dict[str, object]:
    marker = f"/tmp/nodeops-bench-hung-{time.time_ns()}"
    node4 = sb.nodes[3]
    argv = [NODEOPS, "launch", str(spec), "--no-check", "--hang-timeout", str(timeout), "--",
            "hang.py", "3", "20", marker]  # fmt: skip
    proc, reader, reported, lines = watch_stderr(argv, lambda line: "stuck: rank 3" in line)
    hung_at = time_in_marker(node4.container, marker, every=0.1)
    if hung_at is None:
        proc.kill()
        raise SystemExit("rank 3 never hung:\n" + "".join(lines[-30:]))
    while not reported and proc.poll() is None:
        time.sleep(0.05)
    if not reported:
        raise SystemExit("launch ended without naming rank 3:\n" + "".join(lines[-30:]))
    while job_processes(sb):
        if time.time() - reported[0] > 60:
            raise SystemExit("job processes still alive 60 s after the report")
    gone = time.time()
    proc.wait(timeout=120)
    reader.join(timeout=5)
    sh("docker", "exec", node4.container, "rm", "-f", marker)
    if proc.returncode != 124:
        raise SystemExit(f"launch exited {proc.returncode}, not 124:\n" + "".join(lines[-30:]))
    run_id = re.search(r"==> run (\S+): starting", "".join(lines))
    assert run_id is not None
    hang = json.loads((Path.home() / ".nodeops" / "jobs" / run_id.group(1) / "stacks" / "hang.json").read_text())
    methods = sorted({d["method"] for d in hang["dumps"]})
    return {"report": reported[0] - hung_at, "gone": gone - reported[0], "methods": methods}


def stall_once(sb: sandbox.Sandbox, spec: Path) -> dict[str, float]:
    """The stall watch alone (no --hang-timeout given; the default hard timeout is minutes away):
    rank 3 hangs at step 20 of a 0.5 s step; the seconds from its last progress to the report."""
    marker = f"/tmp/nodeops-bench-stall-{time.time_ns()}"
    node4 = sb.nodes[3]
    argv = [NODEOPS, "launch", str(spec), "--no-check", "--", "hang.py", "3", "20", marker, "0.5", "1"]
    proc, reader, reported, lines = watch_stderr(argv, lambda line: line.startswith("==> stall: rank 3 (node4)"))
    try:
        hung_at = time_in_marker(node4.container, marker, every=0.1)
        if hung_at is None:
            raise SystemExit("rank 3 never hung:\n" + "".join(lines[-30:]))
        deadline = time.time() + 120
        while not reported and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if not reported:
            raise SystemExit("no stall report naming rank 3 within 120 s:\n" + "".join(lines[-30:]))
        alive = proc.poll() is None  # the stall watch reports; it does not stop the run
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launch stops every rank
        proc.wait(timeout=120)
        reader.join(timeout=5)
    t = time.time()
    while job_processes(sb):
        if time.time() - t > 30:
            raise SystemExit("job processes still alive 30 s after the stop")
    sh("docker", "exec", node4.container, "rm", "-f", marker)
    if not alive:
        raise SystemExit("the run ended at the stall report: " + "".join(lines[-10:]))
    # the hung rank's last progress: its last step line came at most one step (0.5 s) before it hung
    return {"report": reported[0] - hung_at, "step": 0.5}


def healthy_checkpoint(spec: Path) -> tuple[int, int]:
    """A job with a 25 s silent checkpoint on rank 0: its exit code and how many stalls it got."""
    p = sh(NODEOPS, "launch", str(spec), "--no-check", "--", "checkpoint.py")
    return p.returncode, sum(1 for line in p.stderr.splitlines() if line.startswith("==> stall:"))


def stacks_vs_by_hand(sb: sandbox.Sandbox, spec: Path, runs: int) -> dict[str, list[float]]:
    p = sh(NODEOPS, "launch", str(spec), "--no-check", "--detach", "--", "hang.py", "-1", "-1", "/dev/null")
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    run_id = p.stdout.strip().splitlines()[-1]
    by_hand = f"for p in $(pgrep -f '{RANK_PROC}'); do ~/.venvs/bench/bin/py-spy dump --pid $p || exit 1; done"
    times: dict[str, list[float]] = {"ssh + py-spy dump by hand": [], "nodeops stacks": []}
    try:
        time.sleep(15)  # every rank up
        for i in range(runs + 1):  # the first round warms ssh's sockets and the page cache: not counted
            t = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(sb.nodes)) as pool:
                outs = list(pool.map(lambda n: sh("ssh", "-F", str(sb.ssh_config), n.name, by_hand), sb.nodes))
            hand = time.monotonic() - t
            if any(o.returncode or "hang.py" not in o.stdout for o in outs):  # every node dumped its rank
                raise SystemExit("by hand: " + "; ".join(o.stderr.strip()[-300:] for o in outs if o.returncode))
            t = time.monotonic()
            got = sh(NODEOPS, "stacks", run_id, "--json")
            ours = time.monotonic() - t
            if got.returncode != 0 or len(json.loads(got.stdout)["methods"]) != 4:
                raise SystemExit("nodeops stacks: " + got.stderr[-1000:])
            if i:
                times["ssh + py-spy dump by hand"].append(hand)
                times["nodeops stacks"].append(ours)
                print(f"    stacks {i}: by hand {hand:5.2f}s, nodeops stacks {ours:5.2f}s", flush=True)
    finally:
        sh(NODEOPS, "stop", run_id)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=None,
                    help="measure the hard hang timeout (this --hang-timeout, s), not the stall watch")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="leave the bench sandbox up")
    args = ap.parse_args()
    need_wheels("torch-2.13.0*.whl", "numpy-*.whl", "py_spy-*.whl")
    sb = sandbox.up(name=NAME, n=4, subnet=SUBNET, say=lambda m: print(f"==> {m}", flush=True))
    try:
        with tempfile.TemporaryDirectory(prefix="nodeops-bench-") as tmp:
            spec = set_up_project(sb.spec_path, Path(tmp), {"hang.py": HANG, "checkpoint.py": CHECKPOINT})
            results: list[dict[str, object]] = []
            stalls: list[dict[str, float]] = []
            for i in range(args.runs):
                if args.timeout is None:
                    st = stall_once(sb, spec)
                    stalls.append(st)
                    print(f"    stall {i + 1}: reported {st['report']:5.2f}s after rank 3 hung", flush=True)
                    continue
                r = hang_once(sb, spec, args.timeout)
                results.append(r)
                print(f"    hang {i + 1}: reported {r['report']:5.2f}s after the hang, nothing left "
                      f"{r['gone']:5.2f}s after the report, methods {r['methods']}", flush=True)  # fmt: skip
            healthy = healthy_checkpoint(spec) if args.timeout is None else None
            stacks = stacks_vs_by_hand(sb, spec, args.runs)
    finally:
        if not args.keep:
            sandbox.down(NAME)
    if args.timeout is None:
        report = statistics.median(st["report"] for st in stalls)
        print(f"\nstall watch on 4 nodes, no timeout given, 0.5 s step, {args.runs} runs (median):")
        print(f"  hung rank's last progress -> the stall report naming it: {report:5.2f}s (goal <= 15 s; "
              f"the floor of the rule is 5 s of silence; {report / 0.5:.0f} steps)")  # fmt: skip
        assert healthy is not None
        print(f"  healthy job with a 25 s silent checkpoint on rank 0: exit {healthy[0]}, "
              f"{healthy[1]} stall report(s) (goal: exit 0, none)")  # fmt: skip
    else:
        report = statistics.median(float(r["report"]) for r in results)  # type: ignore[arg-type]
        gone = statistics.median(float(r["gone"]) for r in results)  # type: ignore[arg-type]
        print(f"\nhang watchdog on 4 nodes, --hang-timeout {args.timeout:g}s, {args.runs} runs (median):")
        t = args.timeout
        print(f"  hang -> report naming the stuck rank: {report:5.2f}s; baseline (the timeout itself) "
              f"{t:g}s; ratio {report / t:.2f}; overhead {report - t:5.2f}s")  # fmt: skip
        print(f"  report -> nothing of the job left on any node: {gone:5.2f}s")
        print(f"  stack methods used: {sorted({m for r in results for m in r['methods']})}")  # type: ignore[attr-defined]
    med = {k: statistics.median(v) for k, v in stacks.items()}
    print("\nevery rank's stack on 4 nodes (median):")
    for k, v in med.items():
        print(f"  {k:26} {v:5.2f}s")
    print(f"  ratio nodeops stacks / by hand: {med['nodeops stacks'] / med['ssh + py-spy dump by hand']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
