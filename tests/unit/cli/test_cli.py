"""CLI behaviour: exit codes, where messages go, help examples, no side effects on errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nodeops.cli import app
from nodeops.quoting import load_ansible_yaml

from ...conftest import PEERS

SPECS = Path(__file__).resolve().parents[2] / "specs"
runner = CliRunner()


def test_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("nodeops ")


def test_no_args_shows_help() -> None:
    r = runner.invoke(app, [])
    assert "validate" in r.output and "render" in r.output


@pytest.mark.parametrize("cmd", ["validate", "render", "schema", "import-hostfile", "check", "launch", "setup"])
def test_every_command_has_an_example(cmd: str) -> None:
    r = runner.invoke(app, [cmd, "-h"])
    assert r.exit_code == 0
    assert "Example" in r.output and f"nodeops {cmd}" in r.output


def test_validate_ok_and_warning_on_stderr() -> None:
    r = runner.invoke(app, ["validate", str(PEERS / "autodist/r1.yml")])
    assert r.exit_code == 0
    assert "valid: 2 node(s)" in r.stdout
    assert "warning: ssh.conf.key_file" in r.stderr


def test_validate_error_exit_2_on_stderr() -> None:
    path = SPECS / "two-chiefs.error.two-chiefs.yaml"
    r = runner.invoke(app, ["validate", str(path)])
    assert r.exit_code == 2
    assert r.stdout == ""
    assert f"{path}:7:5: error: nodes[1].chief: more than one chief" in r.stderr
    assert "nothing was run" in r.stderr


@pytest.mark.parametrize("cmd", [["check"], ["launch"], ["setup"]])
def test_spec_errors_stop_every_host_command_with_exit_2(cmd: list[str]) -> None:
    """A bad spec is refused before any ssh (the addresses here route nowhere)."""
    path = SPECS / "two-chiefs.error.two-chiefs.yaml"
    extra = ["--", "train.py"] if cmd == ["launch"] else []
    r = runner.invoke(app, [*cmd, str(path), *extra])
    assert r.exit_code == 2, r.output
    assert "more than one chief" in r.stderr and "nothing was run" in r.stderr


def test_validate_json() -> None:
    r = runner.invoke(app, ["validate", "--json", str(SPECS / "multi.error.several-at-once.yaml")])
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["valid"] is False and len(doc["errors"]) == 3
    assert {e["field"] for e in doc["errors"]} == {"nodes[0].gpus[0]", "nodes[1].address", "launch.runner"}


def test_validate_missing_file() -> None:
    r = runner.invoke(app, ["validate", "/nonexistent/cluster.yaml"])
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_validate_a_directory_says_so(tmp_path: Path) -> None:
    r = runner.invoke(app, ["validate", str(tmp_path)])
    assert r.exit_code == 2 and "is a directory, not a spec file" in r.stderr


def test_render_writes_only_its_files(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    r = runner.invoke(app, ["render", str(SPECS / "full.happy.yaml"), "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".deepspeed_env",
        "hostfile",
        "inventory.yml",
        "mine.txt",
        "ssh_config",
    ]
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    inv = load_ansible_yaml((tmp_path / "inventory.yml").read_text())
    assert inv["all"]["children"]["chief"]["hosts"]["node-1"]["nodeops_node_rank"] == 0


def test_render_bad_spec_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = runner.invoke(app, ["render", str(SPECS / "no-chief.error.no-chief.yaml"), "-o", str(out)])
    assert r.exit_code == 2
    assert not out.exists()


def test_render_unset_from_env_is_exit_2(tmp_path: Path) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text("nodes: [{address: 10.0.0.1}]\nenv: {RUN: {from_env: NODEOPS_TEST_UNSET_VAR}}\n")
    r = runner.invoke(app, ["render", str(spec), "-o", str(tmp_path / "o")], env={"NODEOPS_TEST_UNSET_VAR": None})
    assert r.exit_code == 2 and "NODEOPS_TEST_UNSET_VAR is not set" in r.stderr


def test_schema_is_json_schema() -> None:
    r = runner.invoke(app, ["schema"])
    doc = json.loads(r.stdout)
    assert doc["title"] == "nodeops resource spec"
    assert "nodes" in doc["required"]
    assert doc["$defs"]["Node"]["additionalProperties"] is False


def test_import_hostfile_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    hf = PEERS / "deepspeed/hostfiles/ok-order-preserved"
    r = runner.invoke(app, ["import-hostfile", str(hf), "--user", "ml", "--port", "2222", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r2 = runner.invoke(app, ["render", str(out), "-o", str(tmp_path / "r")])
    assert r2.exit_code == 0, r2.output
    assert (tmp_path / "r/hostfile").read_text() == "node-b slots=1\nnode-a slots=2\nnode-c slots=1\n"
    # and the exported hostfile parses back into the same spec
    r3 = runner.invoke(app, ["import-hostfile", str(tmp_path / "r/hostfile"), "--user", "ml", "--port", "2222"])
    assert yaml.safe_load(r3.stdout)["nodes"] == yaml.safe_load(out.read_text())["nodes"]


def test_import_hostfile_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    out.write_text("precious")
    r = runner.invoke(app, ["import-hostfile", str(PEERS / "deepspeed/hostfiles/ok-basic"), "-o", str(out)])
    assert r.exit_code == 2 and "--force" in r.stderr
    assert out.read_text() == "precious"


def test_import_bad_hostfile_names_line() -> None:
    hf = PEERS / "deepspeed/hostfiles/bad-duplicate-host"
    r = runner.invoke(app, ["import-hostfile", str(hf)])
    assert r.exit_code == 2
    assert f"{hf}:3:1: error: hostfile: multiple entries for worker-0 (first on line 1)" in r.stderr


def test_import_loopback_hostfile_names_line() -> None:
    hf = PEERS / "deepspeed/hostfiles/ok-localhost-and-ip"
    r = runner.invoke(app, ["import-hostfile", str(hf)])
    assert r.exit_code == 2 and f"{hf}:1:1" in r.stderr and "loopback" in r.stderr


def test_console_script_runs_as_a_process() -> None:
    """The installed entry point, not just the typer app, reports errors with exit 2."""
    p = subprocess.run(
        [sys.executable, "-m", "nodeops", "validate", str(SPECS / "no-chief.error.no-chief.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "none is marked chief" in p.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "node9"], "--limit: node9 not in the spec"),
        (["--tags", "bogus"], "--tags: unknown bogus"),
    ],
)
def test_setup_refuses_bad_targets_before_any_host(args: list[str], message: str) -> None:
    r = runner.invoke(app, ["setup", str(SPECS / "full.happy.yaml"), *args], env={"HF_TOKEN": "x"})
    assert r.exit_code == 2 and message in r.stderr
    assert "artifacts:" not in r.stderr


def test_setup_bad_spec_is_exit_2() -> None:
    r = runner.invoke(app, ["setup", str(SPECS / "two-chiefs.error.two-chiefs.yaml")])
    assert r.exit_code == 2 and "more than one chief" in r.stderr


def test_status_of_an_unknown_run_is_a_clear_error(tmp_path: Path) -> None:
    r = runner.invoke(app, ["status", "20990101-000000-abcd"], env={"NODEOPS_HOME": str(tmp_path)})
    assert r.exit_code == 2 and "no job 20990101-000000-abcd" in r.stderr
    r = runner.invoke(app, ["stop", "not-a-run"], env={"NODEOPS_HOME": str(tmp_path)})
    assert r.exit_code == 2 and "is neither a run id" in r.stderr


def test_mpirun_tagged_lines_get_the_ranks_host(capsys: pytest.CaptureFixture[str]) -> None:
    from nodeops.backends.ssh.backend import emitter
    from nodeops.cli.app import emit_line

    emit = emitter(["node1", "node2", "node2"], None, emit_line)
    emit("node1", "[1,2]<stdout>:step 3 loss 0.5")
    emit("node1", "[1,0]<stderr>:warning")
    emit("node1", "plain line from mpirun itself")
    assert capsys.readouterr().out.splitlines() == [
        "node2 [rank2]:step 3 loss 0.5",
        "node1 [rank0]:warning",
        "node1 | plain line from mpirun itself",
    ]
    # Unbuffered ranks: Open MPI tags each write, so pieces of several ranks share a line.
    emit("node1", "[1,1]<stdout>:rank 1/3[1,0]<stdout>:rank 0/3[1,2]<stdout>:rank 2/3")
    emit("node1", "[1,0]<stdout>:")
    emit("node1", "[1,1]<stdout>:")
    emit("node1", "[1,0]<stdout>:step 6[1,0]<stdout>:")
    # the MPI shim's exit marks are for the verdict, not shown; a piece before one is the rank's
    emit("node1", "[1,2]<stderr>:@@nodeops-rank-exit 1 1795629711.25 -")
    emit("node1", "[1,1]<stdout>:no newline[1,1]<stderr>:@@nodeops-rank-exit 134 1795629711.3 -")
    assert capsys.readouterr().out.splitlines() == [
        "node2 [rank2]:rank 2/3",
        "node1 [rank0]:rank 0/3",
        "node2 [rank1]:rank 1/3",
        "node1 [rank0]:step 6",
        "node2 [rank1]:no newline",
    ]


def test_deepspeed_pdsh_lines_get_the_nodes_host(capsys: pytest.CaptureFixture[str]) -> None:
    from nodeops.backends.ssh.backend import emitter
    from nodeops.cli.app import emit_line

    emit = emitter([], {"10.0.0.12": "node2"}, emit_line)
    emit("node1", "10.0.0.12: step 3 loss 0.5")
    emit("node1", "10.0.0.99: not ours")
    assert capsys.readouterr().out.splitlines() == ["node2 | step 3 loss 0.5", "node1 | 10.0.0.99: not ours"]


def test_pdsh_exit_report_names_the_failed_node() -> None:
    from nodeops.node.failures import pdsh_failure

    hosts = {"10.0.0.13": "node3"}
    assert pdsh_failure("pdsh@node1: 10.0.0.13: ssh exited with exit code 1", hosts) == ("node3", 1)
    assert pdsh_failure("pdsh@node1: 10.0.0.13: ssh exited with exit code 0", hosts) is None
    assert pdsh_failure("10.0.0.13: ssh exited with exit code 1", hosts) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["render", "{spec}", "-o", "afile/sub"], "exists and is not a directory"),
        (["schema", "-o", "adir"], "adir is a directory; give a file path"),
        (["schema", "-o", "missing_dir/x.json"], "the directory missing_dir does not exist"),
        (["import-hostfile", "hf", "-o", "missing_dir/x.yaml"], "the directory missing_dir does not exist"),
        (["import-hostfile", "hf", "-o", "adir", "--force"], "adir is a directory; give a file path"),
        (["import-hostfile", "hf-bin"], "hf-bin is not UTF-8 text"),
        (["import-hostfile", "adir"], "adir is a directory; give a hostfile"),
    ],
)
def test_bad_paths_are_one_line_errors_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    """Issue 17, item 3: each of these was a traceback with exit 1."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "hf").write_text("10.0.0.1 slots=2\n")
    (tmp_path / "hf-bin").write_bytes(b"\xff\xfe10.0.0.1 slots=2\n")
    spec = str(SPECS / "minimal.happy.yaml")
    r = subprocess.run([sys.executable, "-m", "nodeops", *[a.replace("{spec}", spec) for a in args]],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("run_id", ["nonsense", "20990101-000000-abcd"])
@pytest.mark.parametrize("command", ["status", "logs", "stop"])
def test_a_bad_or_unknown_run_id_is_usage_exit_2(tmp_path: Path, command: str, run_id: str) -> None:
    r = subprocess.run([sys.executable, "-m", "nodeops", command, run_id], capture_output=True, text=True,
                       check=False, env={**os.environ, "NODEOPS_HOME": str(tmp_path)})  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_launch_exit_code_is_the_ranks_except_nodeops_own_codes() -> None:
    from nodeops.backends.ssh import run as ssh_run
    from nodeops.node import failures

    def code(rank_code: int) -> int:
        return ssh_run.JobResult("r", {}, failures.HostState("node2", exit_code=rank_code), False, None).exit_code

    assert [code(c) for c in (1, 3, 137, 2, 130)] == [1, 3, 137, 1, 1]
    assert ssh_run.JobResult("r", {}, None, True, None).exit_code == 130
    assert ssh_run.JobResult("r", {}, None, False, None).exit_code == 0


def spec_with_key(tmp_path: Path, key: Path, name: str = "c1") -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\nnodes:\n  - {{address: 10.9.0.1, chief: true, ssh_config: g}}\n"
                    f"ssh:\n  g: {{username: u, key_file: {key}}}\n")  # fmt: skip
    return spec


@pytest.mark.parametrize("cmd", [["setup"], ["check"], ["launch", "--no-check", "--", "train.py"]])
def test_missing_key_file_is_named_before_any_ssh(tmp_path: Path, cmd: list[str]) -> None:
    """Issue 17, item 2: a spec whose key_file is missing says so (exit 2), instead of riding
    another spec's open ssh master or failing later with "Permission denied (publickey)"."""
    spec = spec_with_key(tmp_path, tmp_path / "no_such_key")
    r = runner.invoke(app, [cmd[0], str(spec), *cmd[1:]], env={"NODEOPS_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.stderr
    # file:line:col, the field, the cause and the fix, like every spec error
    assert f"{spec}:5:" in r.stderr and "ssh.g.key_file:" in r.stderr, r.stderr
    assert f"{tmp_path / 'no_such_key'} does not exist on this machine (fix: create the key" in r.stderr
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())


def test_missing_workdir_source_is_named_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "k").write_text("not a real key; never read\n")
    spec = spec_with_key(tmp_path, tmp_path / "k")
    spec.write_text(spec.read_text() + "workdir: {path: /srv/t, source: ./nope}\n")
    r = runner.invoke(app, ["setup", str(spec)], env={"NODEOPS_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.stderr
    assert f"{spec}:6:" in r.stderr and "workdir.source:" in r.stderr and f"{tmp_path / 'nope'}" in r.stderr


def test_setup_names_missing_controller_inputs_before_any_host(tmp_path: Path) -> None:
    """The files only setup reads (wheelhouse, requirements, mesh key) are spec errors with their
    lines, found before any host is touched (the roles' own input checks are skipped under
    nodeops); launch does not need them."""
    (tmp_path / "k").write_text("not a real key; never read\n")
    spec = spec_with_key(tmp_path, tmp_path / "k")
    spec.write_text(spec.read_text() + "python: {packages: [torch], wheelhouse: ./wh, requirements: req.txt}\n"
                    "mesh: {key_file: ./meshkey}\n")  # fmt: skip
    r = runner.invoke(app, ["setup", str(spec)], env={"NODEOPS_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.stderr
    assert (
        f"{spec}:6:" in r.stderr
        and "python.wheelhouse:" in r.stderr
        and f"{tmp_path / 'wh'} is not a directory" in r.stderr
    )
    assert "python.requirements:" in r.stderr and f"{tmp_path / 'req.txt'} is not a file" in r.stderr
    assert f"{spec}:7:" in r.stderr and "mesh.key_file:" in r.stderr, r.stderr
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())
    r = runner.invoke(
        app, ["launch", str(spec), "--dry-run", "--", "train.py"], env={"NODEOPS_HOME": str(tmp_path / "home")}
    )
    assert "wheelhouse" not in r.stderr, r.stderr
    # a role that does not run under --tags reads nothing: only ssh_mesh's key is asked for
    from nodeops.setup.render import controller_issues
    from nodeops.spec.loading import load_spec

    found = controller_issues(load_spec(spec), {}, setup=True, tags=["ssh_mesh"])
    assert ["mesh.key_file" in str(i) for i in found] == [True], found
    assert controller_issues(load_spec(spec), {}, setup=True, tags=["nccl_env"]) == []
    assert len(controller_issues(load_spec(spec), {}, setup=True, tags=["install"])) == 3


def test_setup_skips_exactly_the_roles_input_checks() -> None:
    from nodeops.lifecycle.setup import ROLE_INPUT_CHECKS

    root = Path(__file__).resolve().parents[3]
    tagged = {t for f in root.glob("roles/*/tasks/main.yml") for t in re.findall(r"\b(\w+_preflight)\b", f.read_text())}
    assert set(ROLE_INPUT_CHECKS) == tagged
    # nothing but the input-check asserts carries those tags
    for f in root.glob("roles/*/tasks/*.yml"):
        for block in yaml.safe_load(f.read_text()) or []:
            if set(block.get("tags", [])) & tagged:
                assert "ansible.builtin.assert" in block, (f, block.get("name"))


# Each input rule of the roles' asserts (skipped under nodeops: --skip-tags ROLE_preflight), and
# a spec that breaks it: nodeops must refuse every one before a host is touched. Rules that hold
# by construction are named with why (the chief is always in the play; conda is chosen by name).
ROLE_RULE_BREAKERS = {
    "ssh_mesh_mode must be chief or full": "mesh: {mode: star}\n",
    "ssh_mesh_cluster may hold only letters, digits, '.', '-' and '_'": "name: 'bad name'\n",
    "ssh_mesh_key_source must be a file on the controller": "mesh: {key_file: ./no-such-key}\n",
    "python_env_kind must be venv or conda": "python: {kind: pip}\n",
    "python_env_venv_path must be absolute or start with ~/": "python: {venv: venvs/train}\n",
    "python_env_venv_path: not the home dir itself": "python: {venv: '~'}\n",
    "the requirements file must exist on the controller": "python: {requirements: ./no-such.txt}\n",
    "the wheelhouse must be a directory on the controller": "python: {wheelhouse: ./no-such-dir}\n",
    "shared_path_path must be absolute": "workdir: {path: srv/t}\n",
    "shared_path_mode must be rsync, nfs or none": "workdir: {path: /srv/t, sync: scp}\n",
    "rsync needs shared_path_source to be a directory": "workdir: {path: /srv/t, source: ./no-such-dir}\n",
    "nfs needs a server and an absolute export": "workdir: {path: /srv/t, sync: nfs, nfs: {server: h, export: r}}\n",
    "nccl_env_ib must be auto or off": "network: {ib: on}\n",
    "nccl_env_socket_ifname must be auto or an interface name": "network: {socket_ifname: 'eth0;x'}\n",
    "nccl_env_nccl_vars keys must be NCCL_* names": "network: {nccl: {NCCL_debug: INFO}}\n",
    "every variable name must be a valid shell name": "env: {'1BAD': x}\n",
}
ROLE_RULES_BY_CONSTRUCTION = (
    "ssh_mesh_chief must be one of the play's hosts",  # nodeops' inventory holds its chief
    "conda needs python_env_conda_name",  # the kind is conda only when `conda:` names the env
    # .deepspeed_env: render.deepspeed_env_vars leaves out what DeepSpeed cannot read (warned)
    "deepspeed_env_vars names must be shell names",
    "deepspeed_env_vars values may not hold quotes, backticks, backslashes or newlines",
    "no hostfile entries",  # a spec has nodes
    "each deepspeed_env_hosts entry needs a host and slots",  # render writes both, slots = nproc >= 1
    "deepspeed_env_hosts must list each host once",  # addresses are unique in a spec
)


def test_every_role_input_rule_is_accounted_for() -> None:
    root = Path(__file__).resolve().parents[3]
    rules = [r for f in root.glob("roles/*/tasks/main.yml") for r in re.findall(r"^\s+rule: ", f.read_text(), re.M)]
    # one breaker per rule (plus the venv-is-home case, which the role's regex lets through)
    assert len(rules) == len(ROLE_RULE_BREAKERS) - 1 + len(ROLE_RULES_BY_CONSTRUCTION)


@pytest.mark.parametrize("rule", sorted(ROLE_RULE_BREAKERS))
def test_nodeops_refuses_what_each_skipped_role_input_check_would(tmp_path: Path, rule: str) -> None:
    from nodeops.errors import SpecError
    from nodeops.setup.render import require_controller_files
    from nodeops.spec.loading import load_spec

    spec = tmp_path / "c.yaml"
    spec.write_text("nodes:\n  - {address: 10.9.0.1, chief: true}\n" + ROLE_RULE_BREAKERS[rule])
    with pytest.raises(SpecError):
        require_controller_files(load_spec(spec), {}, setup=True)


def test_control_sockets_are_per_cluster_and_key(tmp_path: Path) -> None:
    from nodeops.setup.render import ssh_config
    from nodeops.spec.loading import load_spec

    def control_path(spec: Path) -> str:
        return next(ln.split()[1] for ln in ssh_config(load_spec(spec)).splitlines() if "ControlPath" in ln)

    a = control_path(spec_with_key(tmp_path, tmp_path / "k1"))
    b = control_path(spec_with_key(tmp_path, tmp_path / "k2"))
    c = control_path(spec_with_key(tmp_path, tmp_path / "k1", name="c2"))
    assert len({a, b, c}) == 3 and all(re.fullmatch(r"~/\.ssh/nodeops-[0-9a-f]{16}", p) for p in (a, b, c))
    assert control_path(spec_with_key(tmp_path, tmp_path / "k1")) == a  # stable
    # other host-key pins never ride a master that another pin set let in: the file, and its content
    pins = tmp_path / "known_hosts"
    pins.write_text("10.9.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOne\n")
    spec = spec_with_key(tmp_path, tmp_path / "k1", name="pinned")
    spec.write_text(spec.read_text().replace("key_file:", f"known_hosts: {pins}, key_file:"))
    d = control_path(spec)
    pins.write_text("")
    assert control_path(spec) != d


def test_a_home_too_long_for_a_socket_path_goes_without_ssh_masters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~/.ssh/nodeops-<16 hex> fits a socket's path (with ssh's 17-character temp suffix) for a
    home of up to ~55 characters; beyond, the generated ssh_config has no master rather than an
    ssh that fails every connection."""
    from nodeops import transport
    from nodeops.setup.render import ssh_config
    from nodeops.spec.loading import load_spec

    spec = spec_with_key(tmp_path, tmp_path / "k1")
    monkeypatch.setattr(transport, "ssh_home", lambda: "/home/" + "a" * 48)  # the passwd entry's, as ssh's ~
    text = ssh_config(load_spec(spec))
    path = next(ln.split()[1] for ln in text.splitlines() if "ControlPath" in ln)
    assert transport.fits_control_path(path) and "ControlMaster auto" in text
    monkeypatch.setattr(transport, "ssh_home", lambda: "/home/" + "a" * 60)
    text = ssh_config(load_spec(spec))
    assert "ControlPath" not in text and "ControlPersist" not in text and "ControlMaster no" in text


def test_runner_control_dir_changes_with_the_pins(tmp_path: Path) -> None:
    from nodeops.setup.runner import connection_identity

    pins = tmp_path / "kh"
    pins.write_text("10.9.0.1 ssh-ed25519 AAAA\n")
    hv = {"ansible_user": "u", "ansible_ssh_private_key_file": "/k",
          "ansible_ssh_common_args": f"-o UserKnownHostsFile={pins} -o StrictHostKeyChecking=yes"}  # fmt: skip
    a = connection_identity([hv])
    assert connection_identity([dict(hv)]) == a  # stable
    pins.write_text("")  # a key removed: a new master, which checks the host key again
    assert connection_identity([hv]) != a
    other = tmp_path / "other"
    other.write_text("")
    assert connection_identity([{**hv, "ansible_ssh_common_args": f"-o UserKnownHostsFile={other}"}]) != a


def test_unreachable_reason_is_ssh_own_line() -> None:
    from nodeops.setup.runner import _event_error

    # Ansible's ssh connection plugin, as CI saw it for a stopped node
    msg = ('Data could not be sent to remote host "10.214.0.13". Make sure this host can be reached over ssh: '
           "ssh: connect to host 10.214.0.13 port 22: Connection timed out")  # fmt: skip
    assert _event_error({"msg": msg}) == "ssh: connect to host 10.214.0.13 port 22: Connection timed out"
    assert _event_error({"msg": "Failed to connect to the host via ssh: Host key verification failed."}) == (
        "Host key verification failed."
    )


def test_check_json_with_a_bad_spec_is_json_too() -> None:
    """Issue 17, item 7: `check --json` on a bad spec prints a JSON document (and exits 2)."""
    r = runner.invoke(app, ["check", str(SPECS / "two-chiefs.error.two-chiefs.yaml"), "--json"])
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["status"] == "error" and doc["exit_code"] == 2 and any("more than one chief" in e for e in doc["errors"])
    assert "more than one chief" in r.stderr


@pytest.mark.parametrize("value", ["-5", "0"])
def test_check_refuses_a_timeout_below_one_second(value: str) -> None:
    r = runner.invoke(app, ["check", str(SPECS / "full.happy.yaml"), "--timeout", value])
    assert r.exit_code == 2 and "--timeout" in r.stderr


def test_check_values_never_read_none() -> None:
    from nodeops.check.preflight import shown

    assert (
        shown(None) == "unknown" and shown(None, "none (CPU build)") == "none (CPU build)" and shown("12.1") == "12.1"
    )


# --------------------------------------------------------------------------- issue 17, items 8 and 11
def test_validate_names_a_missing_source_and_an_unset_from_env_with_their_lines(tmp_path: Path) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\nnodes:\n  - {address: 10.9.0.1, chief: true}\n  - {address: 10.9.0.2}\n"
                    "env:\n  TOKEN: {from_env: NODEOPS_TEST_UNSET_VAR, secret: true}\n"
                    "workdir:\n  path: /srv/w\n  source: ./no_such_dir\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NODEOPS_TEST_UNSET_VAR"}
    r = runner.invoke(app, ["validate", str(spec)], env=env)
    assert r.exit_code == 0, r.stderr  # valid; this machine is not ready for it
    assert f"{spec}:9:3: warning: workdir.source: the source {tmp_path}/no_such_dir is not a directory" in r.stderr
    assert re.search(
        re.escape(str(spec)) + r":6:\d+: warning: env\.TOKEN\.from_env: NODEOPS_TEST_UNSET_VAR is not set "
        r"in this shell \(fix: export NODEOPS_TEST_UNSET_VAR=\.\.\. before setup\)",
        r.stderr,
    ), r.stderr
    s = runner.invoke(app, ["setup", str(spec)], env={**env, "NODEOPS_HOME": str(tmp_path / "home")})
    assert s.exit_code == 2 and s.stderr.count(": error: ") == 2 and "nothing was run" in s.stderr, s.stderr
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())


def test_a_non_utf8_spec_names_the_byte_and_the_fix(tmp_path: Path) -> None:
    spec = tmp_path / "latin.yaml"
    spec.write_bytes(b"name: x\nnodes:\n  - {address: 10.0.0.1, chief: true}\n# caf\xe9\n")
    r = runner.invoke(app, ["validate", str(spec)])
    assert r.exit_code == 2
    assert f"{spec}:4:6: error: <yaml>: byte 0xe9 is not UTF-8" in r.stderr and "save the file as UTF-8" in r.stderr


def test_import_hostfile_reports_every_bad_line_and_a_bad_option(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("a slots=2\nbad line\nb slots=x\na slots=2\n")
    r = runner.invoke(app, ["import-hostfile", str(hf)])
    assert r.exit_code == 2
    assert [ln.split(": error")[0] for ln in r.stderr.splitlines() if ": error" in ln] == [
        f"{hf}:2:1", f"{hf}:3:1", f"{hf}:4:1"]  # fmt: skip
    hf.write_text("a slots=2\n")
    u = runner.invoke(app, ["import-hostfile", str(hf), "--user", "bad user"])
    assert u.exit_code == 2 and u.stderr.startswith("error: --user: username 'bad user' is not a login name"), u.stderr


@pytest.mark.parametrize("command", ["setup", "launch", "check", "clean", "runs", "validate", "import-hostfile"])
def test_help_has_no_python_type_placeholders(command: str) -> None:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for placeholder in ("<bool>", "<int>", "<str>", "<path>", "<list", "{spec}", "{hostfile}"):
        assert placeholder not in r.stdout, (placeholder, r.stdout)


def test_help_groups_commands_in_the_order_a_user_works() -> None:
    from nodeops.cli import PANELS

    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    panels = [line for line in r.output.splitlines() if line.startswith("╭─ ")]
    assert [p.split()[1] for p in panels] == ["Options", *PANELS], panels
    listed = [m.group(1) for m in re.finditer(r"^│ ([a-z][a-z-]+) ", r.output, re.M)]
    assert listed == [name for names in PANELS.values() for name in names], listed
