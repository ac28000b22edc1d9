"""``render`` output is compared byte for byte with golden files in tests/golden/.

Regenerate after an intended change with ``pytest tests/unit/setup/test_render_golden.py --update-golden``
and review the diff. Absolute paths of the checkout are replaced by ``<SPEC_DIR>``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from nodeops import transport
from nodeops.backends import render_files as render
from nodeops.spec.loading import load_spec

from ...conftest import PEERS

HERE = Path(__file__).resolve().parents[2]
GOLDEN = HERE / "golden"
CASES = sorted(HERE.glob("specs/*.happy.yaml")) + [
    PEERS / "autodist" / n for n in ("r1-old-2019-10-ungrouped-ssh.yml", "docs-multi-node-2.yml", "r0.yml")
]
ENV = {"HOME": "/home/test"}


def _render(path: Path) -> dict[str, str]:
    loaded = load_spec(path)
    files = render(loaded, ENV).files
    return {k: v.replace(str(loaded.spec_dir), "<SPEC_DIR>") for k, v in files.items()}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_render_matches_golden(path: Path, update_golden: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # ssh_config's ControlPath digests the contents of the known_hosts files a spec names
    # (render.pins_digest): an empty $HOME makes them "missing" on every machine. The ~ of a
    # ControlPath is ssh's (the passwd entry's home): one short home for it, on every machine
    # (past ~55 characters ssh_config goes without masters: render.control_lines).
    monkeypatch.setattr(transport, "ssh_home", lambda: "/home/test")
    with tempfile.TemporaryDirectory(prefix="home", dir="/tmp") as home:
        monkeypatch.setenv("HOME", home)
        files = _render(path)
    gdir = GOLDEN / path.name.removesuffix(".yaml").removesuffix(".yml")
    if update_golden:
        gdir.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (gdir / name).write_text(content)
    assert sorted(p.name for p in gdir.iterdir()) == sorted(files), f"golden files missing in {gdir}"
    for name, content in files.items():
        assert (gdir / name).read_text() == content, f"{gdir / name} differs; rerun with --update-golden and review"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_render_is_deterministic(path: Path) -> None:
    assert _render(path) == _render(path)


def test_secret_values_never_rendered() -> None:
    files = _render(HERE / "specs/full.happy.yaml")
    blob = "\n".join(files.values())
    assert "s3cr3t-value" not in blob
    assert "API_KEY" in blob and "HF_TOKEN" in blob  # listed by name only
    assert "StrictHostKeyChecking no" not in blob and "StrictHostKeyChecking=no" not in blob
