"""The interface every backend (ssh, Slurm, ...) implements, and what the lifecycle asks of it.

Modelled on TorchX's ``Scheduler`` (a dry run as a value, ``schedule``, ``describe``,
``log_iter``, ``cancel``, ``list``) and SkyPilot's ``Backend`` (sync, execute, teardown); see
docs/design.md ("Backends: the interface"). A backend declares what it supports in
:class:`Capabilities`; the lifecycle refuses anything else before a host is reached, with the same words on every
backend. A backend never prints: what the user sees goes through a :class:`Sink`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from nodeops.backends.starter import RunFile
    from nodeops.backends.store import Job
    from nodeops.check.preflight import Report
    from nodeops.spec.model import LoadedSpec


class Sink(Protocol):
    """Where the lifecycle's events go; the CLI prints them, a test records them."""

    def note(self, text: str) -> None:
        """Progress and verdicts (the CLI's stderr)."""

    def out(self, text: str) -> None:
        """The command's own result (the CLI's stdout): a run id, a state row, a dry run."""

    def line(self, host: str, text: str) -> None:
        """One line of a job's log, as ``host`` wrote it (the CLI adds the ``host [rankN]:`` form)."""

    def report(self, report: Any) -> None:
        """A measurement's report (a fabric report) to show beside the progress (stderr)."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; every option of `launch`/`check` that needs one of these is
    refused (exit 2, nothing run) on a backend that lacks it."""

    runners: frozenset[str]  # what spec validation admits for `launch.runner` (tests/unit/backends/test_backends.py)
    detach: bool  # launch --detach: return once the job runs (a launch follows its job by default, everywhere)
    via_ansible: bool  # launch --via ansible: start the jobs through the launch.yml playbook
    script: bool  # launch --script: a bash script that calls $NODEOPS_RUNNER
    fabric: bool  # check --fabric: the fabric measurement (Backend.fabric_nodes, Backend.run_probe)
    sync: bool  # launch --sync (setup's shared_path role first)
    preflight: bool  # the preflight before a launch (--no-check skips it)
    hang: bool = False  # launch --hang-timeout / launch.hang_timeout: the hang watchdog
    stacks: bool = False  # nodeops stacks RUN_ID (a command of its own, refused by lifecycle.control)
    flight_recorder: bool = False  # launch.flight_recorder: true (its default, GPUs, is on only where declared)
    restarts: bool = False  # launch.restarts > 0, spare nodes: automatic recovery
    fabric_check: bool = False  # launch --fabric-check: the measurement on the nodes the job then gets
    fabric_check_in_job: bool = False  # ... as the job's own step before training (the backend's launch ships it)


# The option that needs each capability, as the user types it (one wording on every backend).
OPTION_OF: Mapping[str, str] = {
    "detach": "--detach",
    "via_ansible": "--via ansible",
    "script": "--script",
    "fabric_check": "--fabric-check",
    "sync": "--sync",
    "hang": "--hang-timeout (launch.hang_timeout)",
    "flight_recorder": "launch.flight_recorder: true",
    "restarts": "launch.restarts (automatic recovery, spare nodes)",
}


@dataclass
class LaunchRequest:
    """What `nodeops launch` asks for, parsed (no CLI types)."""

    spec_path: Path
    argv: list[str]
    script: str | None = None
    detach: bool = False
    attach: bool = False  # the default on every backend; said explicitly, it conflicts with --detach
    via: Literal["ssh", "ansible"] = "ssh"
    check: bool = True
    dry_run: bool = False
    verbose: bool = False
    sync: bool = False
    fabric_check: bool = False
    hang_timeout: float | None = None  # seconds; None: the spec's launch.hang_timeout; 0: off

    def script_file(self) -> str | None:
        """The file launch will run in the workdir: --script's, else the training script (not `-m mod`)."""
        if self.script is not None:
            return self.script
        return self.argv[0] if self.argv and not self.argv[0].startswith("-") else None

    def asked(self) -> dict[str, bool]:
        """Which capabilities this request needs (keys of :data:`OPTION_OF`)."""
        return {"detach": self.detach, "via_ansible": self.via != "ssh", "script": self.script is not None,
                "fabric_check": self.fabric_check, "sync": self.sync, "hang": bool(self.hang_timeout)}  # fmt: skip


@dataclass
class DryRun:
    """A launch's dry run as a value: what would be submitted or started, in order, each entry
    for stdout (``out``) or stderr (``note``). Nothing was started and no host was reached."""

    entries: list[tuple[Literal["out", "note"], str]] = field(default_factory=list)

    def out(self, text: str) -> None:
        self.entries.append(("out", text))

    def note(self, text: str) -> None:
        self.entries.append(("note", text))


@dataclass
class RunState:
    """A run's state as `nodeops runs` shows it, from the backend (None fields: not known)."""

    state: str  # running | ok | failed | stopped | gone | unreachable | unknown
    detail: str = ""
    exit_code: int | None = None
    verdict: bool = False  # the state is a final verdict (else inferred)
    reached: bool = True  # False: ssh never reached where the run is controlled (its chief is gone, say)


class Backend(abc.ABC):
    """One way of running a job on the cluster. Subclasses register in ``nodeops.backends``."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # setup's roles that have no use on this backend: skipped, and refused under --tags
    setup_skips: ClassVar[tuple[str, ...]] = ()

    def refusals(self, asked: Mapping[str, bool]) -> list[str]:
        """The options asked for that this backend lacks, as the user typed them."""
        caps = dataclasses.asdict(self.capabilities)
        return [OPTION_OF[k] for k, on in asked.items() if on and not caps[k]]

    def files(self, loaded: LoadedSpec) -> dict[str, str]:
        """Files this backend adds to `nodeops render` (name -> text)."""
        return {}

    @abc.abstractmethod
    def summary(self, loaded: LoadedSpec) -> str:
        """What `nodeops validate` says of a valid spec, after "valid: "."""

    @abc.abstractmethod
    def check(self, loaded: LoadedSpec, timeout: float, sink: Sink) -> Report:
        """`nodeops check`: every node probed at once, judged (nothing changed anywhere)."""

    @abc.abstractmethod
    def dry_run(self, loaded: LoadedSpec, request: LaunchRequest) -> DryRun:
        """What a launch would do, as a value; reaches no host."""

    @abc.abstractmethod
    def launch(self, loaded: LoadedSpec, request: LaunchRequest, sink: Sink) -> None:
        """Start the job (gates already passed); follow it unless detached. Raises
        :class:`nodeops.errors.ExitWith` with the run's code when it does not end in success."""

    @abc.abstractmethod
    def status(self, job: Job, sink: Sink) -> None:
        """Each host's (or the job's) state; ExitWith(1) when not ok."""

    @abc.abstractmethod
    def logs(self, job: Job, follow: bool, sink: Sink) -> None:
        """The job's log lines; ``follow`` streams until it ends (then its verdict)."""

    @abc.abstractmethod
    def stop(self, job: Job, sink: Sink) -> None:
        """Stop every process of the job and confirm it; ExitWith(1) when not confirmed."""

    def stacks(self, job: Job, native: bool, method: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Every rank's stack of a live run, taken at once on every host (nodeops.node.stacks'
        dumps, each with its ``host``), and host -> why none came from there. Only where
        ``capabilities.stacks``."""
        raise NotImplementedError

    def fabric_nodes(self, loaded: LoadedSpec) -> tuple[list[str] | int, list[int]]:
        """`check --fabric`'s nodes: their names in node-rank order (or how many, where the
        scheduler names them once the job runs), and each one's GPU count. Only where
        ``capabilities.fabric``."""
        raise NotImplementedError

    def run_probe(self, loaded: LoadedSpec, spec_path: Path, probe: RunFile, args: Sequence[str], sink: Sink, *,
                  env: Mapping[str, str], emit: Callable[[str, str], None], run_id: str,
                  seconds: float) -> None:  # fmt: skip
        """A measurement as an ordinary torchrun run of ``probe`` (shipped into the run's dir)
        with ``args``: the spec's env file, Python env and ports, ``env`` on top of them, every
        log line to ``emit`` (not ``sink.line``); followed to its end (Ctrl-C stops it).
        ``seconds``: its budget (a scheduler's time limit is made from it). Raises
        :class:`nodeops.errors.ExitWith` unless it ends in success. Only where ``capabilities.fabric``."""
        raise NotImplementedError

    @abc.abstractmethod
    def run_state(self, job: Job, connect_timeout: int | None = None) -> RunState:
        """The run's state for `nodeops runs`/`clean`/`stop` (one look; never raises for a host).
        ``connect_timeout``: seconds to wait for the connection to the run's host (its chief, its
        login node), instead of nodeops' usual 10; a host that does not answer is "unreachable"."""
