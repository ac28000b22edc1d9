"""`nodeops status` over ssh: the summary line of a run without a verdict yet."""

from __future__ import annotations

import time
from pathlib import Path

from nodeops.backends import store
from nodeops.backends.ssh.backend import running_summary


def job(tmp: Path, started: float) -> store.Job:
    return store.Job(run_id="20261127-220000-ab12", dir=tmp, hosts=["node1", "node2", "node3"], argv=["t.py"],
                     runner="torchrun", chief="node1", started=started)  # fmt: skip


def test_a_running_run_says_on_how_many_hosts_and_since_when(tmp_path: Path) -> None:
    t0 = time.mktime((2026, 11, 27, 22, 0, 0, 0, 0, -1))
    states = {"node1": "running (2 process(es))", "node2": "running (2 process(es))", "node3": "exited 0"}
    line = running_summary(job(tmp_path, t0), states, now=t0 + 3725)
    assert line == "run 20261127-220000-ab12: running on 2 of 3 host(s), started 22:00:00 (1h02m ago)"
    assert running_summary(job(tmp_path, t0), states, now=t0 + 65).endswith("(1m05s ago)")
    assert running_summary(job(tmp_path, t0), states, now=t0 + 7).endswith("(7s ago)")


def test_no_host_running_and_no_verdict_says_where_to_look(tmp_path: Path) -> None:
    line = running_summary(job(tmp_path, 0.0), {"node1": "exited 1", "node2": "unreachable: ssh: timed out"})
    assert line == ("run 20261127-220000-ab12: no verdict yet, and no host runs it; "
                    "`nodeops logs 20261127-220000-ab12` has its end")  # fmt: skip
