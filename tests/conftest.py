from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Test data from other projects, copied into the repository with its source and licence
# (tests/data/peers/*/SOURCE.md): no test reads outside the repository.
PEERS = ROOT / "tests" / "data" / "peers"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="Rewrite golden files from the current output.")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))
