"""Issue 13: the collection's launch role renders exactly the run files `nodeops launch` ships
(same templates, same agent/supervisor), and its filter plans exactly as the CLI does.

The byte-for-byte check runs real ansible-playbook (the collection's launch playbook) on
localhost, with the run the CLI worked out passed as `!unsafe` extra vars as `--via ansible`
does, and `launch_start: false` so nothing starts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nodeops.backends import starter, store
from nodeops.backends.ssh.backend import supervised_hosts
from nodeops.errors import NodeopsError
from nodeops.launch import launchers
from nodeops.quoting import ansible_yaml, ssh_args_options
from nodeops.resources import collections_path, data_dir
from nodeops.setup.render import ssh_target_from_record
from nodeops.spec.load import load_spec_text

RUN_ID = "20261123-101500-ab12"
HOSTILE = ["train.py", "{{ lookup('pipe', 'id') }}", "a b", "$(touch /tmp/pwned)", "'\"", "@x", "--lr=1e-3"]
SPECS = {
    "torchrun": """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0], nproc: 2}
  - {address: 10.0.0.2, cpus: [0]}
python: {venv: ~/.venvs/t}
workdir: {path: /srv/w, sync: none}
env:
  TOKEN: {value: "{{ s }}", secret: true}
ssh:
  default: {shared_envs: {LD_LIBRARY_PATH: "$LD_LIBRARY_PATH:/opt/{{ x }}"}}
""",
    "mpirun": """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0]}
  - {address: 10.0.0.2, cpus: [0]}
launch: {runner: mpirun}
""",
}


def _filter_module() -> Any:
    path = data_dir("plugins") / "filter" / "nodeops_launch.py"
    spec = importlib.util.spec_from_file_location("nodeops_launch_filter", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli_run(spec_text: str) -> dict[str, Any]:
    from nodeops.launch import plan as _launch_plan

    loaded = load_spec_text(spec_text)
    plan = launchers.plan(loaded.spec, HOSTILE, RUN_ID, shim_path=f"@@HOME@@/.nodeops/runs/{RUN_ID}/mpi_shim.sh")
    started = [h.host for h in plan if h.argv]
    cfg = _launch_plan.run_config(RUN_ID, supervised_hosts(loaded.spec, started), loaded.spec.launch.runner, 0)
    return starter.run_vars(loaded, plan, RUN_ID, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("runner", SPECS)
def test_the_role_writes_the_files_nodeops_launch_ships_byte_for_byte(runner: str, tmp_path: Path) -> None:
    run = cli_run(SPECS[runner])
    expected = starter.files_from_vars(run)
    inv = tmp_path / "inventory.ini"
    py = sys.executable
    inv.write_text("".join(f"{h} ansible_connection=local ansible_python_interpreter={py}\n" for h in expected))
    (tmp_path / "vars.yml").write_text(ansible_yaml({**starter.ansible_vars(run), "launch_start": False}))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANSIBLE_LOCALHOST_WARNING": "false",
           "ANSIBLE_COLLECTIONS_PATH": str(collections_path(tmp_path / "collections"))}  # fmt: skip
    rdir = tmp_path / "home" / ".nodeops" / "runs" / RUN_ID
    for host, files in expected.items():
        shutil.rmtree(rdir, ignore_errors=True)
        p = subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(inv), "--limit", host,
                            str(data_dir("playbooks") / "launch.yml"), "-e", f"@{tmp_path / 'vars.yml'}"],
                           capture_output=True, text=True, env=env, timeout=180, check=False)  # fmt: skip
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
        written_files = [str(f.relative_to(rdir)) for f in rdir.rglob("*") if f.is_file()]
        assert sorted(written_files) == sorted(f.name for f in files), host
        for f in files:
            written = rdir / f.name
            assert written.read_text() == f.content, (host, f.name)
            assert oct(stat.S_IMODE(written.stat().st_mode)) == oct(int(f.mode, 8)), (host, f.name)
        job = rdir / "job.sh"
        if job.exists():  # the hostile arguments are there literally, quoted once
            assert "'{{ lookup('\"'\"'pipe'\"'\"', '\"'\"'id'\"'\"') }}'" in job.read_text()


SPEC3 = """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0], nproc: 2}
  - {address: 10.0.0.2, cpus: [0]}
  - {address: 10.0.0.3, cpus: [0]}
launch: {runner: %s}
"""


@pytest.mark.parametrize("runner", ["torchrun", "mpirun", "deepspeed"])
def test_the_filter_plans_what_the_cli_plans(runner: str) -> None:
    """An inventory of the same hosts gives every host the command and env the CLI gives it."""
    spec = load_spec_text(SPEC3 % runner).spec
    shim = f"@@HOME@@/.nodeops/runs/{RUN_ID}/mpi_shim.sh"
    cli = launchers.plan(spec, ["train.py", "--x", "1"], RUN_ID, shim_path=shim,
                         hostfile_path="@@HOME@@/.nodeops/cluster/hostfile",
                         env_names=["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])  # fmt: skip
    hostvars = {"n1": {"ansible_host": "10.0.0.1", "launch_nproc_per_node": 2}, "n2": {"ansible_host": "10.0.0.2"},
                "n3": {"ansible_host": "10.0.0.3", "ansible_port": "2222", "ansible_user": "ml"}}  # fmt: skip
    run = _filter_module().nodeops_launch_run(["train.py", "--x", "1"], ["n1", "n2", "n3"], hostvars, run_id=RUN_ID,
                                              runner=runner)  # fmt: skip
    assert run["chief"] == "n1"
    for h, host in zip(cli, ["n1", "n2", "n3"], strict=True):
        job = run["hosts"][host]["job"]
        if not h.argv:
            assert job is None
            continue
        assert job["argv"] == h.argv
        assert job["env"] == starter.job_env(runner, h, starter.run_dir(RUN_ID))
    cfg = run["run_config"]
    assert [(x["name"], x["port"], x["user"], x["local"]) for x in cfg["hosts"]] == [
        ("n1", 22, "", True), ("n2", 22, "", False), ("n3", 2222, "ml", False)]  # fmt: skip
    assert cfg["agent_final"] == (runner == "torchrun") and cfg["pdsh"] == (runner == "deepspeed")


def test_the_filter_puts_the_chosen_chief_first_and_activates_the_venv() -> None:
    hostvars: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    run = _filter_module().nodeops_launch_run(["t.py"], ["a", "b"], hostvars, chief="b", venv="~/v e",
                                              workdir="~/work")  # fmt: skip
    assert run["chief"] == "b" and run["hosts"]["b"]["node_rank"] == 0 and run["hosts"]["a"]["node_rank"] == 1
    job = run["hosts"]["a"]["job"]
    assert job["activate"] == "source \"$HOME\"/'v e'/bin/activate"
    assert job["workdir"] == "@@HOME@@/work" and job["env"]["MASTER_ADDR"] == "b"
    assert store.RUN_ID.match(run["run_id"])


@pytest.mark.parametrize(("kw", "hostvars", "message"), [
    ({"chief": "zz"}, {}, "launch_chief: 'zz' is not a host of the play (a, b)"),
    ({"runner": "horovod"}, {}, "launch_runner: 'horovod'; use one of torchrun, mpirun, deepspeed"),
    ({"env": {"A B": "1"}}, {}, "launch_env: 'A B' is not a variable name"),
    ({"argv": []}, {}, "launch_argv: empty"),
    ({}, {"b": {"launch_nproc_per_node": 0}}, "b: launch_nproc_per_node: 0; at least 1"),
    ({"run_id": "x;rm"}, {}, "launch_run_id: 'x;rm' is not like"),
    ({"argv": "train.py"}, {}, "launch_argv: must be a list of the script's words"),  # -e launch_argv=train.py
    ({"forward_env": "NCCL_DEBUG"}, {}, "launch_forward_env: must be a list of variable names"),
    ({"env": "FOO=1"}, {}, "launch_env: must be a mapping of NAME: value"),
    ({}, {"b": {"ansible_host": "-oProxyCommand=x"}}, "b: ansible_host '-oProxyCommand=x': a host name or address"),
    ({"argv": ["t.py", "@@HOME@@/x"]}, {}, "launch_argv: @@HOME@@ is reserved"),
])  # fmt: skip
def test_the_filter_names_the_variable_that_is_wrong(
    kw: dict[str, Any], hostvars: dict[str, Any], message: str
) -> None:
    from ansible.errors import AnsibleFilterError

    argv = kw.pop("argv", ["t.py"])
    hv = {"a": {}, "b": {}} | hostvars
    with pytest.raises(AnsibleFilterError, match=r"nodeops\.cluster\.launch: ") as e:
        _filter_module().nodeops_launch_run(argv, ["a", "b"], hv, **kw)
    assert message in str(e.value)


def test_ssh_args_in_an_inventory_become_the_runs_ssh_config(tmp_path: Path) -> None:
    """A run the launch playbook recorded: its ssh_config, read back by the real `ssh -G`."""
    opts = ssh_args_options("-o UserKnownHostsFile=/k/known -oStrictHostKeyChecking=no -J 'jump@j:2222' -o 'Port 7'")
    assert opts == {"userknownhostsfile": "/k/known", "stricthostkeychecking": "no", "proxyjump": "jump@j:2222",
                    "port": "7"}  # fmt: skip
    assert ssh_args_options("-l ml -p2222") == {"user": "ml", "port": "2222"}
    conn = {"address": "10.1.0.5", "port": 2200, "user": "ml", "key_file": "/keys/id ed", "ssh_args":
            "-o UserKnownHostsFile=/k/known -o StrictHostKeyChecking=accept-new -J jump@j:2222"}  # fmt: skip
    t = ssh_target_from_record("node1", conn)
    assert t.host_key_checking == "accept-new"
    d = tmp_path / RUN_ID
    d.mkdir()
    store.write_ssh_config(d, {"node1": conn})
    g = subprocess.run(["ssh", "-G", "-F", str(d / "ssh_config"), "node1"], capture_output=True, text=True,
                       check=True).stdout  # fmt: skip
    got = dict(line.split(" ", 1) for line in g.splitlines() if " " in line)
    assert got["hostname"] == "10.1.0.5" and got["port"] == "2200" and got["user"] == "ml"
    assert got["userknownhostsfile"] == "/k/known" and got["proxyjump"] == "jump@j:2222"
    assert got["stricthostkeychecking"] == "accept-new"
    assert "/keys/id ed" in g


def test_host_key_checking_switched_off_in_the_inventory_pins_on_first_use_instead(tmp_path: Path) -> None:
    """`-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null` would accept every key on every
    connection; the run's ssh_config keeps the keys it first saw in the record's own file."""
    d = tmp_path / RUN_ID
    d.mkdir()
    conn = {"address": "10.1.0.5", "ssh_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}
    store.write_ssh_config(d, {"node1": conn})
    g = subprocess.run(["ssh", "-G", "-F", str(d / "ssh_config"), "node1"], capture_output=True, text=True,
                       check=True).stdout  # fmt: skip
    got = dict(line.split(" ", 1) for line in g.splitlines() if " " in line)
    assert got["stricthostkeychecking"] == "accept-new"
    assert got["userknownhostsfile"] == str(d / "known_hosts")
    spaced = ssh_target_from_record("n", {"ssh_args": "-o 'UserKnownHostsFile=/tmp/my dir/kh'"})
    assert spaced.known_hosts == "/tmp/my dir/kh" and spaced.host_key_checking == "yes"
    with pytest.raises(NodeopsError, match="cannot be split"):
        ssh_target_from_record("n", {"ssh_args": "-o 'UserKnownHostsFile=/x"})
