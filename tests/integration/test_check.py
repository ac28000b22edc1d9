"""`nodeops check` on the 3-node sandbox after setup: healthy, then one fault at a time on one
node, each undone afterwards. Real ssh (controller -> chief -> every node), real listeners and
connects, real torch in the venv.

Untested live here: GPU rows (no GPU; see tests/unit/check/test_check.py for the nvidia-smi parsing)
and a real second torch version (only torch 2.13.0's CPU wheel is available offline, so the
version fault edits torch/version.py on one node: a labelled fake, not a second install).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, SECRET, WORKDIR, ssh

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def check(spec: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    p = subprocess.run([NODEOPS, "check", str(spec), "--json", *args], capture_output=True, text=True, timeout=300,
                       check=False, env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else {}, p.stderr


def rows(doc: dict[str, Any], host: str, status: str | None = None) -> dict[str, str]:
    return {r["check"]: r["detail"] for r in doc["hosts"][host] if status is None or r["status"] == status}


def failing(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {h: f for h in doc["hosts"] if (f := rows(doc, h, "fail"))}


def dexec(sb: sandbox.Sandbox, host: str, command: str) -> None:
    node = next(n for n in sb.nodes if n.name == host)
    subprocess.run(["docker", "exec", node.container, "sh", "-c", command], check=True, capture_output=True)


@contextmanager
def fault(sb: sandbox.Sandbox, host: str, do: str, undo: str) -> Iterator[None]:
    dexec(sb, host, do)
    try:
        yield
    finally:
        dexec(sb, host, undo)


def test_healthy_cluster_is_all_ok(project: Path, first_run: object) -> None:
    code, doc, err = check(project / "cluster.yaml")
    assert code == 0, err + json.dumps(doc, indent=1)
    assert doc["status"] == "ok", json.dumps(doc, indent=1)
    assert doc["diff"] == {}
    for h in ("node1", "node2", "node3"):
        got = rows(doc, h, "ok")
        want = {"ssh", "port 29500", "python env", "torch", "interface", "clock", "workdir", "packages"}
        assert want - ({"packages"} if h == "node1" else set()) <= set(got), got  # the chief is the reference
        assert "2.13.0" in got["torch"]
        assert got["interface"].startswith("eth0")
    # the human form: one table per host and a summary line
    p = subprocess.run([NODEOPS, "check", str(project / "cluster.yaml")], capture_output=True, text=True,
                       timeout=300, check=False, env={**os.environ, "COLUMNS": "160"})  # fmt: skip
    assert p.returncode == 0
    assert "node3: ok" in p.stdout and "check: ok" in p.stdout  # the report is the output (stdout)


def test_sshd_stopped_on_a_node(sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object) -> None:
    with fault(sandbox_cluster, "node3", "kill $(cat /run/sshd.pid)", "/usr/sbin/sshd"):
        code, doc, err = check(project / "cluster.yaml")
    assert code == 1, err
    assert list(failing(doc)) == ["node3"], failing(doc)
    assert "Connection refused" in failing(doc)["node3"]["ssh"]


def test_master_port_blocked_on_the_chief(sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object) -> None:
    rule = "INPUT -p tcp --dport 29500 -j DROP"
    with fault(sandbox_cluster, "node1", f"iptables -I {rule}", f"iptables -D {rule}"):
        code, doc, err = check(project / "cluster.yaml")
    assert code == 1, err
    chief = sandbox_cluster.nodes[0].address
    for h in ("node2", "node3"):
        assert f"{chief}:29500 timed out" in failing(doc)[h]["port 29500"], failing(doc)
    assert all(set(f) == {"port 29500"} for f in failing(doc).values()), failing(doc)


def test_different_torch_on_one_node(sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object) -> None:
    # A labelled fake: torch/version.py edited to claim 2.12.0 (no second real wheel offline).
    ver = "$(ls -d /home/debian/.venvs/train/lib/python3*/site-packages/torch)/version.py"
    with fault(sandbox_cluster, "node2", f"sed -i.orig \"s/^__version__ = .*/__version__ = '2.12.0+cpu'/\" {ver}",
               f"mv {ver}.orig {ver}"):  # fmt: skip
        code, doc, err = check(project / "cluster.yaml")
    assert code == 1, err
    assert list(failing(doc)) == ["node2"], failing(doc)
    assert failing(doc)["node2"]["torch"].startswith("2.12.0+cpu here, 2.13.0+cpu on the chief node1")
    assert doc["diff"]["torch"] == {"node1": "2.13.0+cpu", "node2": "2.12.0+cpu", "node3": "2.13.0+cpu"}


def test_workdir_file_changed_on_one_node(sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object) -> None:
    cfg = f"{WORKDIR}/data/config.json"
    with fault(sandbox_cluster, "node3", f"cp {cfg} /tmp/c.bak && echo '{{\"lr\": 0.1}}' > {cfg}",
               f"cp /tmp/c.bak {cfg}"):  # fmt: skip
        code, doc, err = check(project / "cluster.yaml")
    assert code == 1, err
    assert list(failing(doc)) == ["node3"], failing(doc)
    # Compared with the controller's source (rsync mode), naming the file and the fix.
    detail = failing(doc)["node3"]["workdir"]
    assert f"differs from {project}" in detail and "1 file(s) differ from the source (data/config.json)" in detail
    assert "--tags shared_path" in detail and "--sync" in detail


def test_stale_workdir_is_refused_by_launch_until_synced(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    """Issue 17, item 9: after editing a file in the source, launch's preflight names the
    difference instead of running the old copy; `launch --sync` copies first, then runs."""
    train = project / "train.py"
    old = train.read_text()
    train.write_text("print('train v2')\n")
    try:
        p = subprocess.run([NODEOPS, "launch", str(project / "cluster.yaml"), "--", "train.py"],
                           capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
        assert p.returncode == 1, p.stderr
        assert "workdir: differs from" in p.stderr and "(train.py)" in p.stderr, p.stderr
        assert "nothing was started" in p.stderr
        p = subprocess.run([NODEOPS, "launch", str(project / "cluster.yaml"), "--sync", "--", "train.py"],
                           capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert "workdir synced" in p.stderr and "copied to node1, node2, node3" in p.stderr, p.stderr
        assert p.stdout.count("train v2") == 3, p.stdout
    finally:
        train.write_text(old)
        back = subprocess.run([NODEOPS, "setup", str(project / "cluster.yaml"), "--tags", "shared_path"],
                              capture_output=True, text=True, timeout=600, check=False,
                              env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
        assert back.returncode == 0, back.stderr  # later tests need the nodes to hold the source again


def test_venv_removed_on_one_node(sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object) -> None:
    venv = "/home/debian/.venvs/train"
    runs_before = ssh(sandbox_cluster, "node1", "ls ~/.nodeops/runs 2>/dev/null | wc -l").stdout.strip()
    with fault(sandbox_cluster, "node2", f"mv {venv} {venv}.away", f"mv {venv}.away {venv}"):
        code, doc, err = check(project / "cluster.yaml")
        # launch's fast preflight refuses too, and starts nothing
        p = subprocess.run([NODEOPS, "launch", str(project / "cluster.yaml"), "--", "train.py"],
                           capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
    assert code == 1, err
    assert list(failing(doc)) == ["node2"], failing(doc)
    assert "activate: No such file or directory" in failing(doc)["node2"]["python env"]
    assert p.returncode == 1 and "preflight failed on node2" in p.stderr, p.stderr
    assert "==> run" not in p.stderr  # nothing was started
    assert ssh(sandbox_cluster, "node1", "ls ~/.nodeops/runs 2>/dev/null | wc -l").stdout.strip() == runs_before


def test_missing_script_is_refused_before_anything_starts(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    """Issue 17, item 10: `launch -- nosuch.py` used to start torchrun everywhere and print three
    tracebacks; the preflight now names the missing file on every node and starts nothing."""
    runs_before = ssh(sandbox_cluster, "node1", "ls ~/.nodeops/runs 2>/dev/null | wc -l").stdout.strip()
    p = subprocess.run([NODEOPS, "launch", str(project / "cluster.yaml"), "--", "nosuch.py", "--lr", "1"],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "NODEOPS_IT_SECRET": SECRET})  # fmt: skip
    assert p.returncode == 1, p.stderr
    for host in ("node1", "node2", "node3"):
        assert f"{host}: script: {WORKDIR}/nosuch.py does not exist here" in p.stderr, p.stderr
    assert "nothing was started" in p.stderr and "Traceback" not in p.stderr + p.stdout
    assert ssh(sandbox_cluster, "node1", "ls ~/.nodeops/runs 2>/dev/null | wc -l").stdout.strip() == runs_before
