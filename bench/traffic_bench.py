#!/usr/bin/env python3
"""Benchmark: the bytes a cold `nodeops setup` sends from the controller, against the cluster's
size, and the node-side install time of torch with uv against pip (issue 29).

For each N (default 1 3 8) a fresh sandbox of N sshd containers gets a cold setup of a spec with
a torch wheelhouse and a workdir. The chief passes both on to the other nodes (`mesh.relay`, the
default), so the controller's bytes should not grow with N. In the same run, a fresh sandbox of
the middle N gets the same cold setup with `mesh: {relay: false}` (each node from the controller,
as before): the baseline.

Bytes are counted two ways:

- controller: what this machine's own processes sent to the sandbox's subnet (an iptables rule
  in OUTPUT that only counts; it is removed at the end). This is the figure the goal is about;
- bridge: the Docker bridge's transmit counter, which also holds the nodes' apt downloads
  (NATed through this machine, as a cluster's own mirror would not be). Shown for reference.

Then, on the 1-node sandbox, torch and numpy are installed into two fresh venvs from the same
staged wheelhouse, one with uv and one with pip, and the node-side seconds are compared.

    sudo python bench/traffic_bench.py [--nodes 1 3 8] [--wheelhouse DIR]

The default wheelhouse is the integration tests' (.cache/wheelhouse-torch; `bash scripts/test.sh`
makes it), which holds torch 2.13.0 CPU, numpy, py-spy and uv.

Goal (issue 29): the controller's bytes for 8 nodes at most 1.2x those for 1 node.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nodeops.sandbox import cluster as sandbox  # noqa: E402

NAME = "traffic"
SUBNET = "10.219.0.0/24"
NODEOPS = [sys.executable, "-m", "nodeops"]
MiB = 2**20


class OutputCounter:
    """Bytes this machine's own processes send to ``subnet``: an iptables rule without a target
    (it only counts), inserted on entry and deleted on exit."""

    def __init__(self, subnet: str) -> None:
        self.tag = f"nodeops-traffic-bench-{os.getpid()}"
        self.rule = ["OUTPUT", "-d", subnet, "-m", "comment", "--comment", self.tag]

    def __enter__(self) -> OutputCounter:
        subprocess.run(["iptables", "-I", *self.rule], check=True, capture_output=True)
        return self

    def read(self) -> int:
        out = subprocess.run(["iptables", "-L", "OUTPUT", "-v", "-x", "-n"], check=True, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            if self.tag in line:
                return int(line.split()[1])
        raise RuntimeError(f"the counting rule {self.tag} is gone from OUTPUT")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["iptables", "-D", *self.rule], check=False, capture_output=True)


def make_project(work: Path) -> Path:
    project = work / "project"
    (project / "lib").mkdir(parents=True)
    (project / "train.py").write_text("print('train')\n")
    for i in range(20):
        (project / "lib" / f"m{i}.py").write_text(f"X = {i}\n" * 50)
    (project / "data.bin").write_bytes(os.urandom(8 * MiB))  # a workdir worth relaying
    return project


def spec_for(sb: sandbox.Sandbox, project: Path, wheels: Path, relay: bool) -> Path:
    spec = project.parent / f"cluster-{len(sb.nodes)}-{'relay' if relay else 'direct'}.yaml"
    spec.write_text(sb.spec_path.read_text() + (
        ("" if relay else "mesh: {relay: false}\n")
        + "env: {OMP_NUM_THREADS: 1}\n"
        f"python: {{packages: [torch, numpy], wheelhouse: {wheels}}}\n"
        f"workdir: {{path: /srv/traffic, source: {project}}}\n"
        "network: {ib: 'off'}\n"
    ))  # fmt: skip
    return spec


def cold_setup(
    n: int, project: Path, wheels: Path, relay: bool, env: dict[str, str], node_times: bool
) -> dict[str, Any]:
    label = f"{n} node(s), relay {'on' if relay else 'off'}"

    def say(m: str) -> None:
        print(f"==> [{label}] {m}", flush=True)

    sb = sandbox.up(name=NAME, n=n, subnet=SUBNET, say=say)
    try:
        spec = spec_for(sb, project, wheels, relay)
        subnet = sandbox.existing_subnet(NAME) or SUBNET
        with OutputCounter(subnet) as counter:
            c0, b0, t0 = counter.read(), sandbox.bytes_sent(NAME), time.perf_counter()
            p = subprocess.run([*NODEOPS, "setup", str(spec)], capture_output=True, text=True, env=env, check=False)
            wall = time.perf_counter() - t0
            ctl, bridge = counter.read() - c0, sandbox.bytes_sent(NAME) - b0
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        say(f"cold setup: rc={p.returncode}, {wall:.1f}s, controller {ctl / MiB:.1f} MiB, "
            f"bridge {bridge / MiB:.1f} MiB: {tail[0]}")  # fmt: skip
        if p.returncode != 0:
            print(p.stderr[-3000:])
        out: dict[str, Any] = {"rc": p.returncode, "wall": wall, "controller": ctl, "bridge": bridge}
        if node_times and p.returncode == 0:
            out["install"] = install_times(sb)
        return out
    finally:
        sandbox.down(NAME)


def install_times(sb: sandbox.Sandbox) -> dict[str, float]:
    """Node-side seconds to install torch and numpy into a fresh venv from the staged wheelhouse."""
    wh = "~/.nodeops/python_env/wheelhouse"
    commands = {
        "pip": f"/tmp/bench-pip/bin/python -m pip install -q --disable-pip-version-check --no-index --find-links {wh} "
        "torch numpy",
        "uv": f"~/.nodeops/python_env/uv/bin/uv pip install -q --no-cache --python /tmp/bench-uv/bin/python "
        f"--no-index --find-links {wh} torch numpy",
    }
    times: dict[str, float] = {}
    for name, cmd in commands.items():
        script = (f"set -e; rm -rf /tmp/bench-{name}; python3 -m venv /tmp/bench-{name}; s=$(date +%s.%N); {cmd}; "
                  f"e=$(date +%s.%N); rm -rf /tmp/bench-{name}; echo \"SECONDS $s $e\"")  # fmt: skip
        p = subprocess.run(["ssh", "-F", str(sb.ssh_config), sb.nodes[0].name, script], capture_output=True,
                           text=True, check=False)  # fmt: skip
        m = re.search(r"SECONDS (\S+) (\S+)", p.stdout)
        if p.returncode != 0 or not m:
            raise RuntimeError(f"{name} install failed on {sb.nodes[0].name}: {p.stderr[-2000:]}")
        times[name] = float(m.group(2)) - float(m.group(1))
        print(f"    node-side install of torch+numpy with {name}: {times[name]:.1f}s", flush=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 3, 8])
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / ".cache" / "wheelhouse-torch")
    args = ap.parse_args()
    if not list(args.wheelhouse.glob("torch-*.whl")):
        print(f"{args.wheelhouse} holds no torch wheel: pass --wheelhouse DIR (bash scripts/test.sh makes the default)")
        return 2
    if shutil.which("iptables") is None or os.geteuid() != 0:
        print("this bench counts the controller's bytes with an iptables rule: run it as root, with iptables")
        return 2
    size = sum(w.stat().st_size for w in args.wheelhouse.glob("*.whl"))
    # SIGTERM ends like Ctrl-C: the sandbox, the counting rule and the temp dirs are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ns = sorted(args.nodes)
    base_n = ns[len(ns) // 2]
    with tempfile.TemporaryDirectory(prefix="nodeops-traffic-") as tmp:
        project = make_project(Path(tmp))
        work = sum(f.stat().st_size for f in project.rglob("*") if f.is_file())

        def cold(n: int, relay: bool, node_times: bool) -> dict[str, Any]:
            # a home of its own per run: no setup record carries over, every run is cold
            home = Path(tmp) / f"home-{n}-{relay}"
            return cold_setup(n, project, args.wheelhouse, relay, dict(os.environ, NODEOPS_HOME=str(home)), node_times)

        relayed = {n: cold(n, True, node_times=n == ns[0]) for n in ns}
        direct = cold(base_n, False, node_times=False)
    print(f"\ntraffic: wheelhouse {size / MiB:.0f} MiB, workdir {work / MiB:.1f} MiB; MiB sent during a cold setup")
    print(f"{'run':26} {'controller':>11} {'vs 1st':>7} {'bridge':>9} {'wall s':>7}")
    first = relayed[ns[0]]
    for label, r in [*((f"{n} node(s), relay", relayed[n]) for n in ns), (f"{base_n} node(s), no relay", direct)]:
        flag = "" if r["rc"] == 0 else " FAILED"
        print(f"{label:26} {r['controller'] / MiB:11.1f} {r['controller'] / first['controller']:6.2f}x "
              f"{r['bridge'] / MiB:9.1f} {r['wall']:7.1f}{flag}")  # fmt: skip
    print("\ngoals (issue 29):")
    top = relayed[ns[-1]]
    ratio = top["controller"] / first["controller"]
    verdict = "ok" if ratio <= 1.2 else "MISSED"
    print(f"  controller bytes, {ns[-1]} nodes vs {ns[0]}: {ratio:.2f}x (goal <= 1.2x) {verdict}")
    base = relayed[base_n]["controller"]
    print(f"  relay vs no relay at {base_n} nodes (same run): {base / direct['controller']:.2f}x")
    if "install" in first:
        t = first["install"]
        ratio = t["uv"] / t["pip"]
        print(f"  node-side install of torch+numpy: uv {t['uv']:.1f}s, pip {t['pip']:.1f}s, uv/pip {ratio:.2f}x")
    failed = [r for r in [*relayed.values(), direct] if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
