"""No import cycles anywhere in the package (function-level imports included), and the layers
contract in pyproject.toml holds (`lint-imports`, also run by scripts/test.sh)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from ..conftest import ROOT


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("nodeops", cache_dir=None)
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back and imported.startswith("nodeops.") and not importer.startswith(imported + "."):
                cycles.append(" -> ".join([importer, *back]))
    assert not cycles, "\n".join(cycles)


LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
def test_layers_contract_is_kept() -> None:
    p = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


def picture_rows(design: str) -> list[str]:
    """The layer rows of docs/design.md's "Layout" picture: the left column of its first code
    block, each name without its ``/`` or ``.py``, ``|`` kept."""
    block = design.split("## Layout", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        if line and not line[0].isspace():
            left = line.split("  ", 1)[0].strip()
            rows.append(" | ".join(w.strip().removesuffix("/").removesuffix(".py") for w in left.split("|")))
    return rows


def test_the_design_docs_picture_is_the_layers_contract() -> None:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [" | ".join(m.strip().removeprefix("nodeops.") for m in row.split("|"))
              for row in contract["layers"] if row != "nodeops.__main__"]  # fmt: skip
    assert picture_rows((ROOT / "docs" / "design.md").read_text()) == layers


def test_every_module_is_in_a_layer_of_the_picture() -> None:
    """No module floats beside the layers: each top-level module or package of nodeops is one
    of the picture's names (a new module must be placed, in the contract and the picture)."""
    names = {w.strip() for row in picture_rows((ROOT / "docs" / "design.md").read_text()) for w in row.split("|")}
    pkg = ROOT / "src" / "nodeops"
    top = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    top |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    assert top == names
