"""Issue 14: `gpus: auto`: parsing nvidia-smi, the controller's record, resolution for launch
and check. (Discovery itself is one ssh per node: the sandbox integration test runs it; the
nodes there have no NVIDIA GPU, so the live path with GPUs is untested here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeops.check import preflight as check
from nodeops.errors import SpecError
from nodeops.launch import launchers
from nodeops.setup import gpus
from nodeops.setup.render import hostfile
from nodeops.spec.load import load_spec_text

SPEC = """
name: auto-test
nodes:
  - {address: 10.0.0.1, chief: true, gpus: auto}
  - {address: 10.0.0.2, gpus: auto}
  - {address: 10.0.0.3, gpus: [0, 1]}
"""


@pytest.mark.parametrize(("out", "ids"), [
    ("0\n1\n2\n3\n", [0, 1, 2, 3]),
    ("1\n0\n", [0, 1]),
    ("", []),  # nvidia-smi runs and lists none
    # a driver that does not answer is an error to fix, never "no GPU" (discovery names the host)
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", None),
])  # fmt: skip
def test_nvidia_smi_index_column(out: str, ids: list[int] | None) -> None:
    assert gpus.parse(out) == ids


def test_launch_needs_the_record_then_uses_the_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    loaded = load_spec_text(SPEC)
    assert gpus.auto_nodes(loaded) == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(SpecError, match=r"gpus: auto on 10\.0\.0\.1, 10\.0\.0\.2: not discovered yet"):
        gpus.resolved(loaded)
    unresolved = gpus.resolved(loaded, required=False)
    assert [loaded.spec.nproc(n) for n in unresolved.spec.nodes] == [1, 1, 2]
    assert any("not discovered yet; counted as 1 process" in str(w) for w in unresolved.warnings)
    gpus.save(loaded, {"10.0.0.1": [0, 1, 2, 3], "10.0.0.2": []})
    assert gpus.record_path(loaded) == tmp_path / "clusters" / "auto-test" / "gpus.json"
    r = gpus.resolved(loaded)
    s = r.spec
    assert [s.nproc(n) for n in s.ranked_nodes()] == [4, 1, 2]  # no NVIDIA GPU: 1 process
    assert r.discovered_gpus == {"10.0.0.1": [0, 1, 2, 3], "10.0.0.2": []}
    gpus.record_path(loaded).write_text('{"10.0.0.1": ["x"], "10.0.0.2": [0, 0]}')  # hand-edited: ignored
    with pytest.raises(SpecError, match="not discovered yet"):
        gpus.resolved(loaded)
    plan = launchers.plan(s, ["t.py"], "r")
    assert [h.argv[h.argv.index("--nproc-per-node") + 1] for h in plan] == ["4", "1", "2"]
    assert "--rdzv-backend" in plan[0].argv  # uneven counts: c10d
    assert hostfile(s).splitlines()[-3:] == ["10.0.0.1 slots=4", "10.0.0.2 slots=1", "10.0.0.3 slots=2"]


def test_check_says_a_node_without_gpus_runs_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    loaded = load_spec_text(SPEC)
    gpus.save(loaded, {"10.0.0.1": [], "10.0.0.2": []})
    r = gpus.resolved(loaded)
    node = r.spec.nodes[0]
    row = check._gpu_row(node, "10.0.0.1", {"nvidia_smi": {"rc": 127, "gpus": []}}, {}, {}, r.discovered_gpus)
    assert (row.status, row.detail) == ("ok", "gpus: auto: no NVIDIA GPU found at setup; runs 1 process")
    unresolved = load_spec_text(SPEC).spec.nodes[0]
    row = check._gpu_row(unresolved, "10.0.0.1", {"nvidia_smi": {"rc": 127, "gpus": []}}, {}, {})
    assert row.status == "warn" and "not discovered yet (run setup)" in row.detail
