"""No import cycles anywhere in the package (function-level imports included), and the layers
contract in pyproject.toml holds (`lint-imports`, also run by scripts/test.sh)."""

from __future__ import annotations

import subprocess
import sys
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
