"""The Slurm backend on a real Slurm cluster: `nodeops sandbox up --slurm` (Debian's slurmctld,
slurmd and munge 22.05 in three containers; node1 the controller and login node; a shared home;
fake GPUs 2+1+1 through gres.conf). Real sbatch/srun/scancel, real torchrun with gloo on CPU.

Real GPUs, NCCL and a real NFS home are not here: the GPUs Slurm hands out are character devices
(CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE behave as on a GPU node; nothing opens them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeops.backends import store
from nodeops.sandbox import cluster as sandbox
from tests.integration.conftest import (
    DS_VERSION,
    LINGER,
    NODEOPS,
    ROOT,
    deepspeed_wheelhouse,
    one_group_stacks,
    own_sandbox,
)

NAME = f"pytestslurm{os.getpid()}"
SUBNET = "10.220.0.0/24"
WORKDIR = "/home/debian/slurm-it"  # in the shared home: every node sees what setup put there
HASH = re.compile(r"^(node\d) \[rank(\d+)\]:final param hash ([0-9a-f]+)$", re.M)
PLACED = re.compile(r"^(node\d) \[rank(\d+)\]:rank \d+/(\d+) on (node\d)", re.M)
# what a job leaves on a node if it is not stopped: the ranks, torchrun, srun and the step daemon
# (the hang watchdog and the stacks step's collector too)
LEFTOVER = re.compile(
    r"torch\.distributed\.run|ddp_train|sig_train|fabric\.py|srun |slurmstepd|watch\.py|stacks\.py"
    r"|mpirun|orted|mpi_split|deepspeed\.launcher|ds_train"
)

SIG_TRAIN = """import signal, sys, time
import torch.distributed as dist
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
dist.init_process_group("gloo")
r = dist.get_rank()
print(f"rank {r} waiting for the time-limit signal", flush=True)
t = time.monotonic()
while not got and time.monotonic() - t < 150:
    time.sleep(0.2)
print(f"rank {r} got {'SIGUSR1' if got else 'nothing'} after {time.monotonic() - t:.0f}s; checkpointing", flush=True)
# the last rank checkpoints for a while after the others are done: its node must not be cut short
time.sleep(8 if r == dist.get_world_size() - 1 else 0)
print(f"rank {r} checkpointed", flush=True)
sys.exit(0)
"""

# what each rank of a deepspeed run was given: its rank, world, local rank, argv and env
DS_TRAIN = """import json, os, socket, sys
import torch.distributed as dist
dist.init_process_group("gloo")
seen = {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": os.environ["LOCAL_RANK"],
        "host": socket.gethostname(), "argv": sys.argv[1:], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ds_env": os.environ.get("NODEOPS_IT_DS_ENV")}
print("seen " + json.dumps(seen, sort_keys=True), flush=True)
dist.barrier()
dist.destroy_process_group()
"""

# fails on its first run (the last rank exits 3), succeeds once requeued
# every rank prints its result and ends its script; then rank 1 dies of SIGABRT in the
# interpreter's teardown (as gloo's "terminate called without an active exception" kills one):
# an object whose __del__ aborts when the module's globals are cleared, after atexit ran
TEARDOWN_TRAIN = """import os
import torch.distributed as d

d.init_process_group("gloo")
rank = d.get_rank()
d.barrier()
d.destroy_process_group()


class Teardown:
    def __del__(self):
        if rank == 1:
            os.abort()


keep = Teardown()
print(f"rank {rank}: final result 42", flush=True)
"""
REQUEUE_TRAIN = """import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
restart = os.environ["NODEOPS_RESTART_COUNT"]
print(f"rank {r} restart {restart} attempt {os.environ['NODEOPS_ATTEMPT']}", flush=True)
dist.barrier()
if restart == "0" and r == n - 1:
    sys.exit(3)
dist.barrier()
print(f"rank {r} done", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[sandbox.Sandbox]:
    yield from own_sandbox(NAME, 3, SUBNET, slurm=True)


def nodeops(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODEOPS, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip


def write_spec(sb: sandbox.Sandbox, d: Path, name: str, slurm_extra: str = "") -> Path:
    text = sb.spec_path.read_text()
    if slurm_extra:
        text = text.replace("slurm:\n", "slurm:\n" + slurm_extra, 1)
    text += (
        "env:\n  OMP_NUM_THREADS: 1\n"
        # deepspeed too (runner deepspeed's test): one venv for every test, set up once
        f"python:\n  venv: ~/.venvs/train\n  packages: ['torch==2.13.0', 'deepspeed=={DS_VERSION}']\n"
        f"  wheelhouse: {deepspeed_wheelhouse()}\n"
        f"workdir:\n  path: {WORKDIR}\n"
        "network:\n  ib: 'off'\n"
    )
    spec = d / name
    spec.write_text(text)
    return spec


@pytest.fixture(scope="module")
def project(cluster: sandbox.Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project dir, set up on the cluster through the login node (`nodeops setup`)."""
    d = tmp_path_factory.mktemp("slurm-project")
    (d / "ddp_train.py").write_text((ROOT / "examples" / "ddp_train.py").read_text())
    (d / "sig_train.py").write_text(SIG_TRAIN)
    (d / "requeue_train.py").write_text(REQUEUE_TRAIN)
    (d / "teardown_train.py").write_text(TEARDOWN_TRAIN)
    (d / "linger.py").write_text(LINGER)
    write_spec(cluster, d, "requeue.yaml", "  max_requeues: 1\n")
    mpirun = write_spec(cluster, d, "mpirun.yaml")
    mpirun.write_text(mpirun.read_text() + "launch:\n  runner: mpirun\n")
    ds = write_spec(cluster, d, "ds.yaml")
    ds.write_text(ds.read_text() + "launch:\n  runner: deepspeed\n")
    (d / "ds_train.py").write_text(DS_TRAIN)
    spec = write_spec(cluster, d, "cluster.yaml")
    write_spec(cluster, d, "pending.yaml", "  sbatch_extra: {begin: now+8}\n")
    write_spec(cluster, d, "signal.yaml", "  signal: {name: USR1, seconds: 60}\n")
    # automatic restarts: 2 nodes and a spare, no GPUs asked for (a rank per node)
    restarts = write_spec(cluster, d, "restarts.yaml")
    text = re.sub(r"(?m)^  gpus: \d+\n", "", restarts.read_text())
    text = text.replace("  nodes: 3\n", "  nodes: 2\n  spare_nodes: 1\n")
    restarts.write_text(text + "launch:\n  restarts: 1\n  restart_backoff: 1\n")
    (d / "signal.yaml").write_text((d / "signal.yaml").read_text().replace("time: '00:30:00'", "time: '2'"))
    # no GPUs asked for: the sandbox's are fake, and the fabric probe would pick NCCL for them
    (d / "fabric.yaml").write_text(re.sub(r"(?m)^  gpus: \d+\n", "", spec.read_text()))
    p = nodeops("setup", str(spec), timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return d


def leftovers(sb: sandbox.Sandbox, timeout: float = 30) -> dict[str, list[str]]:
    """Each node's processes of a job, polled until there are none (Slurm's step daemons take a
    moment to go after the job's end) or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, list[str]] = {}
        for node in sb.nodes:
            ps = sandbox.docker("exec", node.container, "ps", "-eo", "pid,args", check=False)
            hits = [line.strip() for line in ps.splitlines() if LEFTOVER.search(line)]
            if hits:
                found[node.name] = hits
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_ddp_on_uneven_gpus_every_rank_agrees(cluster: sandbox.Sandbox, project: Path) -> None:
    t = time.monotonic()
    # no --attach: a launch follows its job to the end on Slurm as on ssh (the default)
    p = nodeops("launch", str(project / "cluster.yaml"), "--", "ddp_train.py", "--steps", "5")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    print(f"launch (attached by default) of a 5-step DDP job: {time.monotonic() - t:.1f}s")
    placed = PLACED.findall(p.stdout)
    # 2+1+1 fake GPUs: world size 4, torchrun starts 2 ranks on node1 and 1 on each other node
    assert sorted(int(r) for _, r, _, _ in placed) == [0, 1, 2, 3], p.stdout[-3000:]
    assert {w for _, _, w, _ in placed} == {"4"}
    per_node = {n: sum(1 for h, *_ in placed if h == n) for n in ("node1", "node2", "node3")}
    assert per_node == {"node1": 2, "node2": 1, "node3": 1}
    assert all(host == where for host, _, _, where in placed)  # the prefix names the rank's own node
    hashes = HASH.findall(p.stdout)
    assert len(hashes) == 4 and len({h for _, _, h in hashes}) == 1, hashes
    assert "COMPLETED" in p.stderr
    # the job's first step was the preflight, on every node of the allocation
    assert "nodeops: preflight ok on 3 node(s)" in p.stdout, p.stdout[-3000:]
    assert leftovers(cluster) == {}


def test_mpirun_on_slurm_every_rank_agrees_then_a_failing_rank_names_its_node(
    cluster: sandbox.Sandbox, project: Path
) -> None:
    """runner: mpirun: Open MPI's mpirun in the batch script, its daemons started through srun,
    one rank per GPU Slurm gave each node (2+1+1); each rank's lines land in its own node's log."""
    p = nodeops("launch", str(project / "mpirun.yaml"), "--", "ddp_train.py", "--steps", "5")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "nodeops: mpirun: 4 rank(s) on 3 node(s) (ranks per node: 2,1,1)" in p.stdout, p.stdout[-3000:]
    assert "nodeops: preflight ok on 3 node(s)" in p.stdout  # it found mpirun on every node
    placed = PLACED.findall(p.stdout)
    assert sorted(int(r) for _, r, _, _ in placed) == [0, 1, 2, 3], p.stdout[-3000:]
    assert {w for _, _, w, _ in placed} == {"4"}
    assert {n: sum(1 for h, *_ in placed if h == n) for n in ("node1", "node2", "node3")} == {
        "node1": 2, "node2": 1, "node3": 1}  # fmt: skip
    assert all(host == where for host, _, _, where in placed)  # the prefix names the rank's own node
    hashes = HASH.findall(p.stdout)
    assert len(hashes) == 4 and len({h for _, _, h in hashes}) == 1, hashes
    assert "nodeops: mpirun exited 0" in p.stdout and "COMPLETED" in p.stderr
    assert leftovers(cluster) == {}

    p = nodeops("launch", str(project / "mpirun.yaml"), "--", "ddp_train.py", "--steps", "200", "--sleep", "0.1",
                "--fail-rank", "2", "--fail-step", "3")  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    host = next(h for h, r, _, _ in PLACED.findall(p.stdout) if r == "2")
    assert f"nodeops: mpirun: first failure: rank 2 on {host} (exit code 1)" in p.stdout, p.stdout[-3000:]
    assert f"first failure on {host} (exit code 1)" in p.stderr, p.stderr[-3000:]
    assert f"{host} [rank2]:rank 2: failing on purpose at step 3" in p.stderr
    assert "mpirun stopped every other rank" in p.stderr
    st = nodeops("status")
    assert st.returncode == 1 and "FAILED" in st.stdout, st.stdout + st.stderr
    assert leftovers(cluster) == {}

    # Rank 1 (on node1, beside rank 0 and mpirun) drops its connections 0.3 s before it exits:
    # the others fail on the lost peer first and mpirun names one of them; the splitter names
    # rank 1 from the MPI shim's exit marks (protocol.py beside it in the run dir).
    p = nodeops("launch", str(project / "mpirun.yaml"), "--", "linger.py")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    named = re.findall(r"Process name: \[\[\d+,\d+\],(\d+)\]|process rank (\d+) with", p.stdout)
    print("the rank mpirun named:", named)  # most times here another rank; the test holds either way
    assert "nodeops: mpirun: first failure: rank 1 on node1 (exit code 1)" in p.stdout, p.stdout[-3000:]
    assert "first failure on node1 (exit code 1)" in p.stderr and "@@nodeops" not in p.stdout + p.stderr
    assert leftovers(cluster) == {}


def in_lines(out: str, pattern: str) -> list[tuple[str, str]]:
    """(host, match) of ``pattern`` anywhere in each `HOST | ...` line of launch's output. Under
    DeepSpeed the ranks of a node share its launcher's stdout (as over pdsh), and `print` writes
    its text and its newline apart: two ranks printing at once can share one line (seen in CI:
    `final param hash Xfinal param hash X`)."""
    return [(h, m) for h, rest in re.findall(r"^(node\d) \| (.*)$", out, re.M) for m in re.findall(pattern, rest)]


def test_deepspeed_on_slurm_runs_its_launcher_on_every_node_then_a_failing_rank_names_its_node(
    cluster: sandbox.Sandbox, project: Path
) -> None:
    """runner: deepspeed: one srun task per node runs DeepSpeed's per-node launcher, which gives
    each rank what DeepSpeed's pdsh runner would (RANK, LOCAL_RANK, WORLD_SIZE, --local_rank),
    one rank per GPU Slurm gave the node (2+1+1), and the workdir's .deepspeed_env."""
    ds_env = f"{WORKDIR}/.deepspeed_env"
    login = cluster.nodes[0].container
    sandbox.docker("exec", "-u", "debian", login, "sh", "-c", f"echo 'NODEOPS_IT_DS_ENV=from the workdir' > {ds_env}")
    try:
        p = nodeops("launch", str(project / "ds.yaml"), "--", "ds_train.py", "a b")
    finally:
        sandbox.docker("exec", login, "rm", "-f", ds_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "nodeops: deepspeed: 4 rank(s) on 3 node(s) (ranks per node: 2,1,1)" in p.stdout, p.stdout[-3000:]
    assert "nodeops: preflight ok on 3 node(s)" in p.stdout  # deepspeed found on every node, no pdsh asked for
    seen = [(h, json.loads(j)) for h, j in in_lines(p.stdout, r"seen (\{[^{}]*\})")]
    assert sorted(s["rank"] for _, s in seen) == [0, 1, 2, 3], p.stdout[-3000:]
    assert {s["rank"]: s["host"] for _, s in seen} == {0: "node1", 1: "node1", 2: "node2", 3: "node3"}
    for host, s in seen:
        assert s["host"] == host and s["world"] == 4, s
        assert s["argv"] == [f"--local_rank={s['local']}", "a b"], s  # the argument intact, after DeepSpeed's own
        assert s["ds_env"] == "from the workdir", s
    assert {s["host"]: s["cvd"] for _, s in seen} == {"node1": "0,1", "node2": "0", "node3": "0"}  # Slurm's ids
    assert "nodeops: srun exited 0" in p.stdout and "COMPLETED" in p.stderr
    assert leftovers(cluster) == {}

    p = nodeops("launch", str(project / "ds.yaml"), "--", "ddp_train.py", "--steps", "5")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    hashes = in_lines(p.stdout, r"final param hash ([0-9a-f]{16})")
    assert sorted(h for h, _ in hashes) == ["node1", "node1", "node2", "node3"], p.stdout[-3000:]
    assert len({d for _, d in hashes}) == 1, hashes
    assert leftovers(cluster) == {}

    p = nodeops("launch", str(project / "ds.yaml"), "--", "ddp_train.py", "--steps", "200", "--sleep", "0.1",
                "--fail-rank", "2", "--fail-step", "3")  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "first failure on node2 (exit code 1)" in p.stderr, p.stderr[-3000:]
    assert re.search(r"node2 .*rank 2: failing on purpose at step 3", p.stderr), p.stderr[-3000:]
    assert "srun stopped every other node's ranks" in p.stderr
    st = nodeops("status")
    assert st.returncode == 1 and "FAILED" in st.stdout, st.stdout + st.stderr
    assert leftovers(cluster) == {}


def test_a_node_without_the_workdir_ends_the_job_in_its_preflight_step(
    cluster: sandbox.Sandbox, project: Path, tmp_path: Path
) -> None:
    """The workdir is node-local here (sync: none), made by hand on node1 and node2 only: node3's
    task of the preflight step finds no workdir and no script there, and the job ends before srun
    starts torchrun anywhere. launch, status and the logs name node3 and the row."""
    wd = "/srv/preflight-it"
    for node in cluster.nodes:
        sandbox.docker("exec", node.container, "rm", "-rf", wd)
    for node in cluster.nodes[:2]:
        sandbox.docker("exec", node.container, "install", "-d", "-o", "debian", "-g", "debian", wd)
        sandbox.docker("exec", "-u", "debian", node.container, "cp", f"{WORKDIR}/ddp_train.py", wd)
    spec = tmp_path / "local-workdir.yaml"
    text = (project / "cluster.yaml").read_text()
    spec.write_text(text.replace(f"workdir:\n  path: {WORKDIR}\n", f"workdir:\n  path: {wd}\n  sync: none\n"))
    assert f"path: {wd}" in spec.read_text()
    p = nodeops("launch", str(spec), "--", "ddp_train.py", "--steps", "5")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"node3: workdir: {wd} does not exist" in p.stderr, p.stderr[-3000:]
    assert f"node3: script: {wd}/ddp_train.py does not exist here" in p.stderr, p.stderr[-3000:]
    assert "preflight failed on node3" in p.stderr and "no training rank was started" in p.stderr
    assert not PLACED.findall(p.stdout) and "[rank" not in p.stdout, p.stdout[-3000:]
    run_id = re.search(r"==> run (\S+): sbatch", p.stderr).group(1)  # type: ignore[union-attr]
    st = nodeops("status", run_id)
    assert st.returncode == 1 and "the preflight failed on node3 (workdir:" in st.stdout, st.stdout + st.stderr
    logs = nodeops("logs", run_id)
    assert "nodeops: preflight: node3: workdir:" in logs.stdout and "[rank" not in logs.stdout, logs.stdout
    for node in cluster.nodes:  # srun never ran torchrun: no rank's log dir anywhere
        ranks = sandbox.docker("exec", node.container, "sh", "-c", f"ls ~debian/.nodeops/runs/{run_id}/ranks "
                               "2>/dev/null || true", check=False)  # fmt: skip
        assert ranks.strip() == "", (node.name, ranks)
    assert leftovers(cluster) == {}
    # --no-check: the same job goes straight to torchrun (and fails there, on node3's missing dir)
    p = nodeops("launch", str(spec), "--no-check", "--", "ddp_train.py", "--steps", "5")
    assert p.returncode != 0 and "nodeops: preflight" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert leftovers(cluster) == {}
    for node in cluster.nodes:
        sandbox.docker("exec", node.container, "rm", "-rf", wd)


def test_check_probes_every_node_slurm_gives_in_one_srun_step(cluster: sandbox.Sandbox, project: Path) -> None:
    p = nodeops("check", str(project / "cluster.yaml"), "--json")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["status"] == "ok" and sorted(doc["hosts"]) == ["node1", "node2", "node3"]
    for rows in doc["hosts"].values():
        checks = {r["check"]: r["status"] for r in rows}
        assert checks["srun"] == "ok" and checks["torch"] == "ok" and checks["workdir"] == "ok", rows
    assert leftovers(cluster) == {}


THROTTLE = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"]


def test_check_fabric_on_slurm_passes_then_names_the_throttled_node(cluster: sandbox.Sandbox, project: Path) -> None:
    """`check --fabric` on Slurm: the node probe's srun step, then the fabric probe as a job of its
    own (torchrun with gloo in one srun step; the nodes are named as Slurm names them), then
    node2's egress throttled with `tc tbf`: node2 is named, alone, exit 1. The sandbox's GPUs are
    fake, so the measuring spec asks for none (gloo); NCCL on real GPUs is untested here."""
    spec = project / "fabric.yaml"
    assert "gpus:" not in spec.read_text()

    def check_fabric(*args: str) -> subprocess.CompletedProcess[str]:
        return nodeops("check", str(spec), "--fabric", "--fabric-seconds", "12", *args, timeout=400)

    healthy = check_fabric()
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    assert "fabric: all-reduce over all 3 rank(s) (gloo)" in healthy.stdout and "fabric: ok" in healthy.stdout
    assert "[rank0]:fabric: gloo on 3 rank(s) over 3 node(s)" in healthy.stderr, healthy.stderr[-3000:]
    assert re.search(r"==> run \S+: sbatch on login node node1 \(3 node\(s\); a measurement\)", healthy.stderr)
    assert leftovers(cluster) == {}

    node2 = next(n for n in cluster.nodes if n.name == "node2")
    sandbox.docker("exec", node2.container, *THROTTLE)
    try:
        slow = check_fabric("--json")
    finally:
        sandbox.docker("exec", node2.container, "tc", "qdisc", "del", "dev", "eth0", "root")
    assert slow.returncode == 1, slow.stdout[-3000:] + slow.stderr[-3000:]
    doc = json.loads(slow.stdout)
    assert all(r["status"] != "fail" for rows in doc["hosts"].values() for r in rows)  # the srun step's rows pass
    fab = doc["fabric"]
    assert fab["status"] == "fail" and fab["backend"] == "gloo" and fab["world"] == 3, fab
    assert sorted(n["name"] for n in fab["nodes"]) == ["node1", "node2", "node3"]  # Slurm's names
    assert [n["name"] for n in fab["nodes"] if n["verdict"] != "ok"] == ["node2"], fab["nodes"]
    assert len(fab["problems"]) == 1 and fab["problems"][0].startswith("node2: slow:"), fab["problems"]
    assert leftovers(cluster) == {}
    runs = {r["run_id"]: r for r in json.loads(nodeops("runs", "--json").stdout)}
    assert runs[fab["run_id"]]["state"] == "ok", runs[fab["run_id"]]  # the measuring job itself completed


def test_launch_fabric_check_on_slurm_measures_the_jobs_own_nodes_before_training(
    cluster: sandbox.Sandbox, project: Path
) -> None:
    """launch --fabric-check on Slurm: the measurement is a step of the job itself, before its
    training step, on the nodes of that allocation; judged on the batch node by the shipped
    gate. node2 throttled: the job ends there (exit 1, node2 named, no training rank); healthy:
    the training runs after it in the same job."""
    spec = project / "fabric.yaml"
    node2 = next(n for n in cluster.nodes if n.name == "node2")
    sandbox.docker("exec", node2.container, *THROTTLE)
    try:
        slow = nodeops("launch", "--fabric-check", str(spec), "--", "ddp_train.py", "--steps", "5", timeout=400)
    finally:
        sandbox.docker("exec", node2.container, "tc", "qdisc", "del", "dev", "eth0", "root")
    err = slow.stderr[-4000:]
    assert slow.returncode == 1, slow.stdout[-3000:] + err
    assert "the fabric check before training failed (node2: slow:" in err and "no training rank was started" in err
    assert "fabric: nodes (slowest first)" in slow.stderr  # the gate's report, printed as check prints it
    assert "nodeops: fabric: node2: slow:" in slow.stdout  # the batch log's line
    assert not PLACED.findall(slow.stdout), slow.stdout[-3000:]  # ddp_train never started
    assert "step 0" not in slow.stdout
    run_id = re.search(r"==> run (\S+): sbatch", slow.stderr).group(1)  # type: ignore[union-attr]
    st = nodeops("status", run_id)
    assert st.returncode == 1 and "the fabric check before training failed (node2: slow:" in st.stdout, st.stdout
    assert leftovers(cluster) == {}

    ok = nodeops("launch", "--fabric-check", str(spec), "--", "ddp_train.py", "--steps", "5", timeout=400)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    out = ok.stdout
    assert "nodeops: fabric: ok (3 rank(s), gloo" in out, out[-3000:]
    assert out.index("nodeops: fabric: ok") < out.index("final param hash")  # the check came first, same job
    hashes = HASH.findall(out)
    assert len(hashes) == 3 and len({h for _, _, h in hashes}) == 1, hashes
    assert len(set(re.findall(r"==> submitted Slurm job (\d+)", ok.stderr))) == 1  # one job, one allocation
    assert leftovers(cluster) == {}


def test_failing_rank_fails_the_job_and_names_its_host(cluster: sandbox.Sandbox, project: Path) -> None:
    p = nodeops("launch", str(project / "cluster.yaml"), "--attach", "--", "ddp_train.py", "--steps", "200",
                "--sleep", "0.1", "--fail-rank", "2", "--fail-step", "3")  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    # the host of rank 2 as the run itself placed it (SLURM_PROCID and torch's rank differ in general)
    host = next(h for h, r, _, _ in PLACED.findall(p.stdout) if r == "2")
    assert f"first failure on {host} (exit code 1)" in p.stderr, p.stderr[-3000:]
    assert f"{host} [rank2]:rank 2: failing on purpose at step 3" in p.stderr
    st = nodeops("status")
    assert st.returncode == 1 and "FAILED" in st.stdout, st.stdout + st.stderr
    assert leftovers(cluster) == {}


def test_a_job_that_finished_then_crashed_in_teardown_exits_3(cluster: sandbox.Sandbox, project: Path) -> None:
    """Every rank ended its script, then rank 1 aborted in its interpreter's teardown: the results
    are complete, and the run says so and exits failures.TEARDOWN_EXIT (3), as over ssh."""
    p = nodeops("launch", str(project / "cluster.yaml"), "--attach", "--", "teardown_train.py")
    out = p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 3, out
    assert len(re.findall(r"\[rank\d\]:rank \d: final result 42", p.stdout)) == 4, out
    assert re.search(r"==> run \S+ finished its work, then crashed in teardown: every rank's script ended, then a "
                     r"rank on node\d died \(exit code \d+\); the results are complete; exit 3",
                     p.stderr), out  # fmt: skip
    run_id = re.search(r"==> run (\S+): sbatch", p.stderr).group(1)  # type: ignore[union-attr]
    runs = {r["run_id"]: r for r in json.loads(nodeops("runs", "--json").stdout)}
    assert runs[run_id]["exit_code"] == 3, runs[run_id]
    assert leftovers(cluster) == {}


def completed_status(run_id: str, within: float = 60) -> subprocess.CompletedProcess[str]:
    """`status` once Slurm has completed the job: a job whose batch script has ended and left its
    result is "ended (exit N); Slurm is still completing it" while Slurm runs its epilog and
    releases the nodes (seconds on a healthy cluster, more on a loaded machine)."""
    deadline = time.monotonic() + within
    st = nodeops("status", run_id)
    while "still completing" in st.stdout and time.monotonic() < deadline:
        assert st.returncode == 0 and re.search(r"^job \d+ +ended \(exit 0\); Slurm is still completing",
                                                st.stdout, re.M), st.stdout + st.stderr  # fmt: skip
        time.sleep(1)
        st = nodeops("status", run_id)
    return st


def test_status_pending_running_completed_and_logs_follow(cluster: sandbox.Sandbox, project: Path) -> None:
    p = nodeops("launch", "--detach", str(project / "pending.yaml"), "--", "ddp_train.py", "--steps", "5")
    assert p.returncode == 0, p.stderr
    run_id = p.stdout.strip()
    seen: list[str] = []  # each status line, when it changed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("RUNNING" in s for s in seen):
        st = nodeops("status", run_id)
        assert st.returncode == 0, st.stdout + st.stderr
        if not seen or seen[-1] != st.stdout:
            seen.append(st.stdout)
        time.sleep(0.3)
    assert "PENDING (BeginTime)" in seen[0], seen
    assert any("RUNNING on node[1-3]" in s for s in seen), seen
    f = nodeops("logs", run_id, "-f")  # a new process follows the job to its end
    assert f.returncode == 0, f.stdout[-2000:] + f.stderr[-2000:]
    assert len(HASH.findall(f.stdout)) == 4
    st = completed_status(run_id)
    assert st.returncode == 0 and "COMPLETED" in st.stdout, st.stdout
    assert leftovers(cluster) == {}


def test_stop_cancels_a_running_job(cluster: sandbox.Sandbox, project: Path) -> None:
    p = nodeops(
        "launch", "--detach", str(project / "cluster.yaml"), "--", "ddp_train.py", "--steps", "5000", "--sleep", "0.1"
    )
    run_id = p.stdout.strip()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "step 3 " not in nodeops("logs", run_id).stdout:
        time.sleep(1)
    assert "RUNNING" in nodeops("status", run_id).stdout
    t = time.monotonic()
    s = nodeops("stop", run_id)
    assert s.returncode == 0, s.stdout + s.stderr
    assert "CANCELLED" in s.stdout
    assert leftovers(cluster) == {}
    print(f"stop latency until no process of the job is left on any node: {time.monotonic() - t:.1f}s")
    st = nodeops("status", run_id)
    assert st.returncode == 1 and "CANCELLED" in st.stdout


def test_ctrl_c_on_attached_launch_cancels_the_job(cluster: sandbox.Sandbox, project: Path) -> None:
    proc = subprocess.Popen([NODEOPS, "launch", str(project / "cluster.yaml"), "--attach", "--", "ddp_train.py",
                             "--steps", "5000", "--sleep", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 3 " in line:
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "cancelled" in stderr and "CANCELLED" in stderr
    assert leftovers(cluster) == {}


def run_dir_listing(sb: sandbox.Sandbox, run_id: str) -> list[str]:
    """The run dir on the shared home, as the login node sees it."""
    home = WORKDIR.rsplit("/", 1)[0]
    return sandbox.docker("exec", sb.nodes[0].container, "ls", "-A", f"{home}/.nodeops/runs/{run_id}").split()


def test_hang_watchdog_on_slurm_names_the_stuck_rank_and_ends_the_job(cluster: sandbox.Sandbox, project: Path) -> None:
    """Rank 3 blocks forever at step 3 while the others wait for it in all_reduce: the watchdog
    beside the training step (on the batch node) takes every rank's stack in an srun --overlap
    step, names rank 3 and its node, and ends the step; launch exits 124."""
    t0 = time.monotonic()
    p = nodeops("launch", str(project / "cluster.yaml"), "--hang-timeout", "20", "--", "ddp_train.py", "--steps",
                "1000", "--sleep", "0.2", "--hang-rank", "3", "--hang-step", "3", timeout=400)  # fmt: skip
    took = time.monotonic() - t0
    err = p.stderr[-4000:]
    assert p.returncode == 124, p.stdout[-3000:] + err
    node_of = {r: where for _, r, _, where in PLACED.findall(p.stdout)}
    assert sorted(node_of) == ["0", "1", "2", "3"], p.stdout[-3000:]
    assert re.search(r"HUNG: no rank showed progress for \d+s \(hang timeout 20s\)", err), err
    assert re.search(rf"stuck: rank 3 \({node_of['3']}\): stuck_forever \(ddp_train\.py:\d+\)", err), err
    assert re.search(r"the others: ranks 0-2 \([^)]*\): all_reduce \(", err), err
    # the stall watch named rank 3 first, within seconds, without stopping anything
    stall = re.search(r"==> stall: rank 3 \((node\d)\) has made no progress for \d+s, in stuck_forever", p.stderr)
    assert stall is not None and stall.group(1) == node_of["3"], p.stderr[-6000:]
    assert stall.start() < p.stderr.index("HUNG: no rank showed progress"), p.stderr[-6000:]
    assert "nodeops: hang: stopping the training step" in p.stdout  # the batch log, streamed
    run_id = re.search(r"==> run (\S+): sbatch", p.stderr).group(1)  # type: ignore[union-attr]
    hang = json.loads((store.jobs_dir() / run_id / "stacks" / "hang.json").read_text())  # (NODEOPS_HOME, if set)
    assert sorted(d["rank"] for d in hang["dumps"]) == [0, 1, 2, 3], hang["dumps"]
    assert {d["host"] for d in hang["dumps"]} == {"node1", "node2", "node3"}
    assert all(d["method"] in ("py-spy", "signal") for d in hang["dumps"]), hang["dumps"]
    assert leftovers(cluster) == {}
    runs = {r["run_id"]: r for r in json.loads(nodeops("runs", "--json").stdout)}
    assert (runs[run_id]["state"], runs[run_id]["exit_code"]) == ("hung", 124), runs[run_id]
    st = nodeops("status", run_id)
    assert st.returncode == 1 and "rank 3 stuck in stuck_forever" in st.stdout, st.stdout + st.stderr
    methods = sorted({d["method"] for d in hang["dumps"]})
    print(f"Slurm hang watchdog: launch returned after {took:.0f}s; methods {methods}")


def test_stacks_of_a_running_slurm_job_then_of_an_ended_one(cluster: sandbox.Sandbox, project: Path) -> None:
    p = nodeops("launch", "--detach", str(project / "cluster.yaml"), "--", "ddp_train.py", "--steps", "1000",
                "--sleep", "1.0")  # fmt: skip
    assert p.returncode == 0, p.stderr
    run_id = p.stdout.strip()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = nodeops("logs", run_id).stdout
            if len(PLACED.findall(logs)) >= 4 and "step 1 " in logs:
                break
            time.sleep(1)
        for method in ("auto", "signal"):  # signal: the no-ptrace path, forced
            for _ in range(3):  # the ranks spend ~all their time in the same sleep: one group, nearly always
                s = nodeops("stacks", run_id, "--json", "--method", method)
                assert s.returncode == 0, s.stdout + s.stderr
                doc = json.loads(s.stdout)
                assert sorted(int(r) for r in doc["methods"]) == [0, 1, 2, 3], doc
                assert {m["host"] for m in doc["methods"].values()} == {"node1", "node2", "node3"}
                if len(doc["groups"]) == 1:
                    break
            assert len(doc["groups"]) == 1, doc["groups"]
            assert doc["groups"][0]["frames"][0]["func"] == "main", doc["groups"][0]
            if method == "signal":
                assert {m["method"] for m in doc["methods"].values()} == {"signal"}
        one_group_stacks(lambda: nodeops("stacks", run_id), "0-3")
        assert not [n for n in run_dir_listing(cluster, run_id) if n.startswith("stacks-out")]
    finally:
        nodeops("stop", run_id)
    assert leftovers(cluster) == {}
    done = nodeops("stacks", run_id)
    assert done.returncode == 2 and f"run {run_id} has no live rank" in done.stderr, done.stdout + done.stderr


@pytest.mark.slow
def test_time_limit_signal_reaches_the_training_script(cluster: sandbox.Sandbox, project: Path) -> None:
    # --time=2 (minutes) and --signal=B:USR1@60: Slurm sends it 60-90 s before the limit
    p = nodeops("launch", str(project / "signal.yaml"), "--attach", "--", "sig_train.py", timeout=240)
    got = re.findall(r"^node\d \[rank(\d+)\]:rank \d+ got SIGUSR1", p.stdout, re.M)
    assert sorted(got) == ["0", "1", "2", "3"], p.stdout[-3000:] + p.stderr[-3000:]
    # every rank finished its checkpoint: a node whose torchrun ended first did not make srun's
    # --kill-on-bad-exit stop the others (it used to: a CI run lost a rank that way)
    done = re.findall(r"^node\d \[rank(\d+)\]:rank \d+ checkpointed", p.stdout, re.M)
    assert sorted(done) == ["0", "1", "2", "3"], p.stdout[-3000:] + p.stderr[-3000:]
    assert "SIGUSR1 (the time limit is near): forwarding it to torchrun" in p.stdout
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # the run did not finish
    assert "got SIGUSR1 before its time limit" in p.stderr
    assert leftovers(cluster) == {}


@pytest.mark.slow
def test_a_requeued_job_tells_its_ranks_the_restart_and_shows_each_attempt(
    cluster: sandbox.Sandbox, project: Path
) -> None:
    # max_requeues: 1; the first run fails (rank 3 exits 3), the batch script requeues the job, and
    # its second run (the same job id) finishes
    p = nodeops("launch", str(project / "requeue.yaml"), "--", "requeue_train.py", timeout=480)
    out = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, out
    assert len(set(re.findall(r"submitted Slurm job (\d+)", p.stderr))) == 1, out
    second = re.findall(r"^node\d \[rank(\d+)\]:rank \d+ restart 1 attempt 2$", p.stdout, re.M)
    assert sorted(second) == ["0", "1", "2", "3"], out
    assert re.search(r"^node\d \[rank3\]:rank 3 restart 0 attempt 1$", p.stdout, re.M), out
    assert sorted(re.findall(r"^node\d \[rank(\d+)\]:rank \d+ done$", p.stdout, re.M)) == ["0", "1", "2", "3"], out
    assert "==> 2 attempt(s) of job" in p.stderr, out
    assert re.search(r"attempt 1 on node\[1-3\]: exit [1-9]\d*, requeued", p.stderr), out
    assert "attempt 2 on node[1-3]: exit 0, not requeued" in p.stderr, out
    run_id = re.search(r"==> run (\S+): sbatch", p.stderr).group(1)  # type: ignore[union-attr]
    st = completed_status(run_id)
    assert st.returncode == 0 and "COMPLETED" in st.stdout, st.stdout + st.stderr
    assert re.search(r"attempt 1 on node\[1-3\]: exit [1-9]\d*, requeued\n.*attempt 2 on node\[1-3\]: exit 0",
                     st.stdout), st.stdout  # fmt: skip
    assert leftovers(cluster) == {}


HASH = re.compile(r"^(node\d) \[rank(\d)\]:final param hash ([0-9a-f]{16})$", re.M)


def test_a_killed_node_is_replaced_by_the_spare_inside_the_allocation(cluster: sandbox.Sandbox, project: Path) -> None:
    """launch.restarts on Slurm: node2's container killed mid-run (after rank 0's first
    checkpoint); the batch node names it lost, excludes it and restarts on node1 and the spare
    node3 in the same allocation, resuming from the checkpoint. Kills node2 for good: keep it the
    module's last test (the module's sandbox goes with it)."""
    spec = project / "restarts.yaml"
    train = ["ddp_train.py", "--steps", "60", "--sleep", "0.25"]
    ref = nodeops("launch", str(spec), "--", *train, timeout=300)  # no fault: one attempt, as without restarts
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    want = {h for _, _, h in HASH.findall(ref.stdout)}
    assert len(HASH.findall(ref.stdout)) == 2 and len(want) == 1, ref.stdout[-2000:]
    assert "attempt(s) of job" not in ref.stderr, ref.stderr[-2000:]

    proc = subprocess.Popen([NODEOPS, "launch", str(spec), "--", *train, "--checkpoint", "slurm.pt"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not _exists(cluster, f"{WORKDIR}/slurm.pt"):
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.3)
        time.sleep(1)
        subprocess.run(["docker", "kill", cluster.nodes[1].container], check=True, capture_output=True)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=480)
        print(f"launch returned {time.monotonic() - killed:.1f}s after node2 was killed")
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-4000:]
    assert re.search(r"attempt 1/2 on node1,node2: failed \(lost on node2: .*\); node2 excluded; spare node3 "
                     r"takes its place", err), err[-4000:]  # fmt: skip
    assert "attempt 2/2 on node1,node3: finished, every rank exited 0" in err, err[-4000:]
    last = out[out.rindex("==> nodeops: attempt 2/2") :] if "==> nodeops: attempt 2/2" in out else out
    got = {(host, rank): h for host, rank, h in HASH.findall(last)}
    # the spare ran rank 1; the last attempt's ranks end with the uninterrupted run's parameters
    assert set(got) == {("node1", "0"), ("node3", "1")} and set(got.values()) == want, (got, want)
    assert re.search(r"^node1 \[rank0\]:resumed from slurm\.pt at step \d+$", out, re.M), out[-3000:]
    run_id = re.search(r"==> run (\S+): sbatch", err).group(1)  # type: ignore[union-attr]
    st = nodeops("status", run_id)
    # Slurm holds the job COMPLETING until it sets the lost node down (SlurmdTimeout, 300 s here)
    assert st.returncode == 0 and re.search(r"^job \d+ +(COMPLETED|ended \(exit 0\))", st.stdout), st.stdout
    assert "attempt 2/2 on node1,node3: finished" in st.stdout, st.stdout
    # the incident on the timeline, in offsets from node2's last heartbeat: the batch node named it
    # lost from its heartbeats (LOST_QUICK, 3 s, once node1's rank failed on the broken connection;
    # LOST_AFTER, 5 s, at most), not after srun's --wait (60 s) and 12 s more; then the goodput
    offsets = "; ".join(rf"{k} \+([\d.]+) s" for k in ("detected", "stopped", "preflight", "started", "training again"))
    m = re.search(rf"^  attempt 1 -> 2: lost on node2 at [\d:]+; {offsets}$", st.stdout, re.M)
    assert m is not None, st.stdout
    detected, stopped, _, started, again = (float(x) for x in m.groups())
    print(f"lost-node timeline: detected +{detected} s, stopped +{stopped} s, started +{started} s, "
          f"training again +{again} s")  # fmt: skip
    assert 2.5 <= detected <= 12 and stopped <= detected + 8 and started <= stopped + 10, st.stdout  # (1 s back-off)
    assert re.search(r"^  goodput \d+% of [\d.]+ s: lost .* to faults, .* to restarts$", st.stdout, re.M), st.stdout
    listed = json.loads(nodeops("runs", "--json").stdout)
    [row] = [r for r in listed if r["run_id"] == run_id]
    assert row["goodput"] is not None and 0 < row["goodput"]["goodput"] < 1 and row["goodput"]["faults"] > 0, row
    assert [a["kind"] for a in row["attempts"] if a.get("kind")] == ["lost"], row
    assert leftovers(cluster) == {}


def _exists(sb: sandbox.Sandbox, path: str) -> bool:
    return subprocess.run(["docker", "exec", sb.nodes[0].container, "test", "-s", path], capture_output=True,
                          check=False).returncode == 0  # fmt: skip
