"""Every spec string is safe wherever it lands, proven per target with the real parser.

For arbitrary text (newlines, quotes, $(), backticks, ;, %, NUL, Jinja, non-ASCII) in every
free-text field, either ``validate`` refuses the spec, or what nodeops renders is read back by
the target's own parser as exactly the intended values, and a sentinel command never runs:

- bash: a real ``bash`` runs the rendered words and sources the role's ``env.sh``;
- ssh_config: ``ssh -G`` reads the rendered ``ssh_config``;
- Ansible: the inventory is loaded with Ansible's ``InventoryManager`` and every value is put
  through Ansible's ``Templar``;
- fstab: no NFS field that validate accepts holds anything fstab splits on, comments out or
  escapes (ansible.posix.mount writes the line; the live mount is untested here: no NFS in
  this kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from nodeops import quoting
from nodeops.backends.slurm import job as slurm
from nodeops.errors import SpecError
from nodeops.setup.render import controller_path, inventory, ssh_config
from nodeops.spec.load import load_spec_text

ROOT = Path(__file__).resolve().parents[2]
SENTINEL_PIECES = ["$(touch {s})", "`touch {s}`", "; touch {s}", "\ntouch {s}\n", "$((1+1))", "${{HOME:-$(touch {s})}}"]
PIECES = [
    "$HOME", "${HOME}", "$", "${", "$1", "'", '"', "\\", "`", ";", "&", "|", "%", "%d", "%h", "#", " ", "\t", "\n",
    "\r", "\0", "{{ 7*7 }}", "{% raw %}", "{#", "~", "*", "?", "[a]", "é", "日本", "\u2028", "=", ":", ",", "@",
    "-o ProxyCommand=x", "ProxyCommand touch x",
]  # fmt: skip
NO_SURROGATES = st.characters(blacklist_categories=("Cs",))
TEXT = st.one_of(
    st.text(NO_SURROGATES, max_size=20),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(NO_SURROGATES, max_size=4)), max_size=6).map("".join),
)
# Valid but varied values (what validate accepts), so that most examples reach the parser.
OK_PATH = st.from_regex(r"\A(~/|/)?[A-Za-z0-9_.+@,:=/-]{1,24}\Z")
OK_USER = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.-]{0,12}\Z")
OK_JUMP = st.from_regex(r"\A(ssh://)?([a-z_][a-z0-9_.-]{0,8}@)?[a-z][a-z0-9.-]{0,12}(:[0-9]{1,5})?\Z")


def mostly(ok: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """ok three times out of four, arbitrary text otherwise."""
    return st.one_of(ok, ok, ok, bad)


SMALL = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hostile(sentinel: Path) -> st.SearchStrategy[str]:
    """TEXT, sometimes with a command that would create ``sentinel`` if anything ran it."""
    cmds = st.sampled_from(SENTINEL_PIECES).map(lambda p: p.format(s=sentinel))
    return st.one_of(TEXT, st.tuples(TEXT, cmds, TEXT).map("".join))


def bash(script: str, env: dict[str, str] | None = None) -> bytes:
    p = subprocess.run(["bash", "-c", script], capture_output=True, timeout=20, check=False,
                       env={"PATH": os.environ["PATH"], "LC_ALL": "C.UTF-8", **(env or {})})  # fmt: skip
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout


def nul_split(out: bytes) -> list[str]:
    return out.decode().split("\0")[:-1]


# --------------------------------------------------------------------------- bash
@given(values=st.lists(TEXT, min_size=1, max_size=8))
@SETTINGS
def test_sh_word_arrives_exactly(values: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    sentinel = tmp_path_factory.mktemp("s") / "ran"
    values = [*values, f"$(touch {sentinel})", f"`touch {sentinel}`"]
    if any("\0" in v for v in values):
        with pytest.raises(quoting.QuotingError):
            [quoting.sh_word(v) for v in values]
        return
    out = bash("printf '%s\\0' " + " ".join(quoting.sh_word(v) for v in values))
    assert nul_split(out) == values
    assert not sentinel.exists()


# --------------------------------------------------------------------------- rsync -e
ARGV_DUMPER = (
    "#!/usr/bin/env python3\nimport json, os, sys\n"
    "json.dump(sys.argv[1:], open(os.environ['ARGV_OUT'], 'w'))\nsys.exit(1)\n"
)


@given(values=st.lists(TEXT, min_size=1, max_size=6))
@SETTINGS
def test_rsync_rsh_word_arrives_exactly(values: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    """The words of the relay's ``rsync -e`` command, as the ssh that real rsync starts receives them."""
    d = tmp_path_factory.mktemp("rsh")
    if any("\0" in v for v in values):
        with pytest.raises(quoting.QuotingError):
            [quoting.rsync_rsh_word(v) for v in values]
        return
    dumper = d / "dump-argv"
    dumper.write_text(ARGV_DUMPER)
    dumper.chmod(0o755)
    (d / "src").mkdir()
    rsh = " ".join([quoting.rsync_rsh_word(str(dumper)), *(quoting.rsync_rsh_word(v) for v in values)])
    env = {"PATH": os.environ["PATH"], "ARGV_OUT": str(d / "argv.json"), "LC_ALL": "C.UTF-8"}
    p = subprocess.run(["rsync", "-r", "-e", rsh, f"{d}/src/", "h:dst/"], capture_output=True, timeout=20,
                       check=False, env=env)  # fmt: skip
    assert p.returncode != 0  # the dumper is not an ssh
    got = json.loads((d / "argv.json").read_text())
    assert got[: len(values)] == values, p.stderr
    assert got[len(values)] == "h"


@given(names=st.lists(st.sampled_from(["NCCL_DEBUG", "A", "_x1", "NCCL_DEBUG_SUBSYS"]), min_size=1, max_size=4,
                      unique=True), data=st.data())  # fmt: skip
@SETTINGS
def test_slurm_run_env_sources_to_exact_values(
    names: list[str], data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Slurm run's own env (slurm.env_lines, the run dir's run.env), sourced by a real bash as
    the batch script does: every value arrives exactly, nothing runs."""
    sentinel = tmp_path_factory.mktemp("s") / "ran"
    env = {n: data.draw(hostile(sentinel)) for n in names}
    if any("\0" in v for v in env.values()):
        with pytest.raises(quoting.QuotingError):
            slurm.env_lines(env)
        return
    f = tmp_path_factory.mktemp("run") / "run.env"
    f.write_text(slurm.env_lines(env))
    out = bash(f". {quoting.sh_word(str(f))}; printf '%s\\0' " + " ".join(f'"${n}"' for n in names))
    assert nul_split(out) == [env[n] for n in names]
    assert not sentinel.exists()


def test_slurm_run_env_refuses_what_is_not_a_name() -> None:
    for bad in ("A B", "X;touch y", "1A", "", "A=B", "$(x)"):
        with pytest.raises(ValueError, match="not environment variable names"):
            slurm.env_lines({bad: "v"})


def expected_expansion(value: str, env: dict[str, str]) -> str:
    return "".join(env.get(text, "") if kind == "ref" else text for kind, text in quoting.expand_refs(value))


@given(data=st.data())
@SETTINGS
def test_sh_expand_expands_names_and_nothing_else(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sentinel = tmp_path_factory.mktemp("s") / "ran"
    value = data.draw(hostile(sentinel))
    assume("\0" not in value)
    env = {"HOME": "/home/u", "A": "a b'c", "LD_LIBRARY_PATH": "/base"}
    out = bash("printf '%s\\0' " + quoting.sh_expand(value), env)
    assert nul_split(out) == [expected_expansion(value, env)]
    assert not sentinel.exists()


def test_sh_expand_autodist_example() -> None:
    word = quoting.sh_expand("$LD_LIBRARY_PATH:/usr/local/cuda/lib64")
    assert bash(f"printf %s {word}", {"LD_LIBRARY_PATH": "/base"}) == b"/base:/usr/local/cuda/lib64"


# --------------------------------------------------------------------------- nccl_env's interface probe
def render_probe(host: str, address: str, ifname: str) -> str:
    """The nccl_env role's probe task command, rendered with the role's own filters."""
    tasks = yaml.safe_load((ROOT / "roles/nccl_env/tasks/configure.yml").read_text())
    cmd = next(t["ansible.builtin.shell"]["cmd"] for t in tasks if "ansible.builtin.shell" in t)
    j = jinja2.Environment(undefined=jinja2.StrictUndefined)
    j.filters.update({"nodeops.cluster.nodeops_sh_word": quoting.sh_word})
    j.tests["match"] = lambda value, pattern: __import__("re").match(pattern, value) is not None
    return j.from_string(cmd).render(inventory_hostname=host, nccl_env_address=address, nccl_env_socket_ifname=ifname)


@given(data=st.data())
@SETTINGS
def test_probe_names_hostile_hosts_literally(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Inventory names and addresses reach the probe's bash only as words: a node whose name
    holds a command is named in the error, and nothing runs. `ip` and `getent` are stubs that
    print nothing (the controller may have no iproute2); bash itself parses the real command."""
    d = tmp_path_factory.mktemp("probe")
    sentinel = d / "ran"
    host, address = data.draw(hostile(sentinel)), data.draw(hostile(sentinel))
    ifname = data.draw(st.sampled_from(["auto", "eth9"]))
    assume("\0" not in host + address)
    for stub, body in (("ip", 'case "$*" in *"show dev"*) exit 1;; esac'), ("getent", "")):
        (d / stub).write_text(f"#!/bin/sh\n{body}\nexit 0\n")
        (d / stub).chmod(0o755)
    env = {"PATH": f"{d}:{os.environ['PATH']}", "LC_ALL": "C.UTF-8", "HOME": str(d)}
    p = subprocess.run(["bash", "-c", render_probe(host, address, ifname)], capture_output=True, timeout=20,
                       check=False, env=env)  # fmt: skip
    assert p.returncode == 3, p.stderr
    assert f"nccl_env: on {host}, ".encode() in p.stderr
    if ifname == "auto":
        assert f"holds {address}, ".encode() in p.stderr
    assert not sentinel.exists()


# --------------------------------------------------------------------------- env.sh (the role's template)
def render_env_sh(env_vars: dict[str, str], shared: dict[str, str], nccl: dict[str, str], secrets_path: Path) -> str:
    """The nccl_env role's env.sh.j2, rendered with the role's own filters (nodeops.quoting)."""
    tpl = (ROOT / "roles/nccl_env/templates/env.sh.j2").read_text()
    j = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    j.filters.update({"nodeops.cluster.nodeops_sh_word": quoting.sh_word,
                      "nodeops.cluster.nodeops_sh_expand": quoting.sh_expand})  # fmt: skip
    return j.from_string(tpl).render(
        nccl_env_cluster="c", inventory_hostname="h", _nccl_env_ifname="eth0", nccl_env_raise_nofile=False,
        nccl_env_ib="off", nccl_env_nccl_vars=nccl, nccl_env_vars=env_vars, nccl_env_shared_envs=shared,
        _nccl_env_dir_abs=str(secrets_path.parent),
    )  # fmt: skip


def spec_yaml(extra: dict[str, Any], group: dict[str, Any] | None = None) -> str:
    doc: dict[str, Any] = {
        "nodes": [{"address": "10.0.0.1", "name": "n1", "chief": True, "ssh_config": "g"},
                  {"address": "10.0.0.2", "name": "n2", "ssh_config": "g"}],
        "ssh": {"g": {"username": "debian", **(group or {})}},
        **extra,
    }  # fmt: skip
    return yaml.safe_dump(doc, allow_unicode=True)


@given(data=st.data())
@SETTINGS
def test_env_sh_sources_to_exact_values(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("env")
    sentinel = d / "ran"
    v_env, v_shared, v_nccl = (data.draw(hostile(sentinel)) for _ in range(3))
    text = spec_yaml({"env": {"MY_VAR": v_env}, "network": {"nccl": {"NCCL_X": v_nccl}}},
                     {"shared_envs": {"LD_LIBRARY_PATH": v_shared}})  # fmt: skip
    try:
        spec = load_spec_text(text).spec
    except SpecError:
        event("refused by validate")
        return  # refused: nothing is rendered
    event("rendered")
    env_vars = {k: v.value or "" for k, v in spec.env.items()}
    shared = dict(spec.ssh["g"].shared_envs)
    body = render_env_sh(env_vars, shared, dict(spec.network.nccl), d / "secrets.env")
    (d / "env.sh").write_text(body)
    login = {"LD_LIBRARY_PATH": "/base", "HOME": str(d)}
    out = bash(f". {quoting.sh_word(str(d / 'env.sh'))}; printf '%s\\0' \"$MY_VAR\" \"$LD_LIBRARY_PATH\" \"$NCCL_X\"",
               login)  # fmt: skip
    assert nul_split(out) == [env_vars["MY_VAR"], expected_expansion(shared["LD_LIBRARY_PATH"], login),
                              spec.network.nccl["NCCL_X"]]  # fmt: skip
    assert not sentinel.exists()


# --------------------------------------------------------------------------- ssh_config
def ssh_g(config: Path, host: str, *opts: str) -> dict[str, str]:
    p = subprocess.run(["ssh", "-G", "-F", str(config), *opts, host], capture_output=True, text=True, timeout=10,
                       check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr
    out: dict[str, str] = {}
    for line in p.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.setdefault(key, value)
    return out


@given(data=st.data())
@SMALL
def test_ssh_config_reads_back_exactly(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("ssh")
    ok = {"username": OK_USER, "key_file": OK_PATH, "known_hosts": OK_PATH, "proxy_jump": OK_JUMP}
    bad = data.draw(st.sampled_from([None, *ok]))  # one hostile field at a time (or none)
    group = {k: data.draw(TEXT if k == bad else strat) for k, strat in ok.items()}
    try:
        loaded = load_spec_text(spec_yaml({}, group), file=str(d / "c.yaml"))
    except SpecError:
        event("refused by validate")
        return
    event("rendered")
    cfg = d / "ssh_config"
    cfg.write_text(ssh_config(loaded))
    for alias, address in (("n1", "10.0.0.1"), ("n2", "10.0.0.2")):
        # What ssh itself makes of the intended values, given as argv (no config-file quoting in
        # the way; validate admits no whitespace or quotes in these fields): ssh's own
        # normalisations (~, //, a trailing dot, :01) then apply to both sides alike.
        intended = {"HostName": address, "User": group["username"], "Port": "22",
                    "IdentityFile": controller_path(group["key_file"], d),
                    "UserKnownHostsFile": controller_path(group["known_hosts"], d),
                    "ProxyJump": group["proxy_jump"], "StrictHostKeyChecking": "yes"}  # fmt: skip
        ref = ssh_g(Path("/dev/null"), "x", *[a for k, v in intended.items() for a in ("-o", f"{k}={v}")])
        for pattern in (alias, address):  # the block matches both
            got = ssh_g(cfg, pattern)
            for key in map(str.lower, intended):
                assert got[key] == ref[key], (key, got[key], ref[key])
            assert got.get("proxycommand", "none") == "none"
            assert got.get("permitlocalcommand") == "no"


@given(value=TEXT)
@SETTINGS
def test_ssh_config_value_is_one_token(value: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    try:
        quoted = quoting.ssh_config_value(value)
    except quoting.QuotingError:
        assert value == "" or any(not " " <= c <= "~" for c in value)
        return
    cfg = tmp_path_factory.mktemp("v") / "cfg"
    cfg.write_text(f"Host x\n    HostName 10.0.0.9\n    User {quoted}\n")
    assert ssh_g(cfg, "x")["user"] == value


# --------------------------------------------------------------------------- Ansible inventory
def ansible_values(inv_file: Path) -> tuple[dict[str, Any], Any]:
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    im = InventoryManager(loader=loader, sources=[str(inv_file)])
    hv = VariableManager(loader=loader, inventory=im).get_vars(host=im.get_host("n2"))
    return hv, Templar(loader=loader, variables=hv)


def test_ansible_templar_does_template_unmarked_strings(tmp_path: Path) -> None:
    """The control for the property below: a plain inventory string is templated (so the
    property test can fail), the same string through ansible_yaml is not."""
    plain = tmp_path / "plain.yml"
    plain.write_text(yaml.safe_dump({"all": {"hosts": {"n2": {"x": "{{ 7*7 }}"}}}}))
    hv, t = ansible_values(plain)
    assert t.template(hv["x"]) == 49
    marked = tmp_path / "marked.yml"
    marked.write_text(quoting.ansible_yaml({"all": {"hosts": {"n2": {"x": "{{ 7*7 }}"}}}}))
    hv, t = ansible_values(marked)
    assert t.template(hv["x"]) == "{{ 7*7 }}"


@given(data=st.data())
@SMALL
def test_inventory_loads_with_ansible_as_exact_values(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    d = tmp_path_factory.mktemp("inv")
    sentinel = d / "ran"
    jinja = st.just("{{ lookup('pipe', 'touch " + str(sentinel) + "') }}")
    env_value = data.draw(st.one_of(hostile(sentinel), jinja))
    shared = data.draw(st.one_of(hostile(sentinel), jinja))
    venv = data.draw(mostly(OK_PATH.map(lambda p: "/" + p.lstrip("~/")), TEXT))
    text = spec_yaml({"env": {"MY_VAR": env_value}, "python": {"venv": venv}}, {"shared_envs": {"S": shared}})
    try:
        loaded = load_spec_text(text, file=str(d / "c.yaml"))
    except SpecError:
        event("refused by validate")
        return
    event("rendered")
    intended = inventory(loaded, {})
    f = d / "inventory.yml"
    f.write_text(quoting.ansible_yaml(intended))
    hv, templar = ansible_values(f)
    all_vars = intended["all"]["vars"]
    n2 = intended["all"]["children"]["workers"]["hosts"]["n2"]
    for key, want in [("nodeops_env", all_vars["nodeops_env"]), ("nodeops_python", all_vars["nodeops_python"]),
                      ("nodeops_shared_envs", n2["nodeops_shared_envs"]),
                      ("nodeops_python_activate", n2["nodeops_python_activate"])]:  # fmt: skip
        assert hv[key] == want
        assert templar.template(hv[key]) == want
    assert not sentinel.exists()


# --------------------------------------------------------------------------- fstab fields
@given(server=TEXT, export=TEXT, options=TEXT)
@SETTINGS
def test_nfs_fields_are_refused_or_need_no_fstab_escape(server: str, export: str, options: str) -> None:
    text = spec_yaml({"workdir": {"path": "/srv/t", "sync": "nfs",
                                  "nfs": {"server": server, "export": export, "options": options}}})  # fmt: skip
    try:
        nfs = load_spec_text(text).spec.workdir.nfs  # type: ignore[union-attr]
    except SpecError:
        return
    assert nfs is not None
    for field in (nfs.server, nfs.export, nfs.options):
        # nothing that fstab splits on, comments out, or escapes
        assert field and not any(c.isspace() or c in "#\\\0" or ord(c) < 32 for c in field)
