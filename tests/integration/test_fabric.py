"""`nodeops check --fabric` on the 3-node sandbox: real torchrun and gloo over the containers'
network, then one node's egress throttled with `tc tbf` (the sandbox gives its containers
NET_ADMIN), which must be named, alone, with exit 1.

Untested here: NCCL on GPUs (no GPU on this machine) and InfiniBand; their parsing is unit-tested
from NCCL's output format (tests/unit/node/test_fabric.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, SECRET
from .test_launch import CLEAN, controller_leftovers, no_leftovers_within

pytestmark = [pytest.mark.integration, pytest.mark.slow]
THROTTLE = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"]


def check_fabric(spec: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODEOPS, "check", str(spec), "--fabric", "--fabric-seconds", "12", *args],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "NODEOPS_IT_SECRET": SECRET, "COLUMNS": "200"})  # fmt: skip


def test_fabric_passes_healthy_nodes_then_names_the_throttled_one(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: subprocess.CompletedProcess[str]
) -> None:
    assert first_run.returncode == 0, first_run.stderr
    sb, spec = sandbox_cluster, project / "cluster.yaml"

    healthy = check_fabric(spec)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    out = healthy.stdout
    assert "fabric: all-reduce over all 3 rank(s) (gloo)" in out and "fabric: ok" in out, out
    assert "node pairs" in out and "eth0 (GLOO_SOCKET_IFNAME)" in out, out
    assert "[rank0]:fabric: gloo on 3 rank(s) over 3 node(s)" in healthy.stderr  # the probe's progress
    assert no_leftovers_within(sb, 10) == CLEAN

    node2 = next(n for n in sb.nodes if n.name == "node2")
    subprocess.run(["docker", "exec", node2.container, *THROTTLE], check=True, capture_output=True)
    try:
        slow = check_fabric(spec, "--json")
        # launch --fabric-check measures first (30 s budget) and starts nothing on a slow fabric
        gated = subprocess.run([NODEOPS, "launch", "--fabric-check", "--detach", str(spec), "train.py"],
                               capture_output=True, text=True, timeout=300, check=False,
                               env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
    finally:
        subprocess.run(["docker", "exec", node2.container, "tc", "qdisc", "del", "dev", "eth0", "root"], check=True)
    assert slow.returncode == 1, slow.stdout + slow.stderr
    doc = json.loads(slow.stdout)
    assert doc["status"] == "fail" and doc["exit_code"] == 1, doc
    assert all(r["status"] != "fail" for rows in doc["hosts"].values() for r in rows)  # the usual rows pass
    fab = doc["fabric"]
    assert fab["status"] == "fail" and fab["backend"] == "gloo" and fab["world"] == 3
    assert [n["name"] for n in fab["nodes"] if n["verdict"] != "ok"] == ["node2"], fab["nodes"]
    assert fab["nodes"][0]["name"] == "node2"  # slowest first
    assert len(fab["problems"]) == 1 and fab["problems"][0].startswith("node2: slow:"), fab["problems"]
    # node2's two ring pairs are slow, the third is not; node2 was measured again against the best node
    ring = [p for p in fab["pairs"] if not p["confirm"]]
    assert sorted(p["verdict"] for p in ring) == ["ok", "slow", "slow"], ring
    assert all("node2" in (p["a"], p["b"]) for p in ring if p["verdict"] == "slow")
    assert [(p["a"], p["verdict"]) for p in fab["pairs"] if p["confirm"]] == [("node2", "slow")]
    assert fab["elapsed"] < 60, fab["elapsed"]  # time-boxed: well under a minute on 3 nodes
    assert no_leftovers_within(sb, 10) == CLEAN
    assert controller_leftovers(fab["run_id"]) == []
    assert gated.returncode == 1, gated.stderr
    assert "--fabric-check failed (node2: slow:" in gated.stderr and "nothing was started" in gated.stderr
    assert gated.stdout == ""  # the report went to stderr; no run id: nothing was started
    assert gated.stderr.count(": starting torchrun on") == 1  # the measurement's run, not the job's
