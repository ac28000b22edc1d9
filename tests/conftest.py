from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Test data from other projects, copied into the repository with its source and licence
# (tests/data/peers/*/SOURCE.md): no test reads outside the repository.
PEERS = ROOT / "tests" / "data" / "peers"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="Rewrite golden files from the current output.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh runs ``-n 4 --dist loadgroup``), every integration test
    runs on one worker, in file order: they share the Docker sandboxes and their module and
    session fixtures, and their timings assume the machine's cores. The unit tests spread over
    the other workers meanwhile (many of them wait on real clocks: heartbeats, stalls). They are
    done within minutes, while the first integration files (test_check, test_collection: no
    timing bounds) still set up their sandboxes; the timed ones come later. Unit files whose
    tests share one run id (found by tag in /proc) are grouped the same way, in the file."""
    integration = ROOT / "tests" / "integration"
    for item in items:
        if item.path.is_relative_to(integration):
            item.add_marker(pytest.mark.xdist_group("sandbox"))


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))
