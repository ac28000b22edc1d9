"""What the sandbox benches share: the torch wheelhouse the demo makes, and a 4-node bench
project (a workdir with the bench's scripts, a venv from that wheelhouse) set up once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODEOPS = str(Path(sys.executable).parent / "nodeops")
WHEELS = ROOT / ".cache" / "wheelhouse-torch"  # scripts/demo.sh and the integration tests fill it


def need_wheels(*globs: str) -> None:
    """Exit with what to run when the wheelhouse lacks one of ``globs`` (e.g. ``torch-*.whl``)."""
    missing = [g for g in globs if not list(WHEELS.glob(g))]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} in {WHEELS}; run scripts/demo.sh once "
                         f"(or pip download torch==2.13.0 numpy py-spy -d {WHEELS})")  # fmt: skip


def set_up_project(sandbox_spec: Path, work: Path, files: dict[str, str], workdir: str = "/srv/bench") -> Path:
    """``files`` in work/project (the workdir's source), a spec for the bench sandbox with a venv
    (~/.venvs/bench: torch, numpy and, by setup's default, py-spy) and that workdir (/srv/bench;
    on a Slurm sandbox, a dir of the shared home); `nodeops setup` run on it (not timed).
    Returns the spec."""
    (work / "project").mkdir()
    for name, text in files.items():
        (work / "project" / name).write_text(text)
    spec = work / "cluster.yaml"
    spec.write_text(sandbox_spec.read_text() + (
        f"python: {{venv: ~/.venvs/bench, packages: ['torch==2.13.0', numpy], wheelhouse: {WHEELS}}}\n"
        f"workdir: {{path: {workdir}, source: {work / 'project'}}}\n"
        "network: {ib: 'off'}\nenv: {OMP_NUM_THREADS: 1}\n"
    ))  # fmt: skip
    print("==> nodeops setup (not timed)", flush=True)
    p = subprocess.run([NODEOPS, "setup", str(spec)], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"setup failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return spec


def sh(*argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
    p: subprocess.CompletedProcess[str] = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    return p


def time_in_marker(container: str, marker: str, seconds: float = 180, every: float = 0.05) -> float | None:
    """The time.time() a rank wrote into ``marker`` in a node container when it failed or hung
    on purpose (polled through docker exec), or None if none came within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = sh("docker", "exec", container, "cat", marker).stdout.strip()
        if got:
            return float(got)
        time.sleep(every)
    return None
