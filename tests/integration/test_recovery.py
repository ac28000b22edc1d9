"""Automatic restarts (launch.restarts) on a 4-node sandbox of its own, node4 a spare: real
torchrun ranks (gloo, CPU) training examples/ddp_train.py with a checkpoint on rank 0, nodes
lost for real (`docker kill`), the chief's supervisor recovering with no help from the test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, ROOT, SECRET, own_sandbox, setup, wheelhouse
from .test_launch import HELPERS, controller_leftovers, leftovers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = f"pytestrec{os.getpid()}"
SUBNET = "10.222.0.0/24"
CLEAN = {"node1": [], "node2": [], "node3": [], "node4": []}
WORKDIR = "/srv/nodeops-rec"
TRAIN = ["ddp_train.py", "--steps", "40", "--sleep", "0.25"]
HASH = re.compile(r"^(node\d) \[rank(\d)\]:final param hash ([0-9a-f]{16})$", re.M)


@pytest.fixture(scope="module")
def rec() -> Iterator[sandbox.Sandbox]:
    yield from own_sandbox(NAME, 4, SUBNET)


@pytest.fixture(scope="module")
def spec(rec: sandbox.Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sandbox's spec with node4 a spare, 2 restarts after a 1 s back-off, set up once."""
    d = tmp_path_factory.mktemp("recovery")
    (d / "project").mkdir()
    shutil.copy(ROOT / "examples" / "ddp_train.py", d / "project" / "ddp_train.py")
    text = rec.spec_path.read_text().replace("    name: node4\n", "    name: node4\n    spare: true\n", 1)
    assert "spare: true" in text
    path = d / "cluster.yaml"
    path.write_text(text + (
        "env: {OMP_NUM_THREADS: 1}\n"
        f"python: {{venv: ~/.venvs/train, packages: ['torch==2.13.0', numpy], wheelhouse: {wheelhouse()}}}\n"
        f"workdir: {{path: {WORKDIR}, source: {d / 'project'}}}\n"
        "network: {ib: 'off'}\n"
        "launch: {restarts: 2, restart_backoff: 1}\n"
    ))  # fmt: skip
    p = setup(path)
    assert p.returncode == 0, p.stderr[-3000:]
    return path


def variant(spec: Path, name: str, *, launch: str, drop_spare: bool = False) -> Path:
    """The same cluster with another launch section (and, with drop_spare, without node4)."""
    text = re.sub(r"^launch: .*$", f"launch: {launch}", spec.read_text(), flags=re.M)
    if drop_spare:
        text = re.sub(r"  - address: \S+\n    name: node4\n    spare: true\n(    \S.*\n)*", "", text)
        assert "node4" not in text, text
    out = spec.parent / name
    out.write_text(text)
    return out


def nodeops(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODEOPS, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip


def start(spec: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([NODEOPS, "launch", str(spec), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def run_id_of(stderr: str) -> str:
    m = re.search(r"==> run (\S+): starting", stderr)
    assert m, stderr[-2000:]
    return m.group(1)


def kill_when_checkpointed(sb: sandbox.Sandbox, victim: str, checkpoint: str, seconds: float = 180) -> None:
    """docker kill the victim's container once rank 0 wrote its first checkpoint (mid-run)."""
    chief = sb.nodes[0].container
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if subprocess.run(["docker", "exec", chief, "test", "-s", f"{WORKDIR}/{checkpoint}"],
                          capture_output=True, check=False).returncode == 0:  # fmt: skip
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no checkpoint {checkpoint} within {seconds}s")
    time.sleep(1)
    node = next(n for n in sb.nodes if n.name == victim)
    subprocess.run(["docker", "kill", node.container], check=True, capture_output=True)


def revive(sb: sandbox.Sandbox, victim: str) -> None:
    node = next(n for n in sb.nodes if n.name == victim)
    subprocess.run(["docker", "start", node.container], check=True, capture_output=True)
    sandbox._wait_for_sshd(node.address, time.monotonic() + 60)


def hashes(stdout: str) -> dict[str, str]:
    return {f"{host} rank{rank}": h for host, rank, h in HASH.findall(stdout)}


def nothing_left(sb: sandbox.Sandbox, seconds: float = 15) -> dict[str, list[str]]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(leftovers(sb, HELPERS).values()):
        time.sleep(0.25)
    return leftovers(sb, HELPERS)


def test_a_killed_node_is_replaced_by_the_spare_and_the_run_ends_as_an_uninterrupted_one(
    rec: sandbox.Sandbox, spec: Path
) -> None:
    ref = nodeops("launch", str(spec), "--", *TRAIN)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = set(hashes(ref.stdout).values())
    assert len(hashes(ref.stdout)) == 3 and len(want) == 1, ref.stdout[-2000:]

    proc = start(spec, "--", *TRAIN, "--checkpoint", "spare.pt")
    try:
        kill_when_checkpointed(rec, "node3", "spare.pt")
        killed = time.monotonic()
        out, err = proc.communicate(timeout=300)
        print(f"launch returned {time.monotonic() - killed:.1f}s after node3 was killed")
    finally:
        proc.kill()
        revive(rec, "node3")
    assert proc.returncode == 0, err[-4000:]
    run_id = run_id_of(err)
    assert re.search(r"==> attempt 1/3 on node1,node2,node3: failed \(lost on node3: .*\); node3 excluded; "
                     r"spare node4 takes its node rank 2", err), err[-4000:]  # fmt: skip
    assert "==> attempt 2/3 on node1,node2,node4" in err, err[-4000:]
    got = hashes(out)
    # the spare ran rank 2; every rank of the last attempt ends with the uninterrupted run's parameters
    assert {k for k in got if k.endswith("rank2")} == {"node4 rank2"}, got
    assert len(got) == 3 and set(got.values()) == want, (got, want)
    assert re.search(r"^node1 \[rank0\]:resumed from spare\.pt at step \d+$", out, re.M), out[-3000:]
    assert re.search(r"finished: every host exited 0 \(2 attempt\(s\); faults: attempt 1: lost on node3 "
                     r"\(node3 excluded\)\)", err), err[-2000:]  # fmt: skip

    st = nodeops("status", run_id)
    assert st.returncode == 0, st.stdout + st.stderr
    assert "attempt 2/3 on node1,node2,node4: finished" in st.stderr, st.stderr
    assert re.search(r"^node3 .*\(excluded by a restart\)$", st.stdout, re.M), st.stdout
    logs = nodeops("logs", run_id).stdout
    assert "node4 | ==> nodeops: attempt 2/3 on node1,node2,node4 (node rank 2); after attempt 1: lost on node3" in logs
    runs = {r["run_id"]: r for r in json.loads(nodeops("runs", "--json").stdout)}
    assert [(a["attempt"], a["outcome"]) for a in runs[run_id]["attempts"]] == [(1, "failed"), (2, "ok")]
    assert runs[run_id]["attempts"][0]["excluded"] == ["node3"]
    assert nothing_left(rec) == CLEAN
    assert controller_leftovers(run_id) == []


def test_a_detached_run_recovers_with_no_controller_attached(rec: sandbox.Sandbox, spec: Path) -> None:
    p = nodeops("launch", "--detach", str(spec), "--", *TRAIN, "--checkpoint", "detached.pt")
    assert p.returncode == 0, p.stderr[-3000:]
    run_id = p.stdout.strip().splitlines()[-1]
    try:
        kill_when_checkpointed(rec, "node2", "detached.pt")
        deadline = time.monotonic() + 300
        st = nodeops("status", run_id)
        while time.monotonic() < deadline and "run " + run_id + ": finished" not in st.stderr:
            time.sleep(3)
            st = nodeops("status", run_id)
    finally:
        revive(rec, "node2")
    assert f"run {run_id}: finished: every job exited 0" in st.stderr, st.stdout + st.stderr
    assert "attempt 1/3 on node1,node2,node3: failed (lost on node2" in st.stderr, st.stderr
    assert "attempt 2/3 on node1,node4,node3: finished" in st.stderr, st.stderr
    logs = nodeops("logs", run_id).stdout
    assert len(set(re.findall(r"final param hash ([0-9a-f]{16})", logs))) == 1, logs[-3000:]
    assert nothing_left(rec) == CLEAN


def test_without_a_spare_the_run_goes_on_with_fewer_nodes(rec: sandbox.Sandbox, spec: Path) -> None:
    shrink = variant(spec, "shrink.yaml", launch="{restarts: 1, restart_backoff: 1, min_nodes: 2}", drop_spare=True)
    proc = start(shrink, "--", *TRAIN, "--checkpoint", "shrink.pt")
    try:
        kill_when_checkpointed(rec, "node3", "shrink.pt")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        revive(rec, "node3")
    assert proc.returncode == 0, err[-4000:]
    assert "node3 excluded; no spare left: going on with 2 node(s) (min_nodes 2)" in err, err[-4000:]
    assert "==> attempt 2/2 on node1,node2" in err, err[-4000:]
    assert re.search(r"^node2 \[rank1\]:rank 1/2 on node2 NODE_RANK=1 restart 1$", out, re.M), out[-3000:]
    assert len(hashes(out)) == 2 and len(set(hashes(out).values())) == 1, out[-2000:]
    assert nothing_left(rec) == CLEAN


def test_a_bug_in_the_script_is_not_restarted_under_infra_and_is_under_any(rec: sandbox.Sandbox, spec: Path) -> None:
    bug = ["--", "ddp_train.py", "--steps", "20", "--fail-rank", "all", "--fail-step", "2"]
    p = nodeops("launch", str(spec), *bug)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "attempt 2/" not in p.stderr
    assert re.search(r"attempt 1/3 on node1,node2,node3: failed \(script on node\d: .*\); no restart: the "
                     r"script's own error", p.stderr), p.stderr[-3000:]  # fmt: skip
    assert not any(line.startswith("node4 ") for line in p.stdout.splitlines())  # the spare never ran
    # What the guard reads when a rank dies of a signal after raising (gloo can abort it, exit
    # -6): the ranks' hook marked each rank's uncaught exception on every node.
    run_id = run_id_of(p.stderr)
    for node in rec.nodes[:3]:
        found = subprocess.run(["docker", "exec", node.container, "sh", "-c",
                                f"cat /home/*/.nodeops/runs/{run_id}/raised/*.txt"],
                               capture_output=True, text=True, check=False)  # fmt: skip
        assert re.fullmatch(r"RuntimeError: rank \d: a bug on every rank at step 2", found.stdout), found

    anyway = variant(spec, "any.yaml", launch="{restarts: 1, restart_on: any, restart_backoff: 1}")
    p = nodeops("launch", str(anyway), *bug)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "==> attempt 2/2 on node1,node2,node3" in p.stderr, p.stderr[-3000:]  # same nodes: nobody excluded
    verdict = re.search(r"FAILED: first failure on .*", p.stderr)
    assert verdict, p.stderr[-3000:]
    assert re.search(r"attempt 1/2 on node1,node2,node3: failed \(script on node\d: .*\); on the same nodes",
                     p.stderr), p.stderr[-3000:]  # fmt: skip
    assert re.search(r"attempt 2/2 on node1,node2,node3: failed \(script on node\d: .*\); no restart: no "
                     r"restart left \(1 used\)", p.stderr), p.stderr[-3000:]  # fmt: skip
    assert nothing_left(rec) == CLEAN


def test_stop_during_the_back_off_leaves_nothing_and_starts_nothing(rec: sandbox.Sandbox, spec: Path) -> None:
    slow = variant(spec, "slow.yaml", launch="{restarts: 1, restart_on: any, restart_backoff: 60}")
    p = nodeops("launch", "--detach", str(slow), "--", "ddp_train.py", "--steps", "20", "--fail-rank", "1",
                "--fail-step", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    run_id = p.stdout.strip().splitlines()[-1]
    chief = rec.nodes[0].container
    attempts = f"/home/{sandbox.USER}/.nodeops/runs/{run_id}/attempts.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = subprocess.run(["docker", "exec", chief, "cat", attempts], capture_output=True, text=True, check=False)
        if '"backoff"' in got.stdout:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the run never reached its back-off")
    t0 = time.monotonic()
    stop = nodeops("stop", run_id)
    print(f"stop during the back-off took {time.monotonic() - t0:.1f}s")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    st = nodeops("status", run_id)
    assert "stopped on request" in st.stderr and "stopped during the back-off" in st.stderr, st.stderr
    assert "attempt 2/" not in st.stderr
    for n in rec.nodes:  # nothing of a second attempt was made ready anywhere
        ls = subprocess.run(["docker", "exec", n.container, "ls", f"/home/{sandbox.USER}/.nodeops/runs/{run_id}"],
                            capture_output=True, text=True, check=False)  # fmt: skip
        assert "attempts" not in ls.stdout.split() and "attempt.env" not in ls.stdout.split(), (n.name, ls.stdout)
    assert nothing_left(rec) == CLEAN
