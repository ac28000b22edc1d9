#!/usr/bin/env python3
"""Benchmark: how setup, check and launch scale with the number of sandbox nodes.

For each N (default 1 4 8 16 32) a sandbox of N sshd containers is started and the same
spec is used throughout (a wheelhouse package, a workdir, env vars, ib off):

- cold setup: the first `nodeops setup` (venv, package install, workdir copy, env files);
- no-op setup: the second one, which must report 0 changes (the fast path: one read-only probe
  per node, no Ansible play);
- no-op, --full: the same no-op with `setup --full`, which runs every role through Ansible (what
  a no-op setup cost before the fast path), measured in the same run as the baseline;
- check: `nodeops check` (the full-mesh preflight);
- launch: `nodeops launch --no-check` of a trivial script, only with --torch-wheelhouse (torch
  must be installed for torchrun; without it the row says "not run").

Each step reports wall seconds and the controller's own CPU seconds (user+sys of every
process the step started on this machine, ansible and ssh included) per node. The nodes
share this machine's cores, so wall time at large N also measures the nodes' own work; the
controller CPU per node is what grows on a real cluster. Ratios are printed against the
1-node row and checked against issues 12 and 29's goals:

- no-op setup at 1 node <= 5 s; at 4 nodes <= 8 s; at 16 nodes <= 2x the 1-node time;
- cold setup at 8 nodes <= 2x the 1-node time;
- no-op setup <= 1.25x check at every N (a setup with nothing to do costs about one preflight).

    python bench/scale_bench.py [--nodes 1 4 8 16 32] [--torch-wheelhouse DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "scale"
SUBNET = "10.218.0.0/24"
NODEOPS = [sys.executable, "-m", "nodeops"]
FULL = "no-op, --full"


@dataclass
class Step:
    wall: float
    cpu: float
    rc: int
    tail: str
    stdout: str = ""
    stderr: str = ""


def timed(argv: list[str], env: dict[str, str]) -> Step:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (p.stdout + p.stderr).strip().splitlines()
    return Step(wall, cpu, p.returncode, lines[-1] if lines else "", p.stdout, p.stderr)


def check_verdict(step: Step, torch: bool) -> tuple[int, str]:
    """check's own verdict, except that without torch in the env (the default here: a small
    wheel) its torch rows fail by design; any other failing row is a failure."""
    try:
        doc = json.loads(step.stdout)
    except json.JSONDecodeError:
        return step.rc, step.tail
    failing = Counter(r["check"] for rows in doc["hosts"].values() for r in rows if r["status"] == "fail")
    other = {k: v for k, v in failing.items() if torch or k != "torch"}
    text = ", ".join(f"{k} x{v}" for k, v in failing.items()) or "none"
    return (1 if other else 0), f"failing rows: {text}" + ("" if torch else " (torch is expected: not installed)")


def make_project(work: Path, torch_wheelhouse: Path | None) -> Path:
    (work / "project").mkdir()
    (work / "project" / "train.py").write_text(
        "import os\nprint('rank', os.environ.get('RANK'), 'of', os.environ.get('WORLD_SIZE'))\n"
    )
    (work / "project" / "lib").mkdir()
    for i in range(20):
        (work / "project" / "lib" / f"m{i}.py").write_text(f"X = {i}\n" * 50)
    if torch_wheelhouse is not None:
        return torch_wheelhouse
    make_wheel = ROOT / "roles/python_env/molecule/default/make_wheel.py"
    subprocess.run([sys.executable, str(make_wheel), str(work / "wheels")], check=True, capture_output=True)
    return work / "wheels"


def spec_for(sb: sandbox.Sandbox, work: Path, wheels: Path, torch: bool) -> Path:
    pkgs = "[torch]" if torch else "[nodeops-probe==1.0]"
    spec = work / f"cluster-{len(sb.nodes)}.yaml"
    spec.write_text(sb.spec_path.read_text() + (
        "env: {OMP_NUM_THREADS: 1}\n"
        # py_spy: false: the bench's wheelhouse has no py-spy, and a tool setup could not install
        # is tried again by every setup (python_env runs): the bench measures a converged cluster
        f"python: {{packages: {pkgs}, wheelhouse: {wheels}, py_spy: false}}\n"
        f"workdir: {{path: /srv/scale, source: {work / 'project'}}}\n"
        "network: {ib: 'off'}\n"
    ))  # fmt: skip
    return spec


def run_n(n: int, work: Path, wheels: Path, torch: bool, env: dict[str, str]) -> dict[str, Step | None]:
    say = lambda m: print(f"==> [{n} node(s)] {m}", flush=True)  # noqa: E731
    sb = sandbox.up(name=NAME, n=n, subnet=SUBNET, say=say)
    try:
        spec = spec_for(sb, work, wheels, torch)
        out: dict[str, Step | None] = {}
        steps = [
            ("cold setup", [*NODEOPS, "setup", str(spec)], env),
            ("no-op setup", [*NODEOPS, "setup", str(spec)], env),
            (FULL, [*NODEOPS, "setup", str(spec), "--full"], env),
            ("check", [*NODEOPS, "check", str(spec), "--json"], env),
        ]
        for label, argv, step_env in steps:
            say(label)
            out[label] = s = timed(argv, step_env)
            if label == "check":
                s.rc, s.tail = check_verdict(s, torch)
            say(f"{label}: {s.wall:.1f}s wall, {s.cpu:.1f}s controller CPU, rc={s.rc}: {s.tail}")
            # why a setup ran Ansible where the fast path had nothing to do, and the probe's notes
            for line in s.stderr.splitlines() if label != "check" else ():
                if line.startswith(("note:", "warning:", "    ")) and "setup --full" not in line:
                    say(f"  {line.strip()}")
        if torch:
            say("launch")
            out["launch"] = s = timed([*NODEOPS, "launch", str(spec), "--no-check", "--", "train.py"], env)
            say(f"launch: {s.wall:.1f}s wall, {s.cpu:.1f}s controller CPU, rc={s.rc}: {s.tail}")
        else:
            out["launch"] = None
        return out
    finally:
        sandbox.down(NAME)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--torch-wheelhouse", type=Path, help="a wheelhouse holding torch: also time launch")
    args = ap.parse_args()
    # SIGTERM ends like Ctrl-C: the sandbox and the temp dir (the home included) are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[int, dict[str, Step | None]] = {}
    with tempfile.TemporaryDirectory(prefix="nodeops-scale-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, NODEOPS_HOME=str(work / "home"))  # its own: the user's setup records stay out
        wheels = make_project(work, args.torch_wheelhouse)
        for n in args.nodes:
            results[n] = run_n(n, work, wheels, args.torch_wheelhouse is not None, env)
    steps = ["cold setup", "no-op setup", FULL, "check", "launch"]
    base_n = min(results)
    print(f"\nscale, nodes {' '.join(map(str, results))} (wall s / controller CPU s per node / wall vs {base_n} node):")
    print(f"{'step':18} " + " ".join(f"{f'N={n}':>22}" for n in results))
    for step in steps:
        cells = []
        for n, r in results.items():
            s, base = r.get(step), results[base_n].get(step)
            if s is None:
                cells.append(f"{'not run':>22}")
                continue
            bad = "" if s.rc == 0 else "!"
            ratio = s.wall / base.wall if base is not None and base.wall else float("nan")
            cells.append(f"{s.wall:7.1f}{bad} {s.cpu / n:6.2f} {ratio:5.2f}x")
        print(f"{step:18} " + " ".join(cells))
    print("\ngoals (issues 12 and 29):")

    def wall(n: int, step: str) -> float | None:
        s = results.get(n, {}).get(step)
        return None if s is None or s.rc != 0 else s.wall

    def goal(text: str, value: float | None, limit: float, unit: str) -> None:
        if value is None:
            print(f"  {text}: not measured")
        else:
            print(f"  {text}: {value:.2f}{unit} (goal <= {limit:g}{unit}) {'ok' if value <= limit else 'MISSED'}")

    one = wall(1, "no-op setup")
    goal("no-op setup, 1 node", one, 5, " s")
    goal("no-op setup, 4 nodes", wall(4, "no-op setup"), 8, " s")
    n16 = wall(16, "no-op setup")
    goal("no-op setup, 16 nodes vs 1", n16 / one if n16 and one else None, 2, "x")
    c8, c1 = wall(8, "cold setup"), wall(1, "cold setup")
    goal("cold setup, 8 nodes vs 1", c8 / c1 if c8 and c1 else None, 2, "x")
    for n in results:
        noop, check = wall(n, "no-op setup"), wall(n, "check")
        goal(f"no-op setup vs check, {n} node(s)", noop / check if noop and check else None, 1.25, "x")
        full = wall(n, FULL)
        if noop and full:
            print(f"  no-op setup vs --full (the Ansible no-op), {n} node(s): {noop / full:.2f}x")
    failed = [(n, s) for n, r in results.items() for s, v in r.items() if v is not None and v.rc != 0]
    for n, s in failed:
        print(f"  FAILED: {s} at {n} node(s): {results[n][s].tail}")  # type: ignore[union-attr]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
