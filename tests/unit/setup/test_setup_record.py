"""The setup record and what a spec edited since needs (nodeops.setup.state): pure, on files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeops.setup import render
from nodeops.setup import state as setup_state
from nodeops.spec.load import load_spec_text

BASE = """
name: lab
nodes:
  - {address: 10.0.0.1, name: node1, chief: true}
  - {address: 10.0.0.2, name: node2}
python: {venv: ~/.venvs/train, packages: ["torch==2.13.0", numpy]}
workdir: {path: /srv/train}
env:
  OMP_NUM_THREADS: 1
  TOKEN: {from_env: MY_TOKEN, secret: true}
"""


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    return tmp_path


def diffs(text: str) -> list[setup_state.Difference]:
    got = setup_state.differences(load_spec_text(text, "cluster.yaml"))
    assert got is not None
    return got


def test_without_a_record_nothing_is_compared() -> None:
    assert setup_state.differences(load_spec_text(BASE, "cluster.yaml")) is None


def test_the_same_spec_after_setup_differs_in_nothing() -> None:
    setup_state.record(load_spec_text(BASE, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    assert diffs(BASE) == []


def test_a_new_runner_needs_its_packages_and_names_the_fix() -> None:
    loaded = load_spec_text(BASE, "cluster.yaml")
    setup_state.record(loaded, ["node1", "node2"], setup_state.ROLES)
    changed = load_spec_text(BASE + "launch: {runner: mpirun}\n", "cluster.yaml")
    got = setup_state.differences(changed)
    assert got == [setup_state.Difference("launch.runner: mpirun", "needs openmpi-bin, which setup has not installed",
                                          "packages", ("node1", "node2"))]  # fmt: skip
    assert setup_state.fix(changed, got) == "nodeops setup cluster.yaml --tags packages"


def test_installs_accumulate_what_is_rewritten_must_match() -> None:
    setup_state.record(load_spec_text(BASE, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    assert diffs(BASE.replace(", numpy]", "]")) == []  # a package dropped from the list is still there
    [d] = diffs(BASE.replace("torch==2.13.0", "torch==2.14.0"))
    assert (d.what, d.role) == ("python.packages", "python_env") and "torch==2.14.0" in d.detail
    [d] = diffs(BASE.replace("OMP_NUM_THREADS: 1", "OMP_NUM_THREADS: 4"))
    assert (d.what, d.role, d.detail) == ("env", "nccl_env", "OMP_NUM_THREADS not as setup wrote it in env.sh")
    assert diffs(BASE.replace("  OMP_NUM_THREADS: 1\n", "")) == []  # what the spec no longer sets: left alone
    [d] = diffs(BASE + "network: {ib: 'off'}\n")
    assert (d.what, d.detail) == ("network", "NCCL_IB_DISABLE not as setup wrote it in env.sh")
    [d] = diffs(BASE.replace("/srv/train", "/srv/other"))
    assert (d.what, d.role) == ("workdir.path", "shared_path")


def test_a_new_node_and_a_partial_setup(home: Path) -> None:
    setup_state.record(load_spec_text(BASE, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    grown = BASE.replace("  - {address: 10.0.0.2, name: node2}\n",
                         "  - {address: 10.0.0.2, name: node2}\n  - {address: 10.0.0.3, name: node3}\n")  # fmt: skip
    got = diffs(grown)
    # one cause, named once: the node never set up (not again on every node whose mesh lacks it)
    assert got == [setup_state.Difference("nodes", "never set up", "all roles", ("node3",))]
    assert setup_state.fix(load_spec_text(grown, "cluster.yaml"), got) == "nodeops setup cluster.yaml"
    # set up alone (setup --limit node3): now the others' mesh lacks it
    setup_state.record(load_spec_text(grown, "cluster.yaml"), ["node3"], setup_state.ROLES)
    assert diffs(grown) == [
        setup_state.Difference("nodes", "node3 not in the chief's ssh mesh", "ssh_mesh", ("node1", "node2"))
    ]
    # `setup --tags python_env` records that role alone; the others keep what they had
    setup_state.record(load_spec_text(BASE.replace("numpy", "scipy"), "cluster.yaml"), ["node1"], ["python_env"])
    doc = json.loads((home / "clusters" / "lab" / "setup.json").read_text())
    assert doc["hosts"]["node1"]["python_env"] == {"~/.venvs/train": ["numpy", "scipy", "torch==2.13.0"]}
    assert doc["hosts"]["node2"]["python_env"] == {"~/.venvs/train": ["numpy", "torch==2.13.0"]}
    assert doc["hosts"]["node1"]["packages"] == doc["hosts"]["node2"]["packages"]


def test_secret_values_are_never_recorded_not_even_as_digests(home: Path) -> None:
    inline = BASE.replace("{from_env: MY_TOKEN, secret: true}", "{value: hunter2-very-secret, secret: true}")
    setup_state.record(load_spec_text(inline, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    text = (home / "clusters" / "lab" / "setup.json").read_text()
    assert "hunter2" not in text and '"TOKEN": "secret"' in text
    assert setup_state._digest("hunter2-very-secret") not in text
    # and so a changed secret is not a difference (the documented limit)
    assert diffs(inline.replace("hunter2-very-secret", "other")) == []


def test_a_host_of_the_same_name_at_another_address_was_never_set_up() -> None:
    setup_state.record(load_spec_text(BASE, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    got = diffs(BASE.replace("10.0.0.2", "10.0.0.9"))
    assert setup_state.Difference("nodes", "never set up", "all roles", ("node2",)) in got


def test_a_damaged_record_reads_as_none(home: Path) -> None:
    (home / "clusters" / "lab").mkdir(parents=True)
    (home / "clusters" / "lab" / "setup.json").write_text('{"version": 1, "hosts": {"node1": "x"}}')
    assert setup_state.differences(load_spec_text(BASE, "cluster.yaml")) is None


def test_what_launch_sync_provides_is_not_refused() -> None:
    setup_state.record(load_spec_text(BASE, "cluster.yaml"), ["node1", "node2"], setup_state.ROLES)
    moved = load_spec_text(BASE.replace("/srv/train", "/srv/other"), "cluster.yaml")
    assert setup_state.differences(moved, ignore=["shared_path"]) == []


@pytest.mark.parametrize(
    ("packages", "py_spy", "tools"),
    [(["torch==2.13.0"], None, ["py-spy"]), (["Py_Spy>=0.4"], None, []), (["py-spy @ file:///w/py_spy.whl"], None, []),
     (["./wheels/x.whl"], None, ["py-spy"]), (["torch"], False, []), (["torch"], True, ["py-spy"])],
)  # fmt: skip
def test_setup_adds_py_spy_unless_listed_or_off(packages: list[str], py_spy: bool | None, tools: list[str]) -> None:
    spec = load_spec_text(BASE, "cluster.yaml").spec
    assert spec.python is not None
    py = spec.python.model_copy(update={"packages": packages, "py_spy": py_spy})
    assert render.python_tools(py) == tools
