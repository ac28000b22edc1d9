"""Issue 14: `setup`, `check` and `launch` from an Ansible inventory instead of a spec, on the
sandbox: the inventory the sandbox writes of itself (plus a `nodeops` var with the project's
sections and `nodeops_gpus: auto`), and an executable dynamic-inventory script printing the same
hosts as JSON. The sandbox nodes have no NVIDIA GPU: discovery finds none and each runs 1 process
(the live path with GPUs is untested here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, SECRET
from .test_launch import CLEAN, leftovers

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent


def cli(*args: str | Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODEOPS, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "NODEOPS_IT_SECRET": SECRET, "COLUMNS": "200"})  # fmt: skip


def project_inventory(sb: sandbox.Sandbox, project: Path, path: Path) -> Path:
    """The sandbox's own inventory.yml, with the project spec's sections as the `nodeops` var."""
    inv = yaml.safe_load(sb.inventory_path.read_text())
    spec = yaml.safe_load((project / "cluster.yaml").read_text())
    sections = {k: spec[k] for k in ("name", "env", "python", "network") if k in spec}
    sections["workdir"] = {**spec["workdir"], "source": str(project)}  # a spec's default source is its own dir
    inv["all"]["vars"]["nodeops"] = sections
    inv["all"]["vars"]["nodeops_gpus"] = "auto"  # setup asks nvidia-smi; the sandbox nodes have none
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def ddp_hashes(out: str) -> list[tuple[str, str, str]]:
    return re.findall(r"^(node\d) \[rank(\d)\]:final param hash (\w+)$", out, re.M)


def test_setup_check_launch_from_the_sandbox_inventory_and_a_dynamic_script(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object, tmp_path: Path
) -> None:
    sb = sandbox_cluster
    assert sb.inventory_path.is_file()
    v = cli("validate", sb.inventory_path)  # the sandbox's inventory as written: the same nodes as its spec
    assert v.returncode == 0 and "valid: 3 node(s), chief" in v.stdout, v.stdout + v.stderr
    inv = project_inventory(sb, project, tmp_path / "inventory.yml")

    setup = cli("setup", inv)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert ("gpus: auto: node1: no NVIDIA GPU, 1 process, node2: no NVIDIA GPU, 1 process, node3: no NVIDIA GPU, "
            "1 process") in setup.stderr  # fmt: skip
    check = cli("check", inv)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert check.stdout.count("no NVIDIA GPU found at setup") == 3, check.stdout
    p = cli("launch", inv, "--", "ddp_train.py", "--steps", "3", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    hashes = ddp_hashes(p.stdout)
    assert sorted((h, r) for h, r, _ in hashes) == [("node1", "0"), ("node2", "1"), ("node3", "2")]
    assert len({d for _, _, d in hashes}) == 1

    # the same hosts from an executable dynamic inventory (ansible-inventory's JSON), one group
    listing = subprocess.run([BIN / "ansible-inventory", "-i", inv, "--list"], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    data = json.loads(listing)
    data["gpu"] = {"hosts": [n.name for n in sb.nodes[:2]]}  # a group of two of the three nodes
    data["all"]["children"].append("gpu")
    script = tmp_path / "dynamic_inventory.py"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint({json.dumps(json.dumps(data))})\n")
    script.chmod(0o755)
    p = cli("launch", script, "--group", "gpu", "--", "ddp_train.py", "--steps", "2", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted((h, r) for h, r, _ in ddp_hashes(p.stdout)) == [("node1", "0"), ("node2", "1")]
    assert leftovers(sb) == CLEAN

    # every problem at once, naming the host and variable, and nothing runs
    bad = tmp_path / "bad.yml"
    bad.write_text(inv.read_text().replace("ansible_port: 22", "ansible_port: twenty-two"))
    p = cli("setup", bad)
    assert p.returncode == 2 and re.search(r"bad\.yml:\d+:\d+: error: node\d: ansible_port:", p.stderr), p.stderr
