"""Integration fixtures: one real 3-node sandbox (sshd containers) per test session.

The tests talk to it with real ssh and real Ansible. If no Docker engine answers, the
session fails rather than skipping, unless NODEOPS_SKIP_INTEGRATION=1 says to skip on
purpose (never set in CI).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeops.sandbox import cluster as sandbox

ROOT = Path(__file__).resolve().parents[2]
NODEOPS = str(Path(sys.executable).parent / "nodeops")
WHEELHOUSE = ROOT / ".cache" / "wheelhouse-torch"
SECRET = "s3cr3t-" + hashlib.sha256(b"nodeops-it").hexdigest()[:12]
USER_KEY_LINE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIUserOwnKeyForTest user@laptop"
WORKDIR = "/srv/nodeops-it"

SESSION_NAME = f"pytest{os.getpid()}"
SESSION_SUBNET = "10.214.0.0/24"


def free_subnet(preferred: str) -> str:
    """``preferred`` if nothing on this machine overlaps it, else the next free /24 after it: a
    network left by a session that was killed (or one running beside this one) never fails ours."""
    return sandbox.free_subnet(sandbox.used_subnets(), start=preferred)


def subnet_of(sb: sandbox.Sandbox) -> str:
    """The subnet a fixture's sandbox got (tests derive addresses from it, never hard-code them)."""
    got = sandbox.existing_subnet(sb.name)
    assert got is not None, f"sandbox {sb.name} has no network"
    return got


def own_sandbox(name: str, n: int, subnet: str, slurm: bool = False) -> Iterator[sandbox.Sandbox]:
    """A sandbox of a fixture's own on ``subnet`` or the next free /24, removed after it
    (NODEOPS_SKIP_INTEGRATION=1 skips on purpose)."""
    if os.environ.get("NODEOPS_SKIP_INTEGRATION") == "1":
        pytest.skip("NODEOPS_SKIP_INTEGRATION=1")
    sandbox.ensure_engine()
    got = free_subnet(subnet)
    if got != subnet:
        print(f"{subnet} is taken on this machine; sandbox {name} uses {got}")
    sb = sandbox.up(name=name, n=n, subnet=got, say=print, slurm=slurm)
    try:
        yield sb
    finally:
        sandbox.down(name)


@pytest.fixture(scope="session", autouse=True)
def nodeops_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own NODEOPS_HOME (sandbox state, setup records, run records, setup's ssh
    control sockets): the tests neither write into the user's ~/.nodeops nor read what is there
    (test_molecule alone uses ~/.nodeops/sandbox/molecule, as molecule's shared config says)."""
    home = tmp_path_factory.mktemp("home")
    before = os.environ.get("NODEOPS_HOME")
    os.environ["NODEOPS_HOME"] = str(home)
    try:
        yield home
    finally:
        if before is None:
            os.environ.pop("NODEOPS_HOME", None)
        else:
            os.environ["NODEOPS_HOME"] = before


@pytest.fixture(scope="session")
def sandbox_cluster() -> Iterator[sandbox.Sandbox]:
    yield from own_sandbox(SESSION_NAME, 3, SESSION_SUBNET)


def wheelhouse() -> Path:
    """torch 2.13.0 (CPU, from this machine's pip cache), numpy (torch warns on import without
    it), py-spy (setup installs it by default, for `nodeops stacks`), uv (setup installs with it
    where it can) and their dependencies, downloaded once."""
    if not (WHEELHOUSE / ".complete-4").exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "torch==2.13.0", "numpy", "py-spy", "uv",
             "-d", str(WHEELHOUSE)],
            check=True, timeout=900,
        )  # fmt: skip
        (WHEELHOUSE / ".complete-4").touch()
    return WHEELHOUSE


def ssh(sb: sandbox.Sandbox, host: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(sb.ssh_config), host, command],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def setup(spec: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODEOPS, "setup", str(spec), *args], capture_output=True, text=True, timeout=1200,
                          check=False, env={**os.environ, "COLUMNS": "200", **(env or {})})  # fmt: skip


@pytest.fixture(scope="session")
def project(sandbox_cluster: sandbox.Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training project dir whose spec extends the sandbox's with every nodeops section."""
    d = tmp_path_factory.mktemp("project")
    (d / "train.py").write_text("print('train')\n")
    shutil.copy(ROOT / "examples" / "ddp_train.py", d / "ddp_train.py")
    (d / "linger.py").write_text(LINGER)  # test_launch's mpirun test
    (d / "data").mkdir()
    (d / "data" / "config.json").write_text('{"lr": 0.001}\n')
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    spec = sandbox_cluster.spec_path.read_text() + (
        "env:\n"
        "  OMP_NUM_THREADS: 1\n"
        "  IT_SECRET: {from_env: NODEOPS_IT_SECRET, secret: true}\n"
        "python:\n"
        "  venv: ~/.venvs/train\n"
        "  packages: ['torch==2.13.0', numpy]\n"  # py-spy: setup installs it by default
        f"  wheelhouse: {wheelhouse()}\n"
        "workdir:\n"
        f"  path: {WORKDIR}\n"
        "network:\n"
        "  ib: 'off'\n"
        "  nccl: {NCCL_DEBUG: WARN}\n"
    )
    (d / "cluster.yaml").write_text(spec)
    return d


@pytest.fixture(scope="session")
def first_run(sandbox_cluster: sandbox.Sandbox, project: Path) -> Iterator[subprocess.CompletedProcess[str]]:
    """Seed user-owned lines on the nodes, then run setup once."""
    sb = sandbox_cluster
    assert ssh(sb, "node2", f"printf '%s\\n' '{USER_KEY_LINE}' >> ~/.ssh/authorized_keys").returncode == 0
    before = ssh(sb, "node2", "cat ~/.ssh/authorized_keys").stdout
    t = time.monotonic()
    sent = sandbox.bytes_sent(sb.name)
    p = setup(project / "cluster.yaml", env={"NODEOPS_IT_SECRET": SECRET})
    print(f"first setup took {time.monotonic() - t:.1f}s")
    p.authorized_keys_before = before  # type: ignore[attr-defined]
    p.bytes_sent = sandbox.bytes_sent(sb.name) - sent  # type: ignore[attr-defined]
    listing = "cd ~/.nodeops/python_env/wheelhouse && stat -c '%n %s' *.whl"  # later specs restage it
    p.staged = {n.name: ssh(sb, n.name, listing).stdout for n in sb.nodes}  # type: ignore[attr-defined]
    yield p


DS_VERSION = "0.19.8"
DS_WHEELHOUSE = ROOT / ".cache" / f"wheelhouse-deepspeed-{DS_VERSION}"


def deepspeed_wheelhouse() -> Path:
    """torch 2.13.0 (CPU) + DeepSpeed and its dependencies, for nodes without internet.

    DeepSpeed ships only an sdist whose setup.py imports torch, so its wheel is built once (pure
    Python, DS_BUILD_OPS=0) in a scratch venv holding the CPU torch; its dependencies are then
    resolved with torch pinned to that wheel (an unpinned resolve pulls a multi-GB CUDA torch).
    """
    if (DS_WHEELHOUSE / ".complete").exists():
        return DS_WHEELHOUSE
    torch_wheels = wheelhouse()
    build = DS_WHEELHOUSE.with_name(DS_WHEELHOUSE.name + ".build")
    shutil.rmtree(build, ignore_errors=True)
    shutil.rmtree(DS_WHEELHOUSE, ignore_errors=True)
    DS_WHEELHOUSE.mkdir(parents=True)
    py = build / "venv" / "bin" / "python"
    run = {"check": True, "timeout": 900}
    subprocess.run([sys.executable, "-m", "venv", str(build / "venv")], **run)  # type: ignore[call-overload]
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", torch_wheels, "torch==2.13.0"],
                   **run)  # type: ignore[call-overload]  # fmt: skip
    subprocess.run([py, "-m", "pip", "install", "-q", "setuptools", "wheel"], **run)  # type: ignore[call-overload]
    subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"deepspeed=={DS_VERSION}", "-d", build], **run)  # type: ignore[call-overload]  # fmt: skip
    sdist = next(build.glob("deepspeed-*.tar.gz"))
    subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", sdist, "-w", DS_WHEELHOUSE],
                   env={**os.environ, "DS_BUILD_OPS": "0"}, **run)  # type: ignore[call-overload]  # fmt: skip
    wheel = next(DS_WHEELHOUSE.glob("deepspeed-*.whl"))
    subprocess.run([py, "-m", "pip", "download", "-q", "--find-links", torch_wheels, str(wheel), "torch==2.13.0",
                    "-d", DS_WHEELHOUSE], **run)  # type: ignore[call-overload]  # fmt: skip
    for w in torch_wheels.glob("*.whl"):  # one wheelhouse for the spec: hard links to torch's
        if not (DS_WHEELHOUSE / w.name).exists():
            os.link(w, DS_WHEELHOUSE / w.name)
    shutil.rmtree(build, ignore_errors=True)
    (DS_WHEELHOUSE / ".complete").touch()
    return DS_WHEELHOUSE


def one_group_stacks(stacks: Callable[[], subprocess.CompletedProcess[str]], ranks: str, tries: int = 5) -> str:
    """`nodeops stacks RUN` (human form, via ``stacks``) until it shows every rank (``ranks``,
    e.g. "0-2") in main of ddp_train.py as one group: the ranks spend ~all their time in the same
    sleep, but one caught outside it (in backward, say) is a second group. Returns the last stdout;
    the caller asserts on it."""
    one = re.compile(rf"^ranks {re.escape(ranks)} \(node1, node2, node3\): main \(ddp_train\.py:\d+\)", re.M)
    for _ in range(tries):
        p = stacks()
        assert p.returncode == 0, p.stdout + p.stderr
        if one.search(p.stdout):
            break
    assert one.search(p.stdout), p.stdout + p.stderr
    return p.stdout + p.stderr


# A training script whose rank 1 drops its connections and exits 1 only 0.3 s later: its peers
# fail on the lost peer first, and mpirun names one of them (test_launch, test_slurm). Rank 1
# ignores the SIGTERM of mpirun's teardown meanwhile, so that it ends with its own code (a rank
# the teardown ends first is named with 143, as it ended: seen on Slurm before it ignored it).
LINGER = """\
import signal, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(200):
    if dist.get_rank() == 1 and step == 3:
        print("rank 1: failing on purpose", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.destroy_process_group()  # no DDP holds it: its connections close now
        time.sleep(0.3)
        sys.exit(1)
    dist.all_reduce(t)
    time.sleep(0.05)
"""
