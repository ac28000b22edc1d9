"""The lifecycle against a fake in-memory backend (what it asks of a backend, and that it never
prints), and every registered backend's declared capabilities against what the CLI refuses."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from nodeops import backends
from nodeops.backends import store
from nodeops.backends.base import OPTION_OF, Backend, Capabilities, DryRun, LaunchRequest, RunState
from nodeops.check.preflight import Report
from nodeops.cli import app
from nodeops.errors import ExitWith, SpecError, UsageError
from nodeops.lifecycle import control
from nodeops.lifecycle import launch as launch_flow
from nodeops.lifecycle import runs as runs_flow
from nodeops.spec.load import load_spec_text
from nodeops.spec.model import LoadedSpec

from ...conftest import ROOT

SPECS = ROOT / "tests" / "specs"


class Recorder:
    """A Sink that keeps every event, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def note(self, text: str) -> None:
        self.events.append(("note", text))

    def out(self, text: str) -> None:
        self.events.append(("out", text))

    def line(self, host: str, text: str) -> None:
        self.events.append(("line", host, text))

    def report(self, report: Any) -> None:
        self.events.append(("report", repr(report)))


class FakeBackend(Backend):
    """Runs nothing anywhere: each job 'runs' in memory and writes two log lines."""

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(
        runners=frozenset({"torchrun"}), detach=True, via_ansible=False, script=False, fabric=False, sync=False,
        preflight=False,
    )  # fmt: skip

    def __init__(self, exit_code: int = 0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.exit_code = exit_code

    def summary(self, loaded: LoadedSpec) -> str:
        return "fake"

    def check(self, loaded: LoadedSpec, timeout: float, sink: Any) -> Report:
        self.calls.append(("check", timeout))
        return Report([], {}, [])

    def dry_run(self, loaded: LoadedSpec, request: LaunchRequest) -> DryRun:
        out = DryRun()
        out.note("==> would start")
        out.out(f"node1: {' '.join(request.argv)}")
        out.note("==> nothing started")
        return out

    def launch(self, loaded: LoadedSpec, request: LaunchRequest, sink: Any) -> None:
        self.calls.append(("launch", request))
        run_id = store.new_run_id()
        d = store.jobs_dir() / run_id
        d.mkdir(mode=0o700)
        store.Job(run_id=run_id, dir=d, hosts=["node1"], argv=request.argv, runner="torchrun", chief="node1",
                 started=time.time(), backend="fake").save()  # fmt: skip
        sink.line("node1", "[rank0]:hello")
        if self.exit_code:
            raise ExitWith(self.exit_code, f"==> run {run_id} FAILED")
        sink.out(run_id)

    def status(self, job: store.Job, sink: Any) -> None:
        self.calls.append(("status", job.run_id))
        sink.out(f"node1 exited {self.exit_code}")

    def logs(self, job: store.Job, follow: bool, sink: Any) -> None:
        self.calls.append(("logs", follow))
        sink.line("node1", "[rank0]:hello")

    def stop(self, job: store.Job, sink: Any) -> None:
        self.calls.append(("stop", job.run_id))

    def run_state(self, job: store.Job, connect_timeout: int | None = None) -> RunState:
        return RunState("failed" if self.exit_code else "ok", "in memory", self.exit_code, True)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeBackend:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "home"))
    backend = FakeBackend()
    monkeypatch.setitem(backends.REGISTRY, "ssh", backend)  # the minimal spec is an ssh spec
    monkeypatch.setitem(backends.REGISTRY, "fake", backend)  # and its records say "fake"
    return backend


def request(**kw: Any) -> LaunchRequest:
    return LaunchRequest(spec_path=SPECS / "minimal.happy.yaml", argv=["train.py", "--lr", "1e-3"], **kw)


def test_launch_goes_through_the_backend_and_reaches_the_user_only_through_the_sink(
    fake: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = Recorder()
    launch_flow.launch(request(), sink)
    assert [c[0] for c in fake.calls] == ["launch"]
    assert fake.calls[0][1].argv == ["train.py", "--lr", "1e-3"]
    run_id = sink.events[-1][1]
    assert sink.events == [("line", "node1", "[rank0]:hello"), ("out", run_id)]
    assert capsys.readouterr() == ("", "")  # nothing printed below the CLI


def test_a_failed_run_raises_its_exit_code(fake: FakeBackend) -> None:
    fake.exit_code = 3
    with pytest.raises(ExitWith) as e:
        launch_flow.launch(request(), Recorder())
    assert e.value.exit_code == 3 and "FAILED" in e.value.message


def test_dry_run_is_a_value_replayed_in_order_and_starts_nothing(fake: FakeBackend) -> None:
    sink = Recorder()
    launch_flow.launch(request(dry_run=True), sink)
    assert fake.calls == []
    assert sink.events[:3] == [("note", "==> would start"), ("out", "node1: train.py --lr 1e-3"),
                               ("note", "==> nothing started")]  # fmt: skip
    # then the run's timeouts in the order they fire, the same on every backend (spec.timeouts)
    assert [e[0] for e in sink.events[3:]] == ["note"] * len(sink.events[3:])
    assert sink.events[3][1].startswith("timeouts, in the order they fire") and len(sink.events) > 6


@pytest.mark.parametrize("asked", ["script", "via_ansible", "sync", "fabric_check"])
def test_what_the_backend_lacks_is_refused_before_it_is_called(fake: FakeBackend, asked: str) -> None:
    kw: dict[str, Any] = {"script": "run.sh"} if asked == "script" else {"via": "ansible"} if asked == "via_ansible" \
        else {asked: True}  # fmt: skip
    with pytest.raises(UsageError) as e:
        launch_flow.launch(request(**kw), Recorder())
    assert str(e.value) == f"{OPTION_OF[asked]} cannot be used with backend: fake (nothing was run)"
    assert fake.calls == []


def test_status_logs_stop_and_runs_find_the_backend_from_the_record(fake: FakeBackend) -> None:
    sink = Recorder()
    launch_flow.launch(request(), sink)
    run_id = sink.events[-1][1]
    control.status(run_id, sink)
    control.logs(None, True, sink)  # None: the latest run
    control.stop(run_id, sink)
    assert fake.calls[1:] == [("status", run_id), ("logs", True), ("stop", run_id)]
    [run] = runs_flow.local_runs()
    runs_flow.refresh([run])
    assert (run.job.backend, run.state, run.exit_code, run.verdict) == ("fake", "ok", 0, True)


def test_old_records_without_a_backend_are_ssh_runs(tmp_path: Path) -> None:
    job = store.Job(run_id="20261122-101500-ab12", dir=tmp_path, hosts=["h"], argv=[], runner="torchrun")
    assert backends.for_job(job) is backends.REGISTRY["ssh"]
    assert backends.for_job(dataclasses.replace(job, backend="slurm")) is backends.REGISTRY["slurm"]


# --------------------------------------------------------------- every real backend, through the CLI
CLI_OPTIONS: Mapping[str, list[str]] = {
    "detach": ["--detach"],
    "via_ansible": ["--via", "ansible"],
    "script": ["--script", "run.sh"],
    "fabric_check": ["--fabric-check"],
    "sync": ["--sync"],
    "hang": ["--hang-timeout", "10m"],
}
# Capabilities asked for in the spec rather than on the command line.
SPEC_OPTIONS: Mapping[str, str] = {
    "flight_recorder": "launch:\n  flight_recorder: true\n",
    "restarts": "launch:\n  restarts: 2\n",
}


def spec_for(name: str, tmp_path: Path) -> Path:
    key = tmp_path / "id_ed25519"
    key.write_text("not a real key\n")
    src = {"ssh": "minimal.happy.yaml", "slurm": "slurm-sandbox.happy.yaml"}[name]
    spec = tmp_path / "cluster.yaml"
    spec.write_text((SPECS / src).read_text().replace("~/.ssh/id_ed25519", str(key)))
    return spec


def test_every_option_a_capability_needs_is_listed() -> None:
    assert set(CLI_OPTIONS) | set(SPEC_OPTIONS) == set(OPTION_OF)
    assert set(OPTION_OF) < {f.name for f in dataclasses.fields(Capabilities)}


def test_stacks_is_refused_on_a_backend_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    d = store.jobs_dir() / "20261101-101500-ab12"
    d.mkdir()
    store.Job(run_id=d.name, dir=d, hosts=["login"], argv=["t.py"], runner="torchrun", chief="login",
              backend="slurm", handle={"job_id": "7"}).save()  # fmt: skip
    # every backend has stacks now: one without them is made here, to see the refusal
    slurm_cls = type(backends.REGISTRY["slurm"])
    monkeypatch.setattr(slurm_cls, "capabilities", dataclasses.replace(slurm_cls.capabilities, stacks=False))
    r = CliRunner().invoke(app, ["stacks", d.name])
    assert r.exit_code == 2 and "nodeops stacks cannot be used with backend: slurm" in r.output, r.output
    r = CliRunner().invoke(app, ["launch", "--hang-timeout", "soon", "x.yaml", "t.py"])
    assert r.exit_code == 2 and "--hang-timeout 'soon': give seconds or a number with a unit" in r.output, r.output
    r = CliRunner().invoke(app, ["launch", "--hang-timeout", "0.001", "x.yaml", "t.py"])
    assert r.exit_code == 2 and "--hang-timeout '0.001' is too short to mean a hang" in r.output, r.output
    assert "the smallest is 5s" in r.output, r.output


@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_the_cli_refuses_exactly_what_a_backend_lacks(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "home"))
    backend = backends.REGISTRY[name]
    caps = dataclasses.asdict(backend.capabilities)
    spec = spec_for(name, tmp_path)
    for cap, opts in CLI_OPTIONS.items():
        # --dry-run: an accepted option changes nothing and reaches no host
        r = CliRunner().invoke(app, ["launch", "--dry-run", *opts, str(spec), "train.py"])
        refused = f"cannot be used with backend: {name} (nothing was run)" in r.output
        assert refused == (not caps[cap]), (name, cap, r.output)
        assert r.exit_code == (2 if refused else 0), (name, cap, r.output)
    for cap, text in SPEC_OPTIONS.items():
        asking = tmp_path / f"{cap}.yaml"
        # (restarts on Slurm take GPUs per node, not a total: the spec check says so first)
        base = spec.read_text()
        base = base.replace("  gpus: 4\n", "  gpus_per_node: 2\n") if cap == "restarts" else base
        asking.write_text(base + text)
        r = CliRunner().invoke(app, ["launch", "--dry-run", str(asking), "train.py"])
        refused = f"cannot be used with backend: {name} (nothing was run)" in r.output
        assert refused == (not caps[cap]), (name, cap, r.output)
        assert r.exit_code == (2 if refused else 0), (name, cap, r.output)
    if not caps["fabric"]:  # (where fabric is supported, check would reach the hosts: not run here)
        r = CliRunner().invoke(app, ["check", "--fabric", str(spec)])
        assert r.exit_code == 2 and f"--fabric cannot be used with backend: {name}" in r.output
    assert not (tmp_path / "home" / "jobs").exists() or not any((tmp_path / "home" / "jobs").iterdir())


@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
@pytest.mark.parametrize("runner", ["torchrun", "mpirun", "deepspeed"])
def test_spec_validation_admits_exactly_the_runners_a_backend_declares(name: str, runner: str, tmp_path: Path) -> None:
    text = spec_for(name, tmp_path).read_text() + f"launch:\n  runner: {runner}\n"
    declared = runner in backends.REGISTRY[name].capabilities.runners
    try:
        load_spec_text(text, "cluster.yaml")
    except SpecError as e:
        assert not declared, str(e)
        assert any(i.field == "launch.runner" for i in e.issues), str(e)
    else:
        assert declared, f"{runner} validated on {name}, which does not declare it"


def test_detach_and_attach_together_are_refused(fake: FakeBackend) -> None:
    with pytest.raises(UsageError, match="contradict"):
        launch_flow.launch(request(detach=True, attach=True), Recorder())
    assert fake.calls == []
