"""What launch refuses before it starts anything, when the spec names a node that setup never
reached: a node this machine cannot reach at all is named with the OS's reason and the right
fix (bring it up, or take it out: `nodeops setup` cannot reach it either), once. Real sockets
on this machine; nothing else runs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeops.errors import ExitWith, UsageError
from nodeops.lifecycle import gates
from nodeops.setup import state as setup_state
from nodeops.spec.load import load_spec_text
from nodeops.transport import tcp_reason

SPEC = """
name: lab
nodes:
  - {{address: 127.0.0.1, name: {name}, chief: true}}
ssh:
  g: {{port: {port}}}
"""


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    """A port that listens, and one that does not (bound, never listening: refused)."""
    with socket.socket() as up, socket.socket() as down:
        up.bind(("127.0.0.1", 0))
        up.listen()
        down.bind(("127.0.0.1", 0))
        yield up.getsockname()[1], down.getsockname()[1]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    return tmp_path


def test_tcp_reason_says_why_or_nothing(ports: tuple[int, int]) -> None:
    up, down = ports
    assert tcp_reason("127.0.0.1", up) == ""
    assert tcp_reason("127.0.0.1", down) == f"127.0.0.1:{down}: Connection refused"


def test_a_new_node_that_cannot_be_reached_is_named_with_its_cause_and_the_right_fix(ports: tuple[int, int]) -> None:
    up, down = ports
    setup_state.record(load_spec_text(SPEC.format(name="node1", port=up), "c.yaml"), ["node1"], setup_state.ROLES)
    dead = load_spec_text(SPEC.format(name="node2", port=down), "c.yaml")
    with pytest.raises(ExitWith) as e:
        gates.setup_gate(dead, "started")
    assert e.value.exit_code == 1
    assert e.value.message.splitlines() == [
        f"node2: 127.0.0.1:{down}: Connection refused",
        "node2 cannot be reached from this machine (never set up, and setup cannot reach it either); nothing was "
        "started. fix: bring the node up, or take it out of the spec",
    ]
    # reachable but never set up: setup is the fix
    alive = load_spec_text(SPEC.format(name="node2", port=up), "c.yaml")
    with pytest.raises(UsageError, match=r"nodes: never set up \(on node2\)\n  fix: nodeops setup c.yaml"):
        gates.setup_gate(alive, "started")
