"""Every AutoDist resource spec in tests/data/peers/autodist validates unchanged.

The one exception is hackathon-model-v1.yml: two loopback nodes and no chief. Current
AutoDist rejects it too, and our rules (one chief; no loopback in a multi-node spec) must.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeops.errors import SpecError
from nodeops.spec.loading import load_spec
from nodeops.spec.model import LEGACY_GROUP

from ...conftest import PEERS

CORPUS = PEERS / "autodist"
REFUSED = {"hackathon-model-v1.yml"}
FILES = sorted(p for p in CORPUS.glob("*.yml") if p.name not in REFUSED)


def test_corpus_present() -> None:
    assert len(FILES) >= 25, f"AutoDist corpus missing under {CORPUS}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_autodist_spec_validates(path: Path) -> None:
    loaded = load_spec(path)
    spec = loaded.spec
    assert spec.ranked_nodes()[0] is spec.chief
    assert all(i.severity == "warning" for i in loaded.warnings)


def test_old_ungrouped_ssh_applies_to_every_node() -> None:
    spec = load_spec(CORPUS / "r1-old-2019-10-ungrouped-ssh.yml").spec
    assert list(spec.ssh) == [LEGACY_GROUP]
    for node in spec.nodes:
        assert spec.group(node).username == "autodist"
        assert spec.group(node).python_venv == "source /home/autodist/venv/autodist/bin/activate"


def test_grouped_port_and_heterogeneous_cpus() -> None:
    spec = load_spec(CORPUS / "r9.yml").spec
    assert [spec.group(n).port for n in spec.nodes] == [12345, 12345]
    assert [spec.nproc(n) for n in spec.nodes] == [1, 1]  # CPU-only nodes run one process each


def test_two_groups_chief_without_ssh_config_uses_defaults() -> None:
    spec = load_spec(CORPUS / "docs-multi-node-2.yml").spec
    chief, n1, n2 = spec.ranked_nodes()
    assert spec.group_name(chief) is None
    assert spec.group(n2).shared_envs == {"LD_LIBRARY_PATH": "$LD_LIBRARY_PATH:/usr/local/cuda/lib64"}
    assert [spec.nproc(n) for n in (chief, n1, n2)] == [4, 4, 2]


def test_missing_key_file_is_a_warning_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_key"
    spec = tmp_path / "r1.yml"
    spec.write_text((CORPUS / "r1.yml").read_text().replace("/root/.ssh/id_rsa", str(missing)))
    from nodeops.setup.render import controller_issues

    loaded = load_spec(spec)
    assert loaded.warnings == []  # the spec is valid; this machine lacks the key (what validate warns about):
    found = controller_issues(loaded, None, "warning")
    assert [(w.field, w.severity, w.line) for w in found] == [("ssh.conf.key_file", "warning", 14)]
    assert found[0].message == f"{missing} does not exist on this machine"


def test_hackathon_v1_is_refused_with_both_reasons() -> None:
    with pytest.raises(SpecError) as info:
        load_spec(CORPUS / "hackathon-model-v1.yml")
    text = "\n".join(map(str, info.value.issues))
    assert "none is marked chief" in text
    assert text.count("loopback") == 2
