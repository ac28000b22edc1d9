"""The project stands on its own: nothing under tests/, scripts/, bench/, .ci/ or examples/ reads
outside the repository, so a clone alone passes `bash scripts/test.sh`.

What counts as outside is worked out from where the checkout is, not from names written here:
- in Python, a path built from ``__file__`` (``.parent``, ``.parents[N]``) that climbs above the
  repository root, or ``.parent`` taken of the root itself;
- in any file, the absolute path of the directory that holds the checkout, or a relative path
  that climbs out of the repository from the file's directory or from the root (where the
  scripts run).
Nothing beside the checkout is listed or read to decide it: only paths are compared.
`.ci/run` also runs the suite from a fresh clone in an empty directory, which proves the same
from the other side.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ..conftest import PEERS, ROOT

SCANNED = ["tests", "scripts", "bench", ".ci", "examples"]
SUFFIXES = {".py", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".md", ""}
ROOT_NAMES = {"ROOT", "REPO", "REPO_ROOT", "PROJECT_ROOT"}
HOME = ROOT.resolve()
OUTSIDE = HOME.parent  # path arithmetic only: what lies there is never looked at


def _files() -> list[Path]:
    return [p for top in SCANNED for p in sorted((ROOT / top).rglob("*"))
            if p.is_file() and p.suffix in SUFFIXES and PEERS not in p.parents]  # fmt: skip


def _file_steps(node: ast.expr) -> int | None:
    """How many directories up from the file's own a ``Path(__file__)...`` chain goes; None when
    the expression is not such a chain."""
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _file_steps(node.value)
        return None if inner is None else inner + 1
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
        inner = _file_steps(node.value.value)
        index = node.slice
        if inner is None or not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
            return None
        return inner + index.value + 1
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("resolve", "absolute")
    ):
        return _file_steps(node.func.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path" and node.args:
        arg = node.args[0]
        return 0 if isinstance(arg, ast.Name) and arg.id == "__file__" else None
    return None


def escapes(path: Path, text: str) -> list[str]:
    """Each place in ``text`` (the file at ``path``) that reaches outside the repository."""
    out = []
    # a checkout straight under / or /tmp: every absolute /tmp path would count; not judged then
    shared_top = str(OUTSIDE) in ("/", "/tmp", "/var/tmp")
    for n, line in enumerate(text.splitlines(), 1):
        for m in [] if shared_top else re.finditer(re.escape(str(OUTSIDE)) + r"/([\w.-]+)", line):
            if m.group(1) != HOME.name:
                out.append(f"{path}:{n}: absolute path beside the checkout: {line.strip()}")
        for m in re.finditer(r"(?<![\w.])((?:\.\./)+)[\w.-]+", line):
            bases = [path.parent, *([HOME] if path.suffix in (".sh", "") else [])]  # shell scripts run at the root
            climbs = [(base / m.group(0)).resolve() for base in bases]
            if any(not c.is_relative_to(HOME) for c in climbs):
                out.append(f"{path}:{n}: {m.group(0)} climbs out of the repository: {line.strip()}")
    if path.suffix != ".py":
        return out
    depth = len(path.resolve().relative_to(HOME).parts) - 1  # dirs between the file and the root
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "parent" and isinstance(node.value, ast.Name) \
                and node.value.id in ROOT_NAMES:  # fmt: skip
            out.append(f"{path}:{node.lineno}: the parent of the repository root")
        steps = _file_steps(node) if isinstance(node, ast.expr) else None
        if steps is not None and steps > depth + 1:  # depth + 1 steps up is the root itself
            out.append(f"{path}:{node.lineno}: {steps} levels up from a file {depth} below the root")
    return out


def test_scan_covers_the_test_tree() -> None:
    files = _files()
    assert any(p.name == "conftest.py" for p in files)
    assert len(files) > 50, [str(p) for p in files]


def test_no_file_reads_outside_the_repository() -> None:
    hits = [hit for p in _files() for hit in escapes(p, p.read_text(errors="replace"))]
    assert not hits, "\n".join(hits)


def test_scan_catches_each_kind_of_escape() -> None:
    # The scan must be able to fail: each kind of escape, made up here from where the checkout is.
    here = ROOT / "tests" / "unit" / "x.py"
    up = "parent"
    assert escapes(here, f"D = ROOT.{up} / 'notes'\n")
    assert escapes(here, "D = Path(__file__).resolve().parents[3]\n")
    assert escapes(here, f"D = Path(__file__).{up}.{up}.{up}.{up}\n")
    assert not escapes(here, "D = Path(__file__).resolve().parents[2]\n")  # the root itself is fine
    if str(OUTSIDE) not in ("/", "/tmp", "/var/tmp"):
        assert escapes(here, f"D = '{OUTSIDE}/elsewhere/file'\n")
    assert not escapes(here, f"D = '{HOME}/tests'\n")
    assert escapes(ROOT / "scripts" / "x.sh", "cat ../notes/x\n")  # scripts run from the root
    assert escapes(here, f"D = '{'../' * 3}notes'\n")  # three up from tests/unit
    assert not escapes(here, "D = '../data/peers'\n")  # tests/data, from tests/unit: inside


def test_peer_data_is_in_the_repository_with_its_source() -> None:
    for peer in ("autodist", "deepspeed"):
        d = PEERS / peer
        assert d.is_dir() and d.resolve().is_relative_to(ROOT), d
        source = (d / "SOURCE.md").read_text()
        assert "Apache-2.0" in source, f"{d}/SOURCE.md names no licence"
