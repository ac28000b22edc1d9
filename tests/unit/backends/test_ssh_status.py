"""`nodeops status` over ssh: the summary line of a run without a verdict yet, and each host's
state after a failure (the hosts the teardown stopped are not failures). Pure: the hosts' states
and the verdict are given, nothing is connected."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nodeops.backends import store
from nodeops.backends.ssh import run as ssh_run
from nodeops.backends.ssh.backend import SshBackend, running_summary, torn_down
from nodeops.errors import ExitWith

from .test_backends import Recorder


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


KILLED = {"ended": "killed", "sent_stop": True}
FAILED = {"outcome": "failed", "first_failure": {"host": "node2", "code": 1, "why": "exited 1"},
          "teardown_seconds": 0.9, "hosts": {"node1": KILLED, "node2": {"ended": "1", "sent_stop": True},
                                             "node3": KILLED, "node4": {"ended": "1", "sent_stop": True},
                                             "node5": {"ended": "killed", "sent_stop": False}}}  # fmt: skip


def test_the_teardown_s_victims_are_the_hosts_it_killed_after_another_host_s_failure() -> None:
    # node4 exited 1 on its own, node5 was killed by someone else: not the teardown's doing
    assert torn_down(FAILED) == {"node1", "node3"}
    old = {**FAILED, "hosts": {h: {"ended": r["ended"]} for h, r in FAILED["hosts"].items()}}  # type: ignore[attr-defined]
    assert torn_down(old) == set()  # a verdict from before sent_stop was recorded: every host as before
    assert torn_down({**FAILED, "outcome": "hung"}) == set()  # the watchdog stopped every rank
    assert torn_down({**FAILED, "outcome": "stopped", "first_failure": None}) == set()  # `stop`: said otherwise
    assert torn_down({**FAILED, "first_failure": None}) == set()
    assert torn_down(None) == set()


def test_status_of_a_failed_run_names_only_the_failures_as_not_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = {"node1": "killed", "node2": "exited 1", "node3": "killed", "node4": "exited 1", "node5": "killed"}
    monkeypatch.setattr(ssh_run, "host_states", lambda j: states)
    monkeypatch.setattr(ssh_run, "fetch_result", lambda *a, **k: FAILED)
    sink = Recorder()
    with pytest.raises(ExitWith) as e:
        SshBackend().status(job(tmp_path, 0.0), sink)
    assert [ev[1] for ev in sink.events if ev[0] == "out"] == [
        "node1        stopped by the teardown (killed)", "node2        exited 1",
        "node3        stopped by the teardown (killed)", "node4        exited 1", "node5        killed"]  # fmt: skip
    assert str(e.value) == "run 20261127-220000-ab12: not ok on node2, node4, node5"
