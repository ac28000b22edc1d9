from __future__ import annotations

import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Test data from other projects, copied into the repository with its source and licence
# (tests/data/peers/*/SOURCE.md): no test reads outside the repository.
PEERS = ROOT / "tests" / "data" / "peers"


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background of a non-interactive shell (`bash scripts/test.sh &`,
    `nohup ... &`) inherits SIGINT ignored, and so would every process the tests start: Python
    then installs no KeyboardInterrupt handler, and the Ctrl-C tests (`nodeops launch` interrupted)
    would fail for the way the suite was started. SIGINT is handled here again; the processes the
    tests start get the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="Rewrite golden files from the current output.")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))
