"""Job lifecycle on the controller: run ids, the local job dir, following logs, teardown.

Each host of a run has ``~/.nodeops/runs/<run id>/`` with ``job.sh``, ``pgid``, ``host.log``,
``exit_code`` (when the job ended), ``follow.sh`` and ``kill.sh`` (written by the launch
playbook). The controller streams every host's log through ``follow.sh`` over ssh, and when
one host fails (or on Ctrl-C/SIGTERM) runs ``kill.sh`` on every host at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import re
import secrets
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nodeops.errors import NodeopsError
from nodeops.interrupts import ignoring_interrupts
from nodeops.launch import protocol as P
from nodeops.quoting import sh_word
from nodeops.render import pins_digest, ssh_config_text, ssh_target_from_record

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
TAIL_LINES = 200  # torchrun's failure summary and shutdown alone is ~40 lines; keep the rank's last words too
SHOWN_LINES = 20  # of them, the failing rank's own last lines shown under FAILED


class JobError(NodeopsError):
    pass


class RunIdError(JobError):
    """A run id that is malformed or unknown here: usage, nothing was run (exit 2)."""

    exit_code = 2


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise RunIdError(f"{run_id!r} is not a run id (like 20261122-101500-ab12); see `ls ~/.nodeops/jobs`")
    return run_id


def jobs_dir() -> Path:
    base = Path(os.environ.get("NODEOPS_HOME") or Path.home() / ".nodeops")
    d = base / "jobs"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def remote_dir(run_id: str) -> str:
    return P.run_dir(check_run_id(run_id))  # relative to the login user's home


@dataclass
class HostState:
    host: str
    exit_code: int | None = None  # None: still running; -1: lost (ssh died or job killed)
    lost_reason: str = ""
    stopped: bool = False  # stopped by a teardown (the supervisor's or ours): a victim, never a cause
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ended_at: float = 0.0


@dataclass
class JobResult:
    run_id: str
    hosts: dict[str, HostState]
    root_cause: HostState | None
    interrupted: bool
    teardown_seconds: float | None
    teardown_problems: dict[str, str] = field(default_factory=dict)  # host -> why it may not be clean
    supervisor: dict[str, Any] | None = None  # the chief supervisor's result.json
    stopped_elsewhere: bool = False  # stopped by a request from elsewhere (nodeops stop), not our Ctrl-C
    folded: dict[str, int] = field(default_factory=dict)  # host -> lines kept out of the live stream

    @property
    def exit_code(self) -> int:
        """0; 130 interrupted; else the failing rank's own code, except the codes nodeops keeps
        for itself (2: bad usage, nothing was run; 130: interrupted), which become 1."""
        if self.interrupted:
            return 130
        if self.root_cause is not None:
            code = failure_code(self.root_cause) or 1
            return 1 if code in (2, 130) or not 0 < code < 256 else code
        return 0

    def __post_init__(self) -> None:
        self.teardown_problems = {h: why for h, why in self.teardown_problems.items() if why}


def fan_out(hosts: Sequence[K], fn: Callable[[K], T], width: int | None = None) -> dict[K, T]:
    """fn(host) on every host at once (one thread each, as pdsh does, or at most ``width``);
    host -> result, in order. Any hashable key works (a run id, a (host, config) pair)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(hosts), width or len(hosts)))) as pool:
        return dict(zip(hosts, pool.map(fn, hosts), strict=True))


def ssh_argv(ssh_config: Path, host: str, *command: str) -> list[str]:
    """ssh to a host through the cluster's generated ssh_config (strict host keys, multiplexed)."""
    opts = [a for o in P.SSH_TIMEOUTS for a in ("-o", o)]
    return ["ssh", "-F", str(ssh_config), *opts, host, *command]


def last_line(text: str, default: str) -> str:
    """The last non-blank line of a command's stderr (ssh puts its reason there), or default."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else default


@dataclass(frozen=True)
class Job:
    """The run record on the controller (``~/.nodeops/jobs/<run id>/job.json``), written by
    ``launch`` and read by ``status``/``logs``/``stop``; one typed record, saved and loaded here."""

    run_id: str
    dir: Path
    hosts: list[str]  # hosts that run a job.sh (their logs are followed)
    argv: list[str]
    runner: str
    chief: str = ""  # where the supervisor runs
    spec: str = ""
    started: float = 0.0
    rank_hosts: list[str] = field(default_factory=list)  # mpirun: the host of each global rank
    all_hosts: list[str] = field(default_factory=list)  # every host of the spec: where stop/teardown run
    pdsh_hosts: dict[str, str] = field(default_factory=dict)  # deepspeed: pdsh's address prefix -> host
    backend: str = "ssh"  # or "slurm": status/logs/stop go through squeue/scancel on the login node
    slurm_job: str = ""  # the Slurm job id
    slurm_login: str = ""  # the login node's alias in ssh_config ('' : Slurm's commands run here)
    slurm_state: str = ""  # the last job state seen (Slurm forgets a job MinJobAge after its end)

    @property
    def kill_hosts(self) -> list[str]:
        return self.all_hosts or self.hosts

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    def save(self) -> None:
        import dataclasses
        import json

        record = {k: v for k, v in dataclasses.asdict(self).items() if k != "dir"}
        (self.dir / "job.json").write_text(json.dumps(record, indent=2))


def find(run_id: str | None) -> Job:
    """The job with this run id, or the latest one when run_id is None."""
    import dataclasses
    import json

    if run_id is None:
        ids = sorted(p.name for p in jobs_dir().iterdir() if RUN_ID.match(p.name))
        if not ids:
            raise RunIdError("no job has been launched from this machine yet")
        run_id = ids[-1]
    d = jobs_dir() / check_run_id(run_id)
    if not (d / "job.json").is_file():
        raise RunIdError(f"no job {run_id} in {jobs_dir()}")
    meta = json.loads((d / "job.json").read_text())
    if not (d / "ssh_config").exists() and isinstance(meta.get("connection"), dict):
        write_ssh_config(d, meta["connection"])  # a run the launch playbook started
    known = {f.name for f in dataclasses.fields(Job)} - {"dir"}
    job = Job(dir=d, **{k: v for k, v in meta.items() if k in known})
    return job if job.chief else dataclasses.replace(job, chief=(job.all_hosts or job.hosts)[0])


def write_ssh_config(d: Path, connection: dict[str, Any]) -> None:
    """The run's ssh_config from the connection data the launch role recorded for each host."""
    import hashlib

    targets = [ssh_target_from_record(h, c, str(d / "known_hosts")) for h, c in connection.items()]
    pins = pins_digest(t.known_hosts for t in targets)  # other pins: another master (render.control_tag)
    tag = hashlib.sha256((repr(sorted(connection.items(), key=str)) + pins).encode()).hexdigest()[:10]
    text = ssh_config_text(
        targets, tag, f"Generated by nodeops from the run record {d.name}/job.json (nodeops.cluster.launch)"
    )
    tmp = d / "ssh_config.tmp"
    tmp.write_text(text)
    tmp.replace(d / "ssh_config")


def host_states(job: Job) -> dict[str, str]:
    """Each host's state: running, exited CODE, killed, idle (no job here and none of the run's
    processes), or unreachable (with ssh's reason)."""

    def one(host: str) -> str:
        try:
            d = sh_word(remote_dir(job.run_id))
            p = subprocess.run(ssh_argv(job.ssh_config, host, f"test -d {d} || {{ echo missing; exit 0; }}; "
                                        f"exec bash {d}/status.sh"),
                               capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "unreachable: ssh timed out"
        if p.returncode != 0:
            return "unreachable: " + last_line(p.stderr, "ssh failed")
        return p.stdout.strip()

    return fan_out(job.kill_hosts, one)  # every host of the run: mpirun/deepspeed ranks run where no job.sh is


def read_logs(job: Job) -> dict[str, list[str]]:
    def one(host: str) -> list[str]:
        p = subprocess.run(ssh_argv(job.ssh_config, host, "cat", sh_word(f"{remote_dir(job.run_id)}/host.log")),
                           capture_output=True, text=True, timeout=60, check=False, errors="replace")  # fmt: skip
        return p.stdout.splitlines()

    return fan_out(job.hosts, one)


def teardown(ssh_config: Path, hosts: Sequence[str], run_id: str) -> dict[str, str]:
    """Run kill.sh on every host in parallel (SIGTERM the group, then SIGKILL what is left).

    Returns host -> "" when kill.sh confirmed that nothing of the run is left there, else why
    not (unreachable, with ssh's reason; or how many processes survived)."""
    # A host that never got the run's files has nothing of it to stop.
    d = sh_word(remote_dir(run_id))
    script = f"test -d {d} || {{ echo {P.STOPPED}; exit 0; }}; exec bash {d}/kill.sh"

    def kill(host: str) -> str:
        try:
            p = subprocess.run(ssh_argv(ssh_config, host, script), capture_output=True, text=True,
                               timeout=30, check=False, start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "unreachable: kill.sh did not answer within 30s"
        if P.STOPPED in p.stdout:
            return ""
        left = re.search(re.escape(P.LEFT) + r"(\d+)", p.stdout)
        if left:
            return f"{left.group(1)} process(es) of the run survived SIGKILL"
        return "unreachable: " + last_line(p.stderr, f"ssh exited {p.returncode}")

    return fan_out(hosts, kill)


def describe(result: dict[str, Any]) -> str:
    """The supervisor's verdict in one line."""
    first = result.get("first_failure")
    if result.get("outcome") == "failed" and first:
        took = result.get("teardown_seconds")
        return (f"failed: first failure on {first['host']} ({first.get('why', '')}); every other host stopped"
                + (f" in {took:.1f}s" if took is not None else ""))  # fmt: skip
    return {"ok": "finished: every job exited 0", "stopped": "stopped on request"}.get(
        str(result.get("outcome")), f"supervisor: {result.get('outcome')} {result.get('error', '')}".strip()
    )


def request_stop(ssh_config: Path, chief: str, run_id: str) -> bool:
    """Ask the chief's supervisor to stop the run (it stops every host and writes its result)."""
    try:
        p = subprocess.run(ssh_argv(ssh_config, chief, "touch", sh_word(f"{remote_dir(run_id)}/{P.STOP_REQUEST}")),
                           capture_output=True, timeout=20, check=False, start_new_session=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0


def fetch_result(ssh_config: Path, chief: str, run_id: str, wait: float = P.RESULT_WAIT) -> dict[str, Any] | None:
    """The supervisor's result.json from the chief, waiting up to ``wait`` seconds for it."""
    import json

    deadline = time.monotonic() + wait
    f = sh_word(f"{remote_dir(run_id)}/{P.RESULT}")
    script = f"for _ in $(seq 0 {int(wait * 5)}); do [ -e {f} ] && exec cat {f}; sleep 0.2; done"
    while True:
        try:
            p = subprocess.run(ssh_argv(ssh_config, chief, script), capture_output=True, text=True,
                               timeout=wait + 15, check=False, start_new_session=True)  # fmt: skip
            if p.returncode == 0 and p.stdout.strip():
                return dict(json.loads(p.stdout))
        except (subprocess.TimeoutExpired, ValueError):
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def follow(
    ssh_config: Path,
    hosts: Sequence[str],
    run_id: str,
    emit: Callable[[str, str], None],
    *,
    chief: str,
    stop_on_interrupt: bool = True,
    kill_hosts: Sequence[str] = (),
    addresses: dict[str, str] | None = None,
    rank_hosts: Sequence[str] = (),
    fold_after_failure: bool = False,
) -> JobResult:
    """Stream every host's log until all jobs end, then read the supervisor's verdict.

    This only reads: fail-fast is the chief's supervisor's decision, for attached and detached
    runs alike. On Ctrl-C or SIGTERM with ``stop_on_interrupt`` (``nodeops launch``), it asks
    the supervisor to stop the run and waits for every host to end; only when the chief cannot
    be reached (or nothing ends within 20 s) does it run kill on every host itself. Without it
    (``nodeops logs -f``) Ctrl-C only stops reading. ``addresses``: address -> host, to name the
    host in pdsh's lines (DeepSpeed's runner); ``rank_hosts``: mpirun's rank -> host.
    ``fold_after_failure`` (an attached launch): a host's lines are held back once its torchrun
    says it got a death signal (the supervisor's teardown: a SignalException traceback follows),
    and every other host's once a host's job has failed. A held host whose own job then fails
    gets its lines emitted at that moment; the rest stay in the logs and the tails and are
    counted in ``folded``, so the failure report is not buried under them.
    """
    states = {h: HostState(h) for h in hosts}
    kill_hosts = list(kill_hosts) or list(hosts)
    remote_tails: dict[str, deque[str]] = {}  # pdsh: each node's own lines, by address
    rank_tails: dict[int, deque[str]] = {}  # mpirun: each rank's own lines
    events: queue.Queue[tuple[str, str | None]] = queue.Queue()
    procs: dict[str, subprocess.Popen[str]] = {}
    script = sh_word(f"{remote_dir(run_id)}/follow.sh")

    def reader(host: str) -> None:
        # Its own session: a Ctrl-C in the terminal reaches nodeops, which decides; not the ssh.
        p = subprocess.Popen(ssh_argv(ssh_config, host, "bash", script), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)  # fmt: skip
        procs[host] = p
        assert p.stdout is not None and p.stderr is not None
        for line in p.stdout:
            events.put((host, line.rstrip("\n")))
        rc = p.wait()
        err = p.stderr.read().strip().splitlines()
        if rc != 0:
            events.put((host, f"@@nodeops-lost ssh exited {rc}: {err[-1] if err else ''}"))
        events.put((host, None))

    for h in hosts:
        threading.Thread(target=reader, args=(h,), daemon=True).start()
    interrupted = False
    teardown_result: dict[str, str] = {}
    done: set[str] = set()
    failed: list[str] = []  # hosts whose job failed, in the order it was seen
    held: dict[str, list[str]] = {}  # fold_after_failure: lines held back after the first failure
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    def pump(until: float | None = None) -> None:
        while len(done) < len(hosts) and (until is None or time.monotonic() < until):
            try:
                host, line = events.get(timeout=0.2)
            except queue.Empty:
                continue
            st = states[host]
            if line is None:
                done.add(host)
                if st.exit_code is None:
                    st.exit_code, st.ended_at = -1, time.monotonic()
                    st.lost_reason = st.lost_reason or "connection to the host was lost"
            elif line.startswith("@@nodeops-lost "):
                st.lost_reason = line.removeprefix("@@nodeops-lost ")
            elif line.startswith(P.EXIT_MARK):
                value = line.removeprefix(P.EXIT_MARK).strip()
                st.exit_code = int(value) if value.lstrip("-").isdigit() else -1
                st.ended_at = time.monotonic()
                if st.exit_code == -1:
                    st.stopped = value == "killed"
                    st.lost_reason = "the job was stopped" if st.stopped else f"the job {value}"
                if st.exit_code != 0 and not st.stopped:
                    failed.append(host)
                    for own in held.pop(host, []):  # its own failure's lines: shown after all
                        emit(host, own)
            else:
                st.tail.append(line)
                if fold_after_failure and host not in failed and (host in held or failed or TEARDOWN_LINE.search(line)):
                    held.setdefault(host, []).append(line)
                else:
                    emit(host, line)
                prefixed = pdsh_split(line, addresses or {})
                if prefixed is not None:
                    remote_tails.setdefault(prefixed[0], deque(maxlen=TAIL_LINES)).append(prefixed[1])
                for rank, text in mpi_pieces(line)[1] if rank_hosts else ():
                    rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        pump()
    except KeyboardInterrupt:
        interrupted = True
        if stop_on_interrupt:
            # The supervisor stops every host (its guards' connections are already open); then
            # kill on every host confirms that nothing is left, and does the job itself when the
            # chief could not be asked or nothing ended within 20 s.
            # A second Ctrl-C must not cut the teardown short: ignore SIGINT/SIGTERM meanwhile.
            with ignoring_interrupts():
                asked = request_stop(ssh_config, chief, run_id)
                pump(until=time.monotonic() + (20 if asked else 0))
                teardown_result = teardown(ssh_config, kill_hosts, run_id)
        for p in procs.values():
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    result = None if (interrupted and not stop_on_interrupt) else fetch_result(ssh_config, chief, run_id)
    root: HostState | None = None
    stopped = (result or {}).get("outcome") == "stopped"
    if not interrupted and not stopped:
        blame_peers(states, remote_tails, addresses or {})
        first = (result or {}).get("first_failure")
        root = root_cause(list(states.values()), named=first["host"] if first else "")
        root = blame_mpi_rank(root, rank_tails, rank_hosts) if root is not None else None
        if root is None and first:  # the supervisor saw what the logs did not (a lost host, say)
            root = states.setdefault(first["host"], HostState(first["host"]))
            root.exit_code = first.get("code") or -1
            root.lost_reason = root.lost_reason or first.get("why", "")
    teardown_s = (result or {}).get("teardown_seconds")
    if result is not None and not teardown_result:
        teardown_result = {h: ("" if v.get("left") in (0, None) and v.get("ended") != "lost"
                               else f"{v.get('ended')}: {v.get('lost') or 'not confirmed'}")
                           for h, v in result.get("hosts", {}).items()}  # fmt: skip
    elif result is None and not (interrupted and not stop_on_interrupt):
        teardown_result = {"supervisor": "no result from the chief's supervisor"}
    return JobResult(
        run_id,
        states,
        root,
        interrupted or stopped,
        teardown_s,
        teardown_result,
        result,
        stopped_elsewhere=stopped and not interrupted,
        folded={h: len(lines) for h, lines in held.items() if lines},
    )


# torchrun's word that it was told to stop (torch.distributed.elastic's agent: "Received
# Signals.SIGTERM death signal, shutting down workers"); its SignalException traceback follows.
TEARDOWN_LINE = re.compile(r"death signal, shutting down workers")

_MPI_TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")
_MPI_FIRST = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
_MPI_EXIT = re.compile(r"Exit code:\s+(-?\d+)")


def mpi_pieces(line: str) -> tuple[str, list[tuple[int, str]]]:
    """Open MPI's --tag-output pieces of one physical line: the untagged text before the first
    tag, and (rank, text) for each tagged piece."""
    parts = _MPI_TAG.split(line)
    return parts[0], [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]


def blame_mpi_rank(root: HostState, rank_tails: dict[int, deque[str]], rank_hosts: Sequence[str]) -> HostState:
    """mpirun reports the first rank that failed ("Process name: [[job,1],R]", "Exit code: N"):
    name that rank's own host, with that rank's own lines, instead of mpirun's host."""
    text = "\n".join(root.tail)
    m, code = _MPI_FIRST.search(text), _MPI_EXIT.search(text)
    if not m or not rank_hosts:
        return root
    rank = int(m.group(1))
    host = rank_hosts[rank] if rank < len(rank_hosts) else root.host
    st = HostState(f"{host} [rank{rank}]")
    st.exit_code = int(code.group(1)) if code else root.exit_code
    st.tail.extend(rank_tails.get(rank, []))
    st.ended_at = root.ended_at
    return st


_BLAMED_PEER = re.compile(r"by peer \[([0-9A-Fa-f.:]+)\]")
_DS_RANK_EXIT = re.compile(r"exits with return code = (-?\d+)")


def blame_peers(states: dict[str, HostState], remote_tails: dict[str, deque[str]], addresses: dict[str, str]) -> None:
    """pdsh may report a peer's failure before the node that caused it, and the teardown can
    end pdsh before it reports the cause at all. gloo names the peer that went away
    ("Connection closed by peer [ADDR]"): that node becomes a failed host too, with its own
    lines and DeepSpeed's "exits with return code = N" as its code."""
    for st in list(states.values()):
        for line in list(st.tail):
            m = _BLAMED_PEER.search(line)
            name = addresses.get(m.group(1)) if m else None
            if m is None or name is None or states.get(name, HostState(name)).exit_code not in (None, 0):
                continue
            b = states.setdefault(name, HostState(name))
            b.tail.extend(remote_tails.get(m.group(1), []))
            codes = [int(c) for t in b.tail for c in _DS_RANK_EXIT.findall(t)]
            b.exit_code = next((c for c in codes if c > 0), -1)
            b.lost_reason = b.lost_reason or f"the peer that {st.host}'s ranks lost first"
            b.ended_at = st.ended_at


def pdsh_split(line: str, addresses: dict[str, str]) -> tuple[str, str] | None:
    """pdsh prefixes each node's lines with `ADDRESS: `: (address, rest), or None."""
    addr, sep, rest = line.partition(": ")
    return (addr, rest) if sep and addr in addresses else None


def pdsh_failure(line: str, addresses: dict[str, str]) -> tuple[str, int] | None:
    """pdsh's report of a node whose command failed: (host, exit code), or None."""
    m = P.PDSH_EXIT.match(line)
    if not m or m.group(2) == "0":
        return None
    return addresses.get(m.group(1), m.group(1)), int(m.group(2))


def _address_of(host: str, addresses: dict[str, str] | None) -> str:
    return next((a for a, h in (addresses or {}).items() if h == host), host)


# torchrun's failure summary: "exitcode  : 1 (pid: 123)" for a rank that exited by itself,
# "exitcode  : -6 (pid: 123)  (SIGABRT)" for one killed by a signal (often a peer's failure).
_RANK_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def failure_code(st: HostState) -> int | None:
    """The host's job exit code, or when the job was stopped (fail-fast may stop the failing
    host too, when a peer's torchrun reported first) its rank's own code from torchrun's lines."""
    if st.exit_code is not None and st.exit_code > 0:
        return st.exit_code
    codes = [int(c) for line in st.tail for c in _RANK_EXIT.findall(line)]
    return next((c for c in codes if c > 0), None)


def own_failure(st: HostState) -> bool:
    """torchrun's lines say a rank here exited with a code of its own (> 0): it failed by itself,
    even when the supervisor's stop then reached this host."""
    return any(int(c) > 0 for line in st.tail for c in _RANK_EXIT.findall(line))


def root_cause(states: Sequence[HostState], named: str = "") -> HostState | None:
    """The failure that started it. A host whose ranks report a lost peer (gloo and NCCL abort
    the others within the same second) ranks after one that failed by itself; a rank that
    exited with a real code beats one that died of a signal; then the supervisor's choice
    (``named``: it classified each report as it came); then the earliest. A host the supervisor
    stopped is not a cause, unless the supervisor named it (its rank had failed by itself before
    the stop came, as the host's guard reported)."""
    failed = [s for s in states if s.exit_code not in (0, None) and (not s.stopped or s.host == named)]
    if not failed:
        return None

    def key(s: HostState) -> tuple[int, int, int, float]:
        victim = any(P.PEER_LOST.search(line) for line in s.tail)
        return (1 if victim else 0, 0 if own_failure(s) else 1, 0 if s.host == named else 1, s.ended_at)

    return min(failed, key=key)


# torchrun's own lines (its agent logs in glog form, its ChildFailedError traceback and summary),
# as opposed to what the ranks printed.
_AGENT_LINE = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
_RANK_LINE = re.compile(r"^\[rank\d+\]:")


def failure_lines(tail: Sequence[str]) -> tuple[list[str], list[str]]:
    """A failed host's lines split in two: what its ranks printed (up to torchrun's first
    failure line, the last SHOWN_LINES of it, torchrun's own log lines and NCCL's INFO lines left
    out), and torchrun's failure report from there on (its summary, shown with -v)."""
    lines = list(tail)
    at = next((i for i, line in enumerate(lines) if P.AGENT_FAILED.search(line)), len(lines))
    # torchrun echoes the ranks' files with a delay: their `[rankN]:` lines may come after its own
    late = [line for line in lines[at:] if _RANK_LINE.match(line)]
    # NCCL_DEBUG=INFO chatter (its teardown lines included) would push the traceback out of view
    own = [line for line in lines[:at] if not _AGENT_LINE.match(line) and "NCCL INFO" not in line] + [
        line for line in late if "NCCL INFO" not in line
    ]
    return own[-SHOWN_LINES:], [line for line in lines[at:] if not _RANK_LINE.match(line)]
