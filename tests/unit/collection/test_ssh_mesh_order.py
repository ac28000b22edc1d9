"""ssh_mesh_check's probe order: in a full mesh every node starts at its own place in the list,
so no target gets every node's first probes at once (sshd's MaxStartups drops past 10)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("ssh_mesh_check", ROOT / "plugins/modules/ssh_mesh_check.py")
assert _spec is not None and _spec.loader is not None
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)

TARGETS = [{"name": f"node{i}", "address": f"10.0.0.{i}"} for i in range(1, 65)]


def test_probes_start_after_this_host_and_wrap_around() -> None:
    names = [t["name"] for t in mod.rotated(TARGETS[:4], "node2")]
    assert names == ["node3", "node4", "node1", "node2"]


def test_a_host_not_in_the_list_starts_at_the_first() -> None:
    assert mod.rotated(TARGETS[:3], "") == TARGETS[:3]
    assert mod.rotated(TARGETS[:3], "chief-elsewhere") == TARGETS[:3]


def test_a_full_mesh_first_wave_stays_below_maxstartups() -> None:
    """Every node's first WIDTH probes: how many land on one target at once."""
    first = Counter(t["name"] for me in TARGETS for t in mod.rotated(TARGETS, me["name"])[: mod.WIDTH])
    assert max(first.values()) == mod.WIDTH < 10
