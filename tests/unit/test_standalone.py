"""The project stands on its own: nothing under tests/, scripts/, bench/ or .ci/ reads outside
the repository, so a clone alone passes `bash scripts/test.sh`.

The scan looks for the ways a path escapes the checkout: a parent of the repository root
(`ROOT.parent`, `parents[N]` past the root), a literal `../shared` or `../..` climbing out,
and absolute paths into the team's workspace. `.ci/run` also runs the suite from a fresh
clone in an empty directory, which proves the same from the other side.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..conftest import PEERS, ROOT

SCANNED = ["tests", "scripts", "bench", ".ci", "examples"]
SUFFIXES = {".py", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".md", ""}
ESCAPES = [
    (re.compile(r"\bROOT\.parent\b"), "a parent of the repository root"),
    (re.compile(r"\.\./shared\b"), "the workspace's shared/ beside the checkout"),
    (re.compile(r"/work/(shared|\.library)\b"), "an absolute path into the workspace"),
    (re.compile(r"\bshared/peers\b"), "the workspace's peers data (use tests/data/peers)"),
]
SELF = Path(__file__).resolve()


def _files() -> list[Path]:
    out = []
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in SUFFIXES and p.resolve() != SELF and "/data/peers/" not in str(p):
                out.append(p)
    return out


def test_scan_covers_the_test_tree() -> None:
    files = _files()
    assert any(p.name == "conftest.py" for p in files)
    assert len(files) > 50, [str(p) for p in files]


@pytest.mark.parametrize("pattern,what", ESCAPES, ids=[w for _, w in ESCAPES])
def test_no_file_reads_outside_the_repository(pattern: re.Pattern[str], what: str) -> None:
    hits = []
    for p in _files():
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, f"{what}:\n" + "\n".join(hits)


def test_scan_catches_an_escape(tmp_path: Path) -> None:
    # The scan must be able to fail: a line of the kind it looks for is found.
    line = 'CORPUS = ROOT.parent / "shared" / "peers"'
    assert any(pattern.search(line) for pattern, _ in ESCAPES)


def test_peer_data_is_in_the_repository_with_its_source() -> None:
    for peer in ("autodist", "deepspeed"):
        d = PEERS / peer
        assert d.is_dir() and d.resolve().is_relative_to(ROOT), d
        source = (d / "SOURCE.md").read_text()
        assert "Apache-2.0" in source, f"{d}/SOURCE.md names no licence"
