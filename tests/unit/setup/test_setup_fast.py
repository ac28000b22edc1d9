"""setup's fast path: the probe's readers (on real files, a real dpkg-less fallback, bash's and
shlex's parsing of the real secrets.env template) and the controller's decision table."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeops.node import setup_probe
from nodeops.quoting import sh_word
from nodeops.resources import data_dir
from nodeops.setup import fast as setup_fast
from nodeops.setup import state as setup_state
from nodeops.setup import workdir

ROOT = Path(__file__).resolve().parents[3]


def test_role_vars_are_what_setup_yml_gives_each_role() -> None:
    """Every nodeops_* variable setup.yml passes a role (or tests in its `when`) is part of that
    role's input digest: a spec change a role reads is never missed by the fast path."""
    plays = yaml.safe_load((data_dir("playbooks") / "setup.yml").read_text())
    used: dict[str, set[str]] = {}
    for play in plays:
        for task in play.get("tasks", []):
            role = task["ansible.builtin.import_role"]["name"].rsplit(".", 1)[-1]
            text = yaml.safe_dump({"vars": task.get("vars"), "when": task.get("when")})
            used[role] = set(re.findall(r"(?<![.\w])(nodeops_\w+)", text))
        pre = yaml.safe_dump(play.get("pre_tasks", [])) + yaml.safe_dump(play.get("vars", {}))
        used.setdefault("packages", set()).update(n for n in re.findall(r"(?<![.\w])(nodeops_\w+)", pre)
                                                  if not n.startswith("_"))  # fmt: skip
    used["packages"] -= {"nodeops_dpkg", "nodeops_missing_packages"}  # the pre_tasks' own registers
    assert set(used) == set(setup_fast.ROLE_VARS)
    for role, names in used.items():
        # the secret values arrive as an extra var: compared on the node, never digested
        assert names - {"nodeops_secret_env"} <= set(setup_fast.ROLE_VARS[role]), role


def test_roles_read_no_inventory_variable_of_their_own() -> None:
    """The roles take their inputs as role variables only (setup.yml maps them), so ROLE_VARS
    above is the whole list."""
    for path in (data_dir("roles")).rglob("*.yml"):
        if "molecule" in path.parts or "launch" in path.parts:
            continue
        names = set(re.findall(r"(?<![.\w])(nodeops_\w+)", path.read_text()))
        assert not names, (path, names)


def test_the_probe_reads_versions_as_the_python_env_role_does() -> None:
    module = (data_dir("plugins") / "modules" / "python_env_state.py").read_text()
    m = re.search(r"^SCRIPT = (\(.*?\))$", module, re.S | re.M)
    assert m is not None
    assert ast.literal_eval(m.group(1)) == setup_probe.VERSIONS


NAMES = st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True)
# newlines and quotes too; a NUL cannot be in an env value (the spec refuses it)
VALUES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


def bash_exports(path: Path) -> dict[str, str]:
    """What bash's `. secrets.env` sets (the real parser), each variable NUL-separated."""
    script = 'set -a; . "$1"; for n in $(compgen -e); do printf "%s=%s\\0" "$n" "${!n}"; done'
    out = subprocess.run(["env", "-i", "bash", "-c", script, "_", str(path)], capture_output=True, check=True).stdout
    pairs = (item.decode().split("=", 1) for item in out.split(b"\0") if item)
    return {k: v for k, v in pairs if k not in ("PWD", "SHLVL", "_", "OLDPWD")}


def render_template(values: dict[str, str]) -> str:
    """The role's real secrets.env template, rendered by jinja2 with the collection's quoting."""
    text = (data_dir("roles") / "nccl_env" / "templates" / "secrets.env.j2").read_text()
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, autoescape=False)  # Ansible's defaults
    env.filters["sh_word"] = sh_word
    return env.from_string(text.replace("nodeops.cluster.nodeops_sh_word", "sh_word")).render(
        nccl_env_secret_vars=values
    )


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(NAMES, VALUES, max_size=4), st.dictionaries(NAMES, VALUES, max_size=4))
def test_secrets_compare_true_only_for_the_same_values(
    tmp_path_factory: pytest.TempPathFactory, have: dict[str, str], want: dict[str, str]
) -> None:
    """The controller renders the role's real template; bash reads back exactly the values, and
    the node-side comparison says yes only for the same values, with mode 0600."""
    d = tmp_path_factory.mktemp("s")
    f = d / "secrets.env"
    assert setup_fast.secrets_env(have) == render_template(have)  # the fast path's rendering is the role's
    f.write_bytes(setup_fast.secrets_env(have).encode())
    os.chmod(f, 0o600)
    assert bash_exports(f) == {k: v for k, v in have.items() if k not in ("PWD", "SHLVL", "_", "OLDPWD")}
    assert setup_probe._secrets_same(str(f), setup_fast.secrets_env(want)) is (have == want)
    assert setup_probe._secrets_same(str(f), setup_fast.secrets_env(have))
    os.chmod(f, 0o644)  # the role writes it 0600: any other mode is drift
    assert not setup_probe._secrets_same(str(f), setup_fast.secrets_env(have))


def test_secrets_never_leave_as_digests(tmp_path: Path) -> None:
    """The nccl_env state digests env.sh and the interfaces; secrets.env only answers yes or no."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "env.sh").write_text("export A=1\n")
    (d / "secrets.env").write_bytes(setup_fast.secrets_env({"TOKEN": "one"}).encode())
    os.chmod(d / "secrets.env", 0o600)
    a = setup_probe.nccl_env({"dir": str(d), "address": "127.0.0.1"}, setup_fast.secrets_env({"TOKEN": "one"}))
    (d / "secrets.env").write_bytes(setup_fast.secrets_env({"TOKEN": "two"}).encode())
    b = setup_probe.nccl_env({"dir": str(d), "address": "127.0.0.1"}, setup_fast.secrets_env({"TOKEN": "one"}))
    assert a == {"state": b["state"], "bad": ""}
    assert b["bad"] == "secrets.env does not hold the spec's secret values"
    assert "one" not in repr(a) + repr(b) and "two" not in repr(b)


def test_ssh_mesh_state_is_the_cluster_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    ak = ssh / "authorized_keys"
    block = "# BEGIN nodeops ssh_mesh c1\nssh-ed25519 AAAA nodeops-c1@node1\n# END nodeops ssh_mesh c1\n"
    ak.write_text("ssh-ed25519 USER user@laptop\n" + block)
    p = {"cluster": "c1", "key": "~/.ssh/id_ed25519"}
    first = setup_probe.ssh_mesh(p)
    assert first["bad"] == ""
    ak.write_text("ssh-ed25519 OTHER user@laptop\n" + block)  # the user's own lines are theirs
    assert setup_probe.ssh_mesh(p) == first
    ak.write_text(block.replace("AAAA", "BBBB"))
    assert setup_probe.ssh_mesh(p)["state"] != first["state"]
    ak.write_text("ssh-ed25519 USER user@laptop\n")
    assert setup_probe.ssh_mesh(p)["bad"] == "no ssh_mesh block in ~/.ssh/authorized_keys"


def test_shared_path_compares_with_the_manifest_and_keeps_outputs(tmp_path: Path) -> None:
    src, node = tmp_path / "src", tmp_path / "node"
    for d in (src, node):
        (d / "data").mkdir(parents=True)
        (d / "train.py").write_text("print(1)\n")
        (d / "data" / "c.json").write_text("{}\n")
    mod = workdir.manifest_module()
    manifest = mod.build(str(src), [".deepspeed_env"])
    code = workdir.manifest_path().read_text()
    p = {"path": str(node), "mode": "rsync", "manifest": manifest}
    first = setup_probe.shared_path(p, code)
    assert first["bad"] == ""
    (node / "checkpoint.pt").write_text("weights")  # a job's output: not drift
    assert setup_probe.shared_path(p, code) == first
    (node / "train.py").write_text("tampered\n")
    assert setup_probe.shared_path(p, code)["bad"].startswith("1 file(s) differ from the source (train.py); ")


def test_python_env_reads_drift_as_the_role_does(tmp_path: Path) -> None:
    prefix = tmp_path / "env"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").symlink_to(sys.executable)
    p = {"prefix": str(prefix), "tools": ["py-spy"]}
    assert setup_probe.python_env(p)["bad"] == "setup's install record (.nodeops-installed) is missing"
    rc, versions = setup_probe._run([str(prefix / "bin" / "python"), "-c", setup_probe.VERSIONS])
    assert rc == 0
    now = hashlib.sha256(versions.strip().encode()).hexdigest()
    (prefix / ".nodeops-installed").write_text(f"fp\n{now}\n")
    assert setup_probe.python_env(p)["bad"] == "not installed: py-spy"  # the role tries it again
    (prefix / "bin" / "py-spy").write_text("")
    ok = setup_probe.python_env(p)
    assert ok["bad"] == ""
    (prefix / ".nodeops-installed").write_text("fp\nsomething-else\n")
    assert setup_probe.python_env(p)["bad"] == "its packages changed since setup installed them"
    (prefix / ".nodeops-installed").write_text(f"fp\n{now}\n")
    assert setup_probe.python_env({**p, "tools": []})["state"] != ok["state"]
    assert setup_probe.python_env({"prefix": str(tmp_path / "none")})["bad"].endswith("/bin/python does not exist")


def test_a_reader_that_fails_is_a_role_to_run() -> None:
    got = setup_probe.state({"shared_path": {"path": "/", "mode": "rsync", "manifest": {}}, "x": {}}, {}, "raise 1/0")
    assert got["shared_path"]["bad"].startswith("could not read it: ZeroDivisionError")
    assert got["x"]["bad"] == "this probe does not know the role x"


def test_document_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    setup_probe.main({"plan": {"deepspeed_env": {"files": ["/nonexistent/.deepspeed_env"]}}})
    doc = setup_probe.document("ssh banner\n" + capsys.readouterr().out)
    assert doc is not None and doc["deepspeed_env"]["bad"] == "missing: /nonexistent/.deepspeed_env"
    assert setup_probe.document("nothing\n") is None


ROLES = {"node1": ["ssh_mesh", "nccl_env", "deepspeed_env"], "node2": ["ssh_mesh", "nccl_env"]}
WANTED = {h: {r: f"in-{r}" for r in setup_fast.ROLE_VARS} for h in ROLES}
ADDR = {"node1": "10.0.0.1", "node2": "10.0.0.2"}


def recorded(**changes: dict[str, str]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for h, roles in ROLES.items():
        out[h] = {"address": ADDR[h], "digests": {r: {"input": f"in-{r}", "state": f"st-{r}"} for r in roles}}
    for h, roles_changes in changes.items():
        for r, what in roles_changes.items():
            out[h]["digests"][r][what] = "other"  # type: ignore[index]
    return out


def found(bad: dict[str, dict[str, str]] | None = None, failed: dict[str, str] | None = None) -> setup_fast.Probe:
    states = {h: {r: {"state": f"st-{r}", "bad": (bad or {}).get(h, {}).get(r, "")} for r in rs}
              for h, rs in ROLES.items() if h not in (failed or {})}  # fmt: skip
    return setup_fast.Probe(states, dict(failed or {}))


def test_decide_runs_only_what_differs() -> None:
    assert setup_fast.decide(ROLES, WANTED, recorded(), found(), ADDR) == {"node1": {}, "node2": {}}
    got = setup_fast.decide(ROLES, WANTED, recorded(node2={"nccl_env": "state"}), found(), ADDR)
    assert got == {"node1": {}, "node2": {"nccl_env": "the node changed since setup left it"}}
    got = setup_fast.decide(ROLES, WANTED, recorded(node1={"ssh_mesh": "input"}), found(), ADDR)
    assert got["node1"] == {"ssh_mesh": "its input changed (the spec, a file it copies, or nodeops itself)"}
    got = setup_fast.decide(ROLES, WANTED, recorded(), found(bad={"node2": {"ssh_mesh": "no block"}}), ADDR)
    assert got == {"node1": {}, "node2": {"ssh_mesh": "no block"}}
    got = setup_fast.decide(ROLES, WANTED, recorded(), found(failed={"node2": "Connection refused"}), ADDR)
    assert got["node2"] == {r: "the probe could not read the node (Connection refused)" for r in ROLES["node2"]}
    moved = {**ADDR, "node2": "10.0.0.9"}  # another machine under the name: nothing recorded counts
    got = setup_fast.decide(ROLES, WANTED, recorded(), found(), moved)
    assert got["node2"] == {r: "no record of setting it up from this machine" for r in ROLES["node2"]}
    assert set(setup_fast.decide(ROLES, WANTED, None, found(), ADDR)["node1"]) == set(ROLES["node1"])


def test_roles_that_span_hosts_bring_the_others() -> None:
    three = {"node1": {}, "node2": {}, "node3": {}}
    assert setup_fast.joins({**three, "node2": {"nccl_env": "x"}}, "node1", "chief") == []
    assert setup_fast.joins({**three, "node2": {"ssh_mesh": "x"}}, "node1", "chief") == ["node1"]
    everyone = ["node1", "node2", "node3"]
    assert setup_fast.joins({**three, "node2": {"ssh_mesh": "x"}}, "node1", "full") == everyone
    # a new key on the chief goes into every node's authorized_keys
    assert setup_fast.joins({**three, "node1": {"ssh_mesh": "x"}}, "node1", "chief") == everyone
    # python_env's closing comparison needs every node in the play
    assert setup_fast.joins({**three, "node3": {"python_env": "x"}}, "node1", "chief") == everyone
    # the chief passes the workdir on: it takes part (its own copy is checked, not redone)
    assert setup_fast.joins({**three, "node3": {"shared_path": "x"}}, "node1", "chief") == []
    assert setup_fast.joins({**three, "node3": {"shared_path": "x"}}, "node1", "chief", relay=True) == ["node1"]
    assert setup_fast.joins({**three, "node3": {"shared_path": "x"}}, "node1", "full", relay=True) == ["node1"]


def test_a_damaged_record_is_as_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    path = setup_state.record_path("c")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": setup_state.VERSION, "hosts": {
        "node1": {"address": ADDR["node1"], "digests": ["x"]},
        "node2": {"address": ADDR["node2"], "digests": {"ssh_mesh": "x"}}}}))  # fmt: skip
    record = setup_state.load("c")
    got = setup_fast.decide(ROLES, WANTED, record, found(), ADDR)
    assert all(why == "no record of setting it up from this machine" for w in got.values() for why in w.values())
    setup_state.record_digests("c", ADDR, {"node1": {"nccl_env": {"input": "i", "state": "s"}}})
    assert setup_state.load("c")["node1"]["digests"] == {"nccl_env": {"input": "i", "state": "s"}}  # type: ignore[index]


def test_only_clean_reads_are_recorded() -> None:
    got = setup_fast.recordable(WANTED, found(bad={"node1": {"nccl_env": "env.sh is missing"}}))
    assert "nccl_env" not in got["node1"] and got["node2"]["nccl_env"] == {"input": "in-nccl_env",
                                                                          "state": "st-nccl_env"}  # fmt: skip


def test_what_launch_would_refuse_is_always_run() -> None:
    """The launch/check gate (setup_state.differences) and the fast path agree: a spec that now
    needs .deepspeed_env (deepspeed_env's input did not change: the same env and hostfile as an
    mpirun spec's) runs deepspeed_env on the chief, where it writes; a never-set-up node runs all."""
    run: dict[str, dict[str, str]] = {"node1": {}, "node2": {}}
    diffs = [
        setup_state.Difference("launch.runner: deepspeed", "deepspeed needs .deepspeed_env", "deepspeed_env",
                               ("node1", "node2")),
        setup_state.Difference("nodes", "never set up", "all roles", ("node2",)),
    ]  # fmt: skip
    setup_fast.add_gate(run, ROLES, diffs, "node1")
    assert run == {"node1": {"deepspeed_env": "launch.runner: deepspeed: deepspeed needs .deepspeed_env"},
                   "node2": {"ssh_mesh": "nodes: never set up", "nccl_env": "nodes: never set up"}}  # fmt: skip


def test_inputs_change_with_what_each_role_reads_and_nothing_else() -> None:
    def inv(env: str, ifname2: str, hostfile: list[str]) -> dict[str, object]:
        host = {"ansible_host": "10.0.0.1", "nodeops_socket_ifname": "auto", "nodeops_node_rank": 0}
        node2 = {**host, "ansible_host": "10.0.0.2", "nodeops_socket_ifname": ifname2}
        return {"all": {"vars": {"nodeops_cluster": "c", "nodeops_env": {"A": env}, "nodeops_hostfile_hosts": hostfile},
                        "children": {"chief": {"hosts": {"node1": host}},
                                     "workers": {"hosts": {"node2": node2}}}}}  # fmt: skip

    base = setup_fast.inputs(inv("1", "auto", ["a"]))
    env = setup_fast.inputs(inv("2", "auto", ["a"]))
    assert {h: [r for r in base[h] if base[h][r] != env[h][r]] for h in base} == {
        "node1": ["nccl_env"], "node2": ["nccl_env"]}  # fmt: skip
    own = setup_fast.inputs(inv("1", "eth1", ["a"]))  # one host's own variable: that host only
    assert {h: [r for r in base[h] if base[h][r] != own[h][r]] for h in base} == {"node1": [], "node2": ["nccl_env"]}
    hostfile = setup_fast.inputs(inv("1", "auto", ["a", "b"]))
    assert all([r for r in base[h] if base[h][r] != hostfile[h][r]] == ["deepspeed_env"] for h in base)


def test_deepspeed_env_files_are_required_only_with_variables(tmp_path: Path) -> None:
    """With no variables for it the role writes no .deepspeed_env: its absence is not a difference
    (a spec without `env:` would otherwise run deepspeed_env on every setup)."""

    def inv(ds_env: dict[str, str]) -> dict[str, object]:
        host = {"ansible_host": "10.0.0.1", "nodeops_node_rank": 0}
        return {"all": {"vars": {"nodeops_cluster": "c", "nodeops_deepspeed_env": ds_env},
                        "children": {"chief": {"hosts": {"node1": host}}, "workers": {"hosts": {}}}}}  # fmt: skip

    roles = {"node1": ["deepspeed_env"]}
    bare = setup_fast.plans(inv({}), roles, None)["node1"]["deepspeed_env"]
    assert bare["required"] == ["~/.nodeops/c/hostfile"]
    withvars = setup_fast.plans(inv({"A": "1"}), roles, None)["node1"]["deepspeed_env"]
    assert withvars["required"] == ["~/.deepspeed_env", "~/.nodeops/c/hostfile"]

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("10.0.0.1 slots=1\n")
    plan = {"files": [str(tmp_path / ".deepspeed_env"), str(hostfile)], "globs": [], "required": [str(hostfile)]}
    assert setup_probe.deepspeed_env(plan)["bad"] == ""
    assert setup_probe.deepspeed_env({**plan, "required": plan["files"]})["bad"].startswith("missing: ")
