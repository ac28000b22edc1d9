"""Which run a command acts on (``control.pick``): a run id, a spec file's latest run, or without
either the latest run (named) -- except ``stop``, which without a name acts only on the one live
run and refuses when several are live. And ``stacks`` waiting for a run that is still starting.
Against an in-memory backend: no ssh, nothing runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import pytest

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.base import Capabilities, RunState
from nodeops.errors import UsageError
from nodeops.lifecycle import control

from ..backends.test_backends import FakeBackend, Recorder


class States(FakeBackend):
    """Each run's state as the test says; stacks: no rank until ``ranks_after`` asks."""

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = dataclasses.replace(FakeBackend.capabilities, stacks=True)

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, str] = {}
        self.ranks_after = 10**9
        self.asked = 0
        self.connect_timeouts: list[int | None] = []

    def run_state(self, job: store.Job, connect_timeout: int | None = None) -> RunState:
        self.connect_timeouts.append(connect_timeout)
        if self.states.get(job.run_id) == "unreachable":
            return RunState("unreachable", "node1: ssh: connect to host 10.9.0.11 port 22: Connection timed out")
        return RunState(self.states.get(job.run_id, "ok"), "as the test says")

    def stacks(self, job: store.Job, native: bool, method: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        self.asked += 1
        if self.asked < self.ranks_after:
            return [], {"node1": "running"}
        return [{"rank": 0, "host": "node1", "pid": 1, "method": "signal", "raw": "", "frames": []}], {}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> States:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "home"))
    backend = States()
    monkeypatch.setitem(backends.REGISTRY, "fake", backend)
    return backend


def record(run_id: str, spec: Path, started: float) -> str:
    d = store.jobs_dir() / run_id
    d.mkdir(mode=0o700)
    store.Job(run_id=run_id, dir=d, hosts=["node1"], argv=["t.py"], runner="torchrun", chief="node1",
              spec=str(spec.resolve()), started=started, backend="fake").save()  # fmt: skip
    return run_id


@pytest.fixture
def two_clusters(fake: States, tmp_path: Path) -> tuple[Path, Path, list[str]]:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("nodes: []\n")
    b.write_text("nodes: []\n")
    ids = [record("20261126-100000-aaaa", a, 1.0), record("20261126-110000-bbbb", b, 2.0),
           record("20261126-120000-cccc", a, 3.0)]  # fmt: skip
    return a, b, ids


def test_plain_stop_refuses_when_two_runs_are_live_and_names_them_with_their_specs(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    a, b, ids = two_clusters
    fake.states = {ids[1]: "running", ids[2]: "running"}
    with pytest.raises(UsageError) as e:
        control.stop(None, Recorder())
    msg = str(e.value)
    assert msg.startswith("2 runs are live here; say which to stop"), msg
    assert f"{ids[2]}  running  fake  {a.resolve()}" in msg and f"{ids[1]}  running  fake  {b.resolve()}" in msg
    assert ids[0] not in msg
    assert e.value.exit_code == 2
    assert fake.calls == []  # nothing was stopped


def test_plain_stop_acts_on_the_one_live_run_even_when_a_later_one_ended(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    _, b, ids = two_clusters
    fake.states = {ids[1]: "running"}  # the latest (ids[2]) has ended
    sink = Recorder()
    control.stop(None, sink)
    assert fake.calls == [("stop", ids[1])]
    assert sink.events[0] == ("note", f"run {ids[1]} ({b.resolve()}): the only live run here")


def test_plain_stop_gives_each_chief_a_short_connect_and_names_the_runs_whose_chief_did_not_answer(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    # a run recorded here whose cluster is gone would cost ssh's usual 10 s connect timeout
    _, b, ids = two_clusters
    fake.states = {ids[0]: "unreachable", ids[1]: "running", ids[2]: "unreachable"}
    sink = Recorder()
    control.stop(None, sink)
    assert fake.connect_timeouts == [control.QUICK_CONNECT] * 3
    assert fake.calls == [("stop", ids[1])]
    why = "node1: ssh: connect to host 10.9.0.11 port 22: Connection timed out"
    assert sink.events[0] == ("note", f"not counted: 2 run(s) could not be asked (ssh gets {control.QUICK_CONNECT} "
                                      f"s to connect to a run's chief or Slurm login node): {ids[2]} ({why}); "
                                      f"{ids[0]} ({why}); `nodeops runs` lists them; name one to stop it")  # fmt: skip
    assert sink.events[1] == ("note", f"run {ids[1]} ({b.resolve()}): the only live run here")


def test_plain_stop_with_no_live_run_but_runs_it_could_not_ask_refuses_and_stops_nothing(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    """One of them may be the live run (a slow chief): `stop` must not fall back to the latest."""
    _, _, ids = two_clusters
    fake.states = {ids[1]: "unreachable"}  # the others ended
    with pytest.raises(UsageError) as e:
        control.stop(None, Recorder())
    msg = str(e.value)
    assert msg.startswith("no run here answered as live, and 1 run(s) could not be asked"), msg
    assert f"{ids[1]} (node1: ssh: connect" in msg and f"nodeops stop {ids[1]}" in msg, msg
    assert e.value.exit_code == 2
    assert fake.calls == []  # nothing was stopped


def test_a_spec_names_its_latest_run(fake: States, two_clusters: tuple[Path, Path, list[str]]) -> None:
    a, b, ids = two_clusters
    fake.states = {ids[1]: "running", ids[2]: "running"}
    sink = Recorder()
    control.stop(str(b), sink)
    control.status(str(a), sink)
    assert fake.calls == [("stop", ids[1]), ("status", ids[2])]
    assert ("note", f"run {ids[2]}: the latest launched from {a.resolve()}") in sink.events


def test_status_without_a_name_shows_the_latest_and_says_which(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    a, _, ids = two_clusters
    sink = Recorder()
    control.status(None, sink)
    assert fake.calls == [("status", ids[2])]
    assert sink.events[0] == ("note", f"run {ids[2]} ({a.resolve()}): the latest launched from this machine")


def test_what_is_neither_a_run_id_nor_a_spec_is_refused(fake: States, tmp_path: Path) -> None:
    with pytest.raises(store.RunIdError, match=r"'node1' is neither a run id .* nor a spec file"):
        control.status("node1", Recorder())
    other = tmp_path / "other.yaml"
    other.write_text("nodes: []\n")
    with pytest.raises(store.RunIdError, match=f"no run was launched from {other.resolve()}"):
        control.stop(str(other), Recorder())
    assert fake.calls == []


def test_stacks_waits_for_a_starting_runs_ranks(
    fake: States, two_clusters: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, ids = two_clusters
    monkeypatch.setattr(control, "STACKS_POLL", 0.01)
    fake.states = {ids[2]: "running"}
    fake.ranks_after = 3
    sink = Recorder()
    doc = control.stacks(ids[2], False, "auto", sink)
    assert fake.asked == 3 and [g["ranks"] for g in doc["groups"]] == [[0]]
    assert ("note", f"run {ids[2]} has no rank yet (as the test says); waiting up to 60 s for its ranks to start") \
        in sink.events  # fmt: skip


def test_stacks_gives_up_on_a_run_that_starts_no_rank(
    fake: States, two_clusters: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, ids = two_clusters
    monkeypatch.setattr(control, "STACKS_POLL", 0.01)
    monkeypatch.setattr(control, "STACKS_WAIT", 0.1)
    fake.states = {ids[2]: "running"}
    with pytest.raises(UsageError, match=f"run {ids[2]} started no rank within 0 s"):
        control.stacks(ids[2], False, "auto", Recorder())
    fake.states = {}  # ended: no wait, the usual answer
    fake.asked = 0
    with pytest.raises(UsageError, match=f"run {ids[2]} has no live rank to take a stack of"):
        control.stacks(ids[2], False, "auto", Recorder())
    assert fake.asked == 1


def test_stop_by_spec_takes_its_live_run_and_refuses_two(
    fake: States, two_clusters: tuple[Path, Path, list[str]]
) -> None:
    a, _, ids = two_clusters
    fake.states = {ids[0]: "running"}  # the older run of a.yaml is live; its latest (ids[2]) ended
    sink = Recorder()
    control.stop(str(a), sink)
    assert fake.calls == [("stop", ids[0])]
    assert ("note", f"run {ids[0]}: the live run launched from {a.resolve()}") in sink.events
    fake.states = {ids[0]: "running", ids[2]: "running"}
    with pytest.raises(UsageError, match=r"^2 runs of this spec are live here; say which to stop \(a run id\)"):
        control.stop(str(a), Recorder())
    assert fake.calls == [("stop", ids[0])]
