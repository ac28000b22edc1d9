"""Issue 14: Ansible inventories as input, read by Ansible's own inventory code (real
InventoryManager, group_vars/host_vars, the script plugin), mapped onto the spec model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from nodeops.errors import SpecError
from nodeops.setup.render import render
from nodeops.spec import inventory as inventory_source
from nodeops.spec.loading import load_spec

YAML_INV = """\
all:
  children:
    trainers:
      hosts:
        gpu1.example.com: {ansible_host: 10.0.0.1, nodeops_gpus: 2}
        gpu2: {ansible_host: 10.0.0.2, nodeops_gpus: [0, 1], ansible_port: 2222}
        gpu3: {ansible_host: 10.0.0.3, nodeops_chief: true, nodeops_gpus: 2}
      vars:
        ansible_user: ml
        ansible_ssh_private_key_file: /keys/id_ed25519
        ansible_ssh_common_args: "-o UserKnownHostsFile=/keys/known_hosts -J ops@bastion:22"
    other:
      hosts:
        db1: {ansible_host: 10.9.9.9}
"""
INI_INV = """\
[trainers]
n1 ansible_host=10.0.0.1
n2 ansible_host=10.0.0.2 ansible_port=2200

[chief]
n2

[trainers:vars]
ansible_user=ubuntu
"""


def write(d: Path, name: str, text: str) -> Path:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


def issues(path: Path, group: str | None = None) -> list[str]:
    with pytest.raises(SpecError) as e:
        load_spec(path, group)
    return [str(i) for i in e.value.issues]


def test_a_yaml_inventory_with_group_vars_maps_onto_the_spec(tmp_path: Path) -> None:
    inv = write(tmp_path, "inventory.yml", YAML_INV)
    write(tmp_path, "group_vars/trainers.yml", "nodeops:\n  python: {venv: ~/.venvs/t}\n  name: train\n")
    write(tmp_path, "host_vars/gpu2.yml", "ansible_user: other\n")
    loaded = load_spec(inv, "trainers")
    s = loaded.spec
    assert [(n.address, n.name, n.gpus) for n in s.nodes] == [
        ("10.0.0.1", "gpu1", [0, 1]), ("10.0.0.2", "gpu2", [0, 1]), ("10.0.0.3", "gpu3", [0, 1])]  # fmt: skip
    assert s.chief.address == "10.0.0.3"  # nodeops_chief: true
    g1, g2 = s.group(s.nodes[0]), s.group(s.nodes[1])
    assert (g1.username, g1.port, g1.key_file, g1.known_hosts, g1.proxy_jump) == (
        "ml", 22, "/keys/id_ed25519", "/keys/known_hosts", "ops@bastion:22")  # fmt: skip
    assert (g2.username, g2.port) == ("other", 2222)  # host_vars/ win, as in Ansible
    assert s.python is not None and s.python.venv == "~/.venvs/t" and loaded.cluster_name == "train"
    assert "db1" not in render(loaded, {}).files["inventory.yml"]  # only the chosen group


def test_an_ini_inventory_takes_its_chief_from_the_chief_group(tmp_path: Path) -> None:
    s = load_spec(write(tmp_path, "hosts", INI_INV)).spec
    assert [n.name for n in s.ranked_nodes()] == ["n2", "n1"]
    assert s.group(s.chief).port == 2200 and s.group(s.chief).username == "ubuntu"
    assert all(n.cpus == [0] and not n.gpus for n in s.nodes)


def test_a_dynamic_inventory_script_printing_ansible_inventory_json(tmp_path: Path) -> None:
    listing = {"_meta": {"hostvars": {"a": {"ansible_host": "10.1.0.1", "nodeops_gpus": 1},
                                      "b": {"ansible_host": "10.1.0.2", "nodeops_gpus": 1}}},
               "all": {"children": ["ungrouped", "gpu"]}, "gpu": {"hosts": ["a", "b"]}}  # fmt: skip
    script = write(tmp_path, "inv.py", "#!/usr/bin/env python3\nimport json, sys\n"
                   f"print(json.dumps({json.dumps(listing)}))\n")  # fmt: skip
    script.chmod(0o755)
    assert inventory_source.looks_like_inventory(script)
    s = load_spec(script, "gpu").spec
    assert [n.address for n in s.ranked_nodes()] == ["10.1.0.1", "10.1.0.2"]


@pytest.mark.parametrize(("text", "expected"), [
    ("nodes:\n  - {address: 10.0.0.1}\n", False),  # a spec
    ("all:\n  hosts:\n    a:\n", True),
    ("plugin: amazon.aws.aws_ec2\nregions: [us-east-1]\n", True),
    ("[gpu]\nn1 ansible_host=10.0.0.1\n", True),
    ("nodez:\n  - {address: 10.0.0.1}\n", False),  # a spec with a typo: the spec loader explains it
    ("ssh: {}\n", False),  # a spec without nodes: "nodes is missing", not "no hosts"
    ("foo: [unclosed\n", False),
])  # fmt: skip
def test_inventories_are_told_from_specs_by_content(tmp_path: Path, text: str, expected: bool) -> None:
    assert inventory_source.looks_like_inventory(write(tmp_path, "cluster.yaml", text)) is expected


def test_every_problem_names_the_host_the_variable_and_where_ansible_read_it(tmp_path: Path) -> None:
    inv = write(tmp_path, "inventory.ini", "[gpu]\nn1 ansible_host=10.0.0.1 ansible_port=x22\nn2 nodeops_gpus=two\n"
                "\n[chief]\nn1\nn2\n")  # fmt: skip
    write(tmp_path, "group_vars/gpu.yml", "nodeops:\n  python: {venvv: ~/.v}\n")
    got = issues(inv)
    assert any(i.startswith(f"{tmp_path}/inventory.ini:2:") and "n1: ansible_port" in i for i in got), got
    assert any(f"{tmp_path}/inventory.ini:3:" in i and "n2: nodeops_gpus" in i for i in got), got
    assert any(f"{tmp_path}/group_vars/gpu.yml:2:" in i and "nodeops.python" in i and "venvv" in i for i in got), got
    assert any("group `chief` holds 2 hosts" in i and "n1, n2" in i for i in got), got


def test_group_and_source_errors_are_spec_errors(tmp_path: Path) -> None:
    inv = write(tmp_path, "hosts.ini", INI_INV)
    assert any("no group 'gpus' in the inventory" in i for i in issues(inv, "gpus"))
    spec = write(tmp_path, "c.yaml", "nodes:\n  - {address: 10.0.0.1}\n")
    assert any("is a resource spec, not an Ansible inventory" in i for i in issues(spec, "all"))
    nosrc = write(tmp_path, "w.yml", "all:\n  hosts:\n    a:\n  vars:\n    nodeops: {workdir: {path: /srv/w}}\n")
    assert any("a: nodeops.workdir.source: required with an Ansible inventory" in i for i in issues(nosrc))
    differing = write(tmp_path, "d.yml", "all:\n  hosts:\n    a: {nodeops: {name: x}}\n    b: {nodeops: {name: y}}\n")
    assert any("b: nodeops: differs from a's" in i for i in issues(differing))


def test_render_then_import_gives_back_the_same_nodes(tmp_path: Path) -> None:
    """The round trip: a spec -> `nodeops render`'s inventory.yml -> the inventory loader."""
    root = Path(__file__).resolve().parents[2]
    loaded = load_spec(root / "specs" / "full.happy.yaml")
    inv = write(tmp_path, "inventory.yml", render(loaded, {"HF_TOKEN": "x", "API_KEY": "y"}).files["inventory.yml"])
    back = load_spec(inv).spec
    s = loaded.spec

    def nodes(spec: object) -> list[tuple[object, ...]]:
        return [(n.address, spec.alias(n), n.gpus, spec.nproc(n), n is spec.chief, spec.group(n).username,  # type: ignore[attr-defined]
                 spec.group(n).port) for n in spec.ranked_nodes()]  # type: ignore[attr-defined]  # fmt: skip

    assert nodes(back) == nodes(s)
    text = inventory_source.spec_text(inv)
    assert load_spec(write(tmp_path, "imported.yaml", text)).spec.nodes == back.nodes


def test_toml_and_an_inventory_plugin_config(tmp_path: Path) -> None:
    toml = write(tmp_path, "inv.toml", '[gpu.hosts]\nt1 = { ansible_host = "10.3.0.1", nodeops_gpus = 2 }\n'
                 't2 = { ansible_host = "10.3.0.2", nodeops_gpus = 2 }\n')  # fmt: skip
    assert [(n.name, n.gpus) for n in load_spec(toml).spec.nodes] == [("t1", [0, 1]), ("t2", [0, 1])]
    # a plugin config, as aws_ec2.yml is (the generator plugin ships with ansible-core; cloud ones need
    # their collection and credentials, untested here)
    gen = write(tmp_path, "gen.yml", "plugin: ansible.builtin.generator\nhosts:\n  name: '{{ rack }}-{{ slot }}'\n"
                "layers:\n  rack: [r1]\n  slot: [a, b]\n")  # fmt: skip
    assert inventory_source.looks_like_inventory(gen)
    assert [n.address for n in load_spec(gen).spec.ranked_nodes()] == ["r1-a", "r1-b"]


def test_import_inventory_writes_a_spec_and_never_overwrites_without_force(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from nodeops.cli import app

    inv = write(tmp_path, "hosts.ini", INI_INV)
    out = tmp_path / "cluster.yaml"
    r = CliRunner().invoke(app, ["import-inventory", str(inv), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert [n.address for n in load_spec(out).spec.ranked_nodes()] == ["10.0.0.2", "10.0.0.1"]
    out.write_text("mine\n")
    r = CliRunner().invoke(app, ["import-inventory", str(inv), "-o", str(out)])
    assert r.exit_code == 2 and "exists; pass --force" in r.output and out.read_text() == "mine\n"
    r = CliRunner().invoke(app, ["import-inventory", str(inv), "-o", str(out), "--force"])
    assert r.exit_code == 0 and out.read_text().startswith("# Resource spec imported")


def test_ssh_settings_nodeops_cannot_carry_are_refused_not_dropped(tmp_path: Path) -> None:
    inv = write(tmp_path, "a.ini", "[g]\nh1 ansible_host=10.0.0.1 nodeops_gpus=100000000 nodeops_chief=yes\n"
                "h2 ansible_ssh_host=10.0.0.2 ansible_ssh_user=ml ansible_ssh_common_args='-o ProxyCommand=nc -lroot'\n"
                "h3 ansible_host=10.0.0.3 ansible_connection=local nodeops_chief=maybe\n")  # fmt: skip
    got = issues(inv)
    assert any("h1: nodeops_gpus: 100000000 GPUs on one host" in i for i in got), got
    assert any("h2: ansible_ssh_common_args: ssh option 'proxycommand' is not carried over" in i for i in got), got
    assert any("h2: ansible_ssh_common_args: ssh option 'user' is not carried over" in i for i in got), got
    assert any("h3: ansible_connection: 'local': nodeops reaches every host over ssh" in i for i in got), got
    assert any("h3: nodeops_chief: 'maybe' is not a boolean" in i for i in got), got
    ok = write(tmp_path, "b.ini", "h1 ansible_host=10.0.0.1\nh2 ansible_ssh_host=10.0.0.2 ansible_ssh_user=ml "
               "ansible_ssh_port=2200 nodeops_chief=yes\n")  # fmt: skip
    s = load_spec(ok).spec  # hosts without a section header; the ansible_ssh_* spellings; an INI boolean
    assert s.chief.address == "10.0.0.2" and s.group(s.chief).username == "ml" and s.group(s.chief).port == 2200
