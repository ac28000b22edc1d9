"""Issue 13: the nodeops.cluster collection as an infra repo uses it, without the nodeops CLI.

The tarball is built and installed into a temporary collections path (ansible.posix comes from
the `ansible` package), and plain `ansible-playbook` runs against the sandbox with an INI
inventory: every role twice (the second run changes nothing), then the collection's launch
playbook: the DDP example with every rank agreeing, a failing rank tearing every host down, and
a detached run that `nodeops status/logs/stop` find from the playbook's record."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nodeops import _shell
from nodeops.launch import plan
from nodeops.node import agent, protocol, recovery, stacks, stall, supervisor
from nodeops.quoting import ansible_yaml
from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, ROOT, WORKDIR
from .test_launch import CLEAN, leftovers, no_leftovers_within

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent
ROLES = ["ssh_mesh", "python_env", "shared_path", "nccl_env", "deepspeed_env", "launch"]


def run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: int = 900) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False, env=env,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def collections(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built tarball, installed where an infra repo installs it (offline: ansible.posix is
    the one the `ansible` package bundles)."""
    d = tmp_path_factory.mktemp("collection")
    p = run(BIN / "ansible-galaxy", "collection", "build", "--output-path", d, ROOT, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    (tarball,) = d.glob("nodeops-cluster-*.tar.gz")
    p = run(BIN / "ansible-galaxy", "collection", "install", "--force", "--offline", "--no-deps", "-p",
            d / "collections", tarball, cwd=d)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return d / "collections"


def test_the_built_collection_carries_the_packages_bytes(collections: Path) -> None:
    """What the package imports and ships from the collection (its links, docs/design.md
    "Layout") arrives in the built and installed collection as the same bytes, not as a link."""
    installed = collections / "ansible_collections" / "nodeops" / "cluster"
    pairs = [(_shell, "plugins/module_utils/nodeops_shell.py"), (plan, "plugins/module_utils/nodeops_launch.py"),
             *((m, f"roles/launch/files/{m.__name__.rsplit('.', 1)[1]}.py")
               for m in (agent, protocol, recovery, stacks, stall, supervisor))]  # fmt: skip
    for module, rel in pairs:
        shipped = installed / rel
        assert shipped.is_file() and not shipped.is_symlink(), rel
        assert shipped.read_bytes() == Path(str(module.__file__)).read_bytes(), rel


def plain_env(collections: Path) -> dict[str, str]:
    """Only the installed collection (not this checkout, not ~/.ansible), JSON results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    return {**env, "ANSIBLE_COLLECTIONS_PATH": str(collections), "ANSIBLE_STDOUT_CALLBACK": "json",
            "ANSIBLE_FORKS": "10", "ANSIBLE_PIPELINING": "true", "NO_COLOR": "1"}  # fmt: skip


def inventory_ini(sb: sandbox.Sandbox, path: Path) -> Path:
    """The sandbox as an infra repo's INI inventory (pinned host keys through ssh args)."""
    sd = sb.state_dir
    lines = ["[trainers]"]
    for n in sb.nodes:
        lines.append(f"{n.name} ansible_host={n.address}")
    lines += ["", "[trainers:vars]", f"ansible_user={sandbox.USER}",
              f"ansible_ssh_private_key_file={sd / 'id_ed25519'}",
              f"ansible_ssh_common_args='-o UserKnownHostsFile={sd / 'known_hosts'}'"]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def playbook(collections: Path, inventory: Path, play: str | Path, vars_yaml: str = "",
             timeout: int = 900) -> tuple[subprocess.CompletedProcess[str], dict]:  # fmt: skip
    args: list[str | Path] = [BIN / "ansible-playbook", "-i", inventory, play]
    if vars_yaml:
        vf = inventory.with_name(f"vars-{abs(hash(vars_yaml))}.yml")
        vf.write_text(vars_yaml)
        args += ["-e", f"@{vf}"]
    p = run(*args, cwd=inventory.parent, env=plain_env(collections), timeout=timeout)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        out = {}
    return p, out


def failures(out: dict) -> list[str]:
    msgs = []
    for play in out.get("plays", []):
        for task in play["tasks"]:
            for host, r in task["hosts"].items():
                if r.get("failed") or r.get("unreachable"):
                    msgs.append(f"{host}: {task['task']['name']}: {r.get('msg', '')}")
    return msgs


SITE = """\
- name: Prepare the trainers with the nodeops.cluster roles
  hosts: trainers
  gather_facts: false
  roles:
    - role: nodeops.cluster.ssh_mesh
      ssh_mesh_cluster: plain
    - role: nodeops.cluster.python_env
      python_env_venv_path: ~/.nodeops/plain-venv
      python_env_check_consistency: true
    - role: nodeops.cluster.shared_path
      shared_path_path: /srv/nodeops-plain
      shared_path_source: {source}
    - role: nodeops.cluster.nccl_env
      nccl_env_cluster: plain
      nccl_env_ib: "off"
      nccl_env_vars: {{OMP_NUM_THREADS: "1"}}
    - role: nodeops.cluster.deepspeed_env
      deepspeed_env_cluster: plain
      deepspeed_env_install_pdsh: false
      deepspeed_env_hosts: {hosts}
"""


def test_every_role_from_the_installed_collection_then_again_with_no_change(
    sandbox_cluster: sandbox.Sandbox, collections: Path, tmp_path: Path
) -> None:
    env = plain_env(collections)
    for role in ROLES:  # every role documents its arguments where it is installed
        doc = run(BIN / "ansible-doc", "-t", "role", f"nodeops.cluster.{role}", env=env)
        assert doc.returncode == 0 and "ENTRY POINT: *main*" in doc.stdout, (role, doc.stderr)
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('plain')\n")
    inv = inventory_ini(sandbox_cluster, tmp_path / "inventory.ini")
    hosts = json.dumps([{"host": n.address, "slots": 1} for n in sandbox_cluster.nodes])
    (tmp_path / "site.yml").write_text(SITE.format(source=src, hosts=hosts))
    first, out = playbook(collections, inv, tmp_path / "site.yml")
    assert first.returncode == 0, failures(out) or first.stdout[-3000:] + first.stderr[-3000:]
    assert sum(s["changed"] for s in out["stats"].values()) > 0  # it did set something up
    again, out = playbook(collections, inv, tmp_path / "site.yml")
    assert again.returncode == 0, failures(out) or again.stderr[-3000:]
    changed = {h: s["changed"] for h, s in out["stats"].items()}
    assert changed == {n.name: 0 for n in sandbox_cluster.nodes}, [
        f"{h}: {t['task']['name']}" for p in out["plays"] for t in p["tasks"] for h, r in t["hosts"].items()
        if r.get("changed")]  # fmt: skip
    # ansible-lint on the collection as installed, with a home of its own: a copy that an earlier
    # lint of the checkout left in ~/.ansible/collections would shadow the installed one
    (tmp_path / "home").mkdir()
    lint = run(BIN / "ansible-lint", "--offline", "--profile", "production",
               cwd=collections / "ansible_collections" / "nodeops" / "cluster",
               env={**env, "HOME": str(tmp_path / "home"), "PATH": f"{BIN}:{env['PATH']}",
                    "ANSIBLE_STDOUT_CALLBACK": "default"})  # fmt: skip
    assert lint.returncode == 0 and "Profile 'production' was required, and it passed" in lint.stderr, (
        lint.stdout[-3000:] + lint.stderr[-3000:]
    )


def launch_vars(cluster: str, argv: list[str], **more: object) -> str:
    return ansible_yaml({"launch_argv": argv, "launch_venv": "~/.venvs/train", "launch_workdir": WORKDIR,
                         "launch_env_file": f"~/.nodeops/{cluster}/env.sh", **more})  # fmt: skip


def run_id_of(out: dict) -> str:
    ids = set(re.findall(r"run (\d{8}-\d{6}-[0-9a-f]{4})", json.dumps(out)))
    assert len(ids) == 1, ids
    return ids.pop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run(NODEOPS, *args, timeout=120)


def test_launch_playbook_runs_ddp_fails_fast_and_nodeops_finds_its_runs(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object, collections: Path, tmp_path: Path
) -> None:
    sb = sandbox_cluster
    inv = inventory_ini(sb, tmp_path / "inventory.ini")

    # 1. every rank agrees, and the run's record lets `nodeops logs` show the ranks' lines
    p, out = playbook(
        collections, inv, "nodeops.cluster.launch", launch_vars(sb.name, ["ddp_train.py", "--steps", "3"])
    )
    assert p.returncode == 0, failures(out) or p.stderr[-3000:]
    run_id = run_id_of(out)
    assert f"run {run_id} finished: every job exited 0" in p.stdout
    logs = cli("logs", run_id)
    assert logs.returncode == 0, logs.stderr
    hashes = re.findall(r"^(node\d) \[rank(\d)\]:final param hash (\w+)$", logs.stdout, re.M)
    assert sorted((h, r) for h, r, _ in hashes) == [("node1", "0"), ("node2", "1"), ("node3", "2")], logs.stdout
    assert len({d for _, _, d in hashes}) == 1
    assert leftovers(sb) == CLEAN

    # 2. a failing rank: the supervisor stops every rank on every host; the play names the node
    p, out = playbook(collections, inv, "nodeops.cluster.launch",
                      launch_vars(sb.name, ["ddp_train.py", "--steps", "200", "--sleep", "0.3", "--fail-rank", "2",
                                            "--fail-step", "3"]))  # fmt: skip
    assert p.returncode == 2, p.stdout[-2000:]
    msg = "\n".join(failures(out))
    assert re.search(r"failed: first failure on node3 \(", msg), msg
    assert "rank 2: failing on purpose at step 3" in msg
    assert no_leftovers_within(sb, 5) == CLEAN

    # 3. detached (launch_wait: false): nodeops status/logs/stop find the run by its id
    p, out = playbook(
        collections,
        inv,
        "nodeops.cluster.launch",
        launch_vars(sb.name, ["ddp_train.py", "--steps", "1000", "--sleep", "0.5"], launch_wait=False),
    )
    assert p.returncode == 0, failures(out) or p.stderr[-3000:]
    run_id = run_id_of(out)
    st = cli("status", run_id)
    assert st.returncode == 0 and st.stdout.split() == ["node1", "running", "node2", "running", "node3", "running"], (
        st.stdout + st.stderr
    )
    stop = cli("stop", run_id)
    assert stop.returncode == 0, stop.stderr
    assert no_leftovers_within(sb, 5) == CLEAN
