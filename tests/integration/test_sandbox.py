"""The sandbox as a user meets it: real containers, real sshd, real ssh and Ansible."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nodeops.cli import app
from nodeops.sandbox import cluster as sandbox
from nodeops.spec.loading import load_spec

from .conftest import free_subnet, subnet_of

pytestmark = pytest.mark.integration


def ssh(sb: sandbox.Sandbox, host: str, *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-F", str(sb.ssh_config), "-o", "StrictHostKeyChecking=yes", *extra, host, *cmd],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_every_node_answers_ssh_with_sudo(sandbox_cluster: sandbox.Sandbox) -> None:
    sb = sandbox_cluster
    assert [n.name for n in sb.nodes] == ["node1", "node2", "node3"]
    for node in sb.nodes:
        p = ssh(sb, node.name, "hostname; id -un; sudo -n id -un")
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == [node.name, sandbox.USER, "root"]


def test_nodes_have_distinct_pinned_host_keys(sandbox_cluster: sandbox.Sandbox, tmp_path: Path) -> None:
    sb = sandbox_cluster
    known = (sb.state_dir / "known_hosts").read_text().splitlines()
    keys = {line.split()[2] for line in known if "ssh-ed25519" in line}
    assert len(keys) == 3, "every node must generate its own host key"
    # With an empty known_hosts the same ssh must refuse: host keys really are checked.
    empty = tmp_path / "known_hosts"
    empty.touch()
    p = ssh(sb, "node1", "true", extra=("-o", f"UserKnownHostsFile={empty}", "-o", "ControlPath=none"))
    assert p.returncode != 0
    assert "Host key verification failed" in p.stderr
    assert "StrictHostKeyChecking no" not in sb.ssh_config.read_text()


def test_generated_spec_is_valid_autodist(sandbox_cluster: sandbox.Sandbox) -> None:
    loaded = load_spec(sandbox_cluster.spec_path)
    assert loaded.warnings == []
    assert loaded.spec.chief.name == "node1"
    assert [n.address for n in loaded.spec.nodes] == [n.address for n in sandbox_cluster.nodes]
    assert oct(sandbox_cluster.state_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((sandbox_cluster.state_dir / "id_ed25519").stat().st_mode & 0o777) == "0o600"


def test_rendered_inventory_drives_real_ansible(sandbox_cluster: sandbox.Sandbox, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["render", str(sandbox_cluster.spec_path), "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    p = subprocess.run(
        [str(Path(sys.executable).parent / "ansible"), "-i", str(tmp_path / "inventory.yml"), "all",
         "-m", "ansible.builtin.command", "-a", "cat /etc/hostname", "--become"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    for host in ("node1", "node2", "node3"):
        assert f"{host} | CHANGED | rc=0 >>\n{host}" in p.stdout, p.stdout


def test_up_again_is_idempotent_and_fast(sandbox_cluster: sandbox.Sandbox) -> None:
    before = {n.container: n.address for n in sandbox_cluster.nodes}
    known_before = (sandbox_cluster.state_dir / "known_hosts").read_text()
    t = time.monotonic()
    sb = sandbox.up(name=sandbox_cluster.name, n=3, subnet=subnet_of(sandbox_cluster))
    assert {n.container: n.address for n in sb.nodes} == before
    assert (sb.state_dir / "known_hosts").read_text() == known_before
    p = ssh(sb, "node2", "grep", "-c", "nodeops-sandbox", ".ssh/authorized_keys")
    assert p.stdout.strip() == "1", "the key must not be appended twice"
    print(f"second up took {time.monotonic() - t:.1f}s")


def test_up_with_other_size_is_refused(sandbox_cluster: sandbox.Sandbox) -> None:
    with pytest.raises(sandbox.SandboxError, match="already has 3 node"):
        sandbox.up(name=sandbox_cluster.name, n=2, subnet=subnet_of(sandbox_cluster))


def _leftovers(name: str) -> tuple[str, str]:
    """Ids of containers and networks still labelled for sandbox ``name``."""
    found = [
        subprocess.run(["docker", *kind, "--filter", f"label={sandbox.LABEL}={name}", "-q"],
                       capture_output=True, text=True, check=True).stdout.strip()
        for kind in (["ps", "-a"], ["network", "ls"])
    ]  # fmt: skip
    return found[0], found[1]


def test_failed_up_removes_what_it_created(sandbox_cluster: sandbox.Sandbox) -> None:
    """The session sandbox holds its /24; asking for an overlapping /25 fails half-way."""
    name = "pytestfail"
    overlapping = subnet_of(sandbox_cluster).replace("/24", "/25")
    with pytest.raises(sandbox.SandboxError, match="network create"):
        sandbox.up(name=name, n=1, subnet=overlapping)
    assert _leftovers(name) == ("", "")
    assert not sandbox.state_dir(name).exists()
    # ... and the session sandbox is untouched
    assert all(n.state == "running" for n in sandbox.nodes(sandbox_cluster.name))


def test_cli_up_status_down_leaves_nothing(sandbox_cluster: sandbox.Sandbox) -> None:
    name = "pytestcli"
    runner = CliRunner()
    subnet = free_subnet("10.215.0.0/24")
    first = subnet.rsplit(".", 1)[0] + ".11"
    r = runner.invoke(app, ["sandbox", "up", "-n", "1", "--name", name, "--subnet", subnet])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(sandbox.state_dir(name) / "cluster.yaml")
    r = runner.invoke(app, ["sandbox", "status", "--name", name])
    assert r.exit_code == 0 and first in r.stdout and "running" in r.stdout
    r = runner.invoke(app, ["sandbox", "down", "--name", name])
    assert r.exit_code == 0 and "removed network nodeops-pytestcli" in r.stderr
    assert _leftovers(name) == ("", "")
    assert not sandbox.state_dir(name).exists()
    r = runner.invoke(app, ["sandbox", "status", "--name", name])
    assert r.exit_code == 1 and "no sandbox named" in r.stderr
    # the session sandbox was not touched by `down --name pytestcli`
    assert len(sandbox.nodes(sandbox_cluster.name)) == 3


def test_no_engine_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real docker CLI pointed at a socket where no engine listens."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    r = CliRunner().invoke(app, ["sandbox", "up", "-n", "1", "--name", "noengine"])
    assert r.exit_code == 1
    assert "no Docker engine answers" in r.stderr
