"""Integration fixtures: one real 3-node sandbox (sshd containers) per test session.

The tests talk to it with real ssh and real Ansible. If no Docker engine answers, the
session fails rather than skipping, unless NODEOPS_SKIP_INTEGRATION=1 says to skip on
purpose (never set in CI).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from nodeops import sandbox

SESSION_NAME = f"pytest{os.getpid()}"
SESSION_SUBNET = "10.214.0.0/24"


@pytest.fixture(scope="session")
def sandbox_cluster() -> Iterator[sandbox.Sandbox]:
    if os.environ.get("NODEOPS_SKIP_INTEGRATION") == "1":
        pytest.skip("NODEOPS_SKIP_INTEGRATION=1")
    sb = sandbox.up(name=SESSION_NAME, n=3, subnet=SESSION_SUBNET, say=print)
    try:
        yield sb
    finally:
        sandbox.down(SESSION_NAME)
