"""An ssh run seen from the controller: following every host's log, each host's state, the
teardown, and the chief supervisor's verdict.

Each host of a run has ``~/.nodeops/runs/<run id>/`` with ``job.sh``, ``pgid``, ``host.log``,
``exit_code`` (when the job ended), ``follow.sh`` and ``kill.sh`` (written by the launch
playbook). The controller streams every host's log through ``follow.sh`` over ssh, and when
one host fails (or on Ctrl-C/SIGTERM) runs ``kill.sh`` on every host at once.
"""

from __future__ import annotations

import io
import json
import queue
import re
import secrets
import signal
import subprocess
import tarfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeops.backends.store import Job, remote_dir
from nodeops.interrupts import ignoring_interrupts
from nodeops.node import mpi_split
from nodeops.node import protocol as P
from nodeops.node import stacks as S
from nodeops.node import stall as ST
from nodeops.node.failures import (
    TAIL_LINES,
    HostState,
    LiveFold,
    blame_mpi_rank,
    blame_peers,
    exit_code_for,
    failure_code,
    pdsh_split,
    root_cause,
)
from nodeops.quoting import sh_word
from nodeops.transport import fan_out, last_line, limit_error, ssh_argv


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
    hang: dict[str, Any] | None = None  # the hang watchdog stopped the run: its report (suspects, groups)
    # automatic restarts: the attempt followed ended and the supervisor started the next one
    # (the chief's attempts.json: {"total", "attempts": [...]}); None: the run ended
    next_attempts: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        """0; 130 interrupted; else the failing rank's own code, except the codes nodeops keeps
        for itself (2: bad usage, nothing was run; 130: interrupted), which become 1."""
        if self.interrupted:
            return 130
        if self.hang is not None:
            return exit_code_for("hung") or 1
        if self.root_cause is not None:
            kind = str(((self.supervisor or {}).get("first_failure") or {}).get("kind") or "")
            return exit_code_for("failed", failure_code(self.root_cause), kind) or 1
        return 0

    def __post_init__(self) -> None:
        self.teardown_problems = {h: why for h, why in self.teardown_problems.items() if why}


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


def read_logs(job: Job, current: bool = True) -> dict[str, list[str]]:
    """Every host's log: each earlier attempt's (automatic restarts: ``attempts/N/host.log``, in
    order), then the current one's (unless ``current`` is False). Hosts without a log are left out."""
    d = sh_word(remote_dir(job.run_id))
    script = (f"cd {d} 2>/dev/null || exit 0; for n in $(ls {P.ATTEMPTS_DIR} 2>/dev/null | sort -n); do "
              f'cat "{P.ATTEMPTS_DIR}/$n/{P.LOG}" 2>/dev/null; done'
              + (f"; cat {P.LOG} 2>/dev/null" if current else "") + "; exit 0")  # fmt: skip

    def one(host: str) -> list[str]:
        p = subprocess.run(ssh_argv(job.ssh_config, host, script), capture_output=True, text=True, timeout=60,
                           check=False, errors="replace")  # fmt: skip
        return mpi_split.rank_lines(P.log_lines(p.stdout))

    return {h: lines for h, lines in fan_out(job.kill_hosts, one).items() if lines}


def read_chief_json(job: Job, name: str) -> Any:
    """A JSON file of the run dir on the chief (the supervisor's), or None."""
    f = sh_word(f"{remote_dir(job.run_id)}/{name}")
    try:
        p = subprocess.run(ssh_argv(job.ssh_config, job.chief, "cat", f), capture_output=True, text=True, timeout=30,
                           check=False)  # fmt: skip
        return json.loads(p.stdout) if p.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        return None


def read_attempts(job: Job) -> dict[str, Any] | None:
    """The chief's attempts.json (automatic restarts), or None."""
    got = read_chief_json(job, P.ATTEMPTS)
    return dict(got) if isinstance(got, dict) else None


def read_stalls(job: Job) -> list[dict[str, Any]]:
    """Every stall the chief's stall watch reported so far (stalls.json)."""
    got = read_chief_json(job, P.STALLS)
    return [dict(st) for st in got if isinstance(st, dict)] if isinstance(got, list) else []


def teardown(ssh_config: Path, hosts: Sequence[str], run_id: str) -> dict[str, str]:
    """Run kill.sh on every host in parallel (SIGTERM the group, then SIGKILL what is left).

    Returns host -> "" when kill.sh confirmed that nothing of the run is left there, else why
    not (unreachable, with ssh's reason; or how many processes survived)."""
    return {h: why for h, (why, _state) in stop_hosts(ssh_config, hosts, run_id).items()}


def stop_hosts(ssh_config: Path, hosts: Sequence[str], run_id: str) -> dict[str, tuple[str, str]]:
    """:func:`teardown`, with each host's state after it as ``agent.py status`` says it (running,
    exited CODE, killed, idle...; "missing" without the run's dir; "" when the host said none):
    host -> (why not confirmed, or "", state)."""
    # A host that never got the run's files has nothing of it to stop.
    d = sh_word(remote_dir(run_id))
    missing = sh_word(P.STATE + "missing")
    script = f"test -d {d} || {{ echo {P.STOPPED}; echo {missing}; exit 0; }}; exec bash {d}/kill.sh"

    def kill(host: str) -> tuple[str, str]:
        try:
            p = subprocess.run(ssh_argv(ssh_config, host, script), capture_output=True, text=True,
                               timeout=30, check=False, start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "unreachable: kill.sh did not answer within 30s", ""
        state = next((ln[len(P.STATE) :].strip() for ln in p.stdout.splitlines() if ln.startswith(P.STATE)), "")
        if P.STOPPED in p.stdout:
            return "", state
        left = re.search(re.escape(P.LEFT) + r"(\d+)", p.stdout)
        if left:
            return f"{left.group(1)} process(es) of the run survived SIGKILL", state
        return "unreachable: " + last_line(p.stderr, f"ssh exited {p.returncode}"), ""

    return fan_out(hosts, kill)


def fetch_file(ssh_config: Path, host: str, run_id: str, name: str, dest: Path) -> bool:
    """Copy one file of the run dir on a host here (True once it is here)."""
    try:
        p = subprocess.run(ssh_argv(ssh_config, host, "cat", sh_word(f"{remote_dir(run_id)}/{name}")),
                           capture_output=True, timeout=60, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    if p.returncode != 0:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(p.stdout)
    return True


def fetch_flight(job: Job) -> dict[str, int]:
    """PyTorch's flight-recorder dumps (the run dir's ``flight/`` on each host) copied into the
    run's record, ``flight/<host>/``: host -> how many files came (hosts with none left out).
    One tar stream per host; only plain files are taken, and none may leave the dest dir."""
    src = sh_word(f"{remote_dir(job.run_id)}/{S.FLIGHT_DIR}")
    cmd = f'cd {src} 2>/dev/null || exit 0; set -- *; [ -e "$1" ] || exit 0; exec tar -cf - -- "$@"'

    def one(host: str) -> int:
        try:
            p = subprocess.run(ssh_argv(job.ssh_config, host, cmd), capture_output=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            return 0
        if p.returncode not in (0, 1) or not p.stdout:  # 1: a dump changed while tar read it (kept as read)
            return 0
        dest = job.dir / S.FLIGHT_DIR / host
        n = 0
        try:
            with tarfile.open(fileobj=io.BytesIO(p.stdout), mode="r:") as tar:
                for m in tar.getmembers():
                    name = m.name.removeprefix("./")
                    # the dumps are plain files at the top of flight/: nothing else is taken
                    if not m.isfile() or not name or "/" in name or name in (".", ".."):
                        continue
                    src = tar.extractfile(m)
                    if src is None:
                        continue
                    dest.mkdir(parents=True, exist_ok=True)
                    (dest / name).write_bytes(src.read())
                    n += 1
        except (tarfile.TarError, OSError):
            return n
        return n

    return {h: n for h, n in fan_out(job.kill_hosts, one).items() if n}


STACKS_TAKEN_WAIT = 3.0  # how long an ask may wait to be taken by the supervisor (between attempts it is not)


def signal_supervisor(sig: str) -> str:
    """sh, run in the run dir: send ``sig`` (TERM: a stop request; USR1: an ask was left) to
    the run's supervisor, so that it looks now rather than at its next 0.2 s. Only to the
    process its pid file names when that is a supervisor.py whose cwd is this run dir (never
    another run's supervisor, nor a process that reused the pid), and only when it catches the
    signal (its SigCgt): a supervisor of an older nodeops, still running a long job, has no
    USR1 handler, and the signal would end it. Always succeeds: the files the supervisor reads
    are the request; the signal only hurries it."""
    num = int(signal.Signals[f"SIG{sig}"])
    return (f"p=$(cat {P.SUPERVISOR_PID} 2>/dev/null); case $p in ''|*[!0-9]*) ;; "
            f'*) if [ /proc/"$p"/cwd -ef . ] && grep -qs supervisor.py /proc/"$p"/cmdline; then '
            f"m=$(sed -n 's/^SigCgt:[[:space:]]*//p' /proc/\"$p\"/status 2>/dev/null); "
            "case $m in ''|*[!0-9a-fA-F]*) ;; "
            f'*) if [ $(( (0x$m >> {num - 1}) & 1 )) -eq 1 ]; then kill -{sig} "$p" 2>/dev/null; fi ;; esac; '
            "fi ;; esac; true")  # fmt: skip


# sh, in the run dir: the stop request the supervisor reads, and a signal that it reads it now
ASK_STOP = f"touch {P.STOP_REQUEST} && {{ {signal_supervisor('TERM')}; }}"


def stacks_ask_script(run_id: str, ask_id: str, native: bool, method: str) -> str:
    """bash for the chief: leave a stacks ask for the run's supervisor (protocol.STACKS_ASK) and
    print ``answer`` and its answer once written; ``none`` when no supervisor runs there, or it
    did not take the ask within STACKS_TAKEN_WAIT (the ask is then taken back), or no answer
    came within STACKS_ASK_WAIT (the supervisor answers every host it can by then)."""
    ask, answer = P.STACKS_ASK + ask_id, P.STACKS_ANSWER + ask_id + ".json"
    body = sh_word(json.dumps({"native": native, "method": method}))
    taken, waited = round(STACKS_TAKEN_WAIT / RESULT_POLL), round((P.STACKS_ASK_WAIT + 5) / RESULT_POLL)
    return (
        f"cd {sh_word(remote_dir(run_id))} 2>/dev/null || {{ echo none; exit 0; }}; "
        f"p=$(cat {P.SUPERVISOR_PID} 2>/dev/null); "
        f'grep -qs supervisor.py "/proc/$p/cmdline" || {{ echo none; exit 0; }}; '
        f"printf %s {body} > .{ask} && mv -f .{ask} {ask} || {{ echo none; exit 0; }}; "
        f"{signal_supervisor('USR1')}; i=0; "
        # a controller gone meanwhile (Ctrl-C): SIGPIPE ignored, so the answer is still removed
        f"while :; do if [ -e {answer} ]; then trap '' PIPE; echo answer; cat {answer}; rm -f {answer}; exit 0; fi; "
        # not taken in time: taken back (whoever unlinks it owns it), and the hosts are asked one by one
        f"if [ $i -ge {taken} ] && [ -e {ask} ] && rm {ask} 2>/dev/null; then echo none; exit 0; fi; "
        f"[ $i -ge {waited} ] && {{ echo none; exit 0; }}; i=$((i + 1)); sleep {RESULT_POLL}; done"
    )  # fmt: skip


def stacks_via_chief(job: Job, native: bool, method: str) -> dict[str, str]:
    """Every rank's stack through the run's supervisor and the guards it holds: one ssh to the
    chief, no new session or Python on the other hosts. host -> its ``agent.py stacks`` output,
    for the hosts whose guard answered ({} when the supervisor could not be asked)."""
    script = stacks_ask_script(job.run_id, secrets.token_hex(8), native, method)
    try:
        p = subprocess.run(ssh_argv(job.ssh_config, job.chief, script), capture_output=True, text=True,
                           timeout=P.STACKS_ASK_WAIT + 30, check=False, errors="replace")  # fmt: skip
    except subprocess.TimeoutExpired:
        return {}
    head, _, body = p.stdout.partition("\n")
    if p.returncode != 0 or head != "answer":
        return {}
    try:
        hosts = json.loads(body).get("hosts")
    except (ValueError, AttributeError):
        return {}
    return {h: t for h, t in hosts.items() if isinstance(t, str)} if isinstance(hosts, dict) else {}


def take_stacks(job: Job, native: bool = False, method: str = "auto") -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's stack on every host of the run, at once: through the chief's supervisor and
    its guards while the run is supervised (:func:`stacks_via_chief`), and ``agent.py stacks``
    over ssh on every host it did not answer for (a spare, a lost guard, a run that ended).
    Returns the dumps (each with its host), and host -> why no stack came from there."""
    args = ["python3", f"{remote_dir(job.run_id)}/agent.py", "stacks", "--method", method]
    args += ["--native"] if native else []

    def one(host: str) -> tuple[list[dict[str, Any]], str]:
        d = sh_word(remote_dir(job.run_id))
        cmd = f"test -d {d} || {{ echo {sh_word(S.NONE_MARK + 'no run dir here')}; exit 0; }}; exec " + " ".join(
            sh_word(a) for a in args
        )
        try:
            p = subprocess.run(ssh_argv(job.ssh_config, host, cmd), capture_output=True, text=True, timeout=90,
                               check=False, errors="replace")  # fmt: skip
        except subprocess.TimeoutExpired:
            return [], "unreachable: no answer within 90s"
        if p.returncode != 0:
            return [], "unreachable: " + last_line(p.stderr, f"ssh exited {p.returncode}")
        return S.read_answer(p.stdout, host)

    via = {h: S.read_answer(text, h) for h, text in stacks_via_chief(job, native, method).items()}
    rest = [h for h in job.kill_hosts if h not in via]
    got = via | (fan_out(rest, one) if rest else {})
    ordered = [(h, got[h]) for h in job.kill_hosts if h in got]
    return [d for _, (ds, _) in ordered for d in ds], {h: why for h, (ds, why) in ordered if not ds}


def request_stop(ssh_config: Path, chief: str, run_id: str) -> bool:
    """Ask the chief's supervisor to stop the run (it stops every host and writes its result)."""
    try:
        p = subprocess.run(ssh_argv(ssh_config, chief, f"cd {sh_word(remote_dir(run_id))} && {ASK_STOP}"),
                           capture_output=True, timeout=20, check=False, start_new_session=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0


RESULT_POLL = 0.1  # how often the chief looks for a file the controller waits for (a test and a sleep)


def cat_when_there(path: str, wait: float) -> str:
    """bash that prints the file at ``path`` once it exists, looking every RESULT_POLL for up to
    ``wait`` seconds (once, without a sleep, for 0); prints nothing if it never came."""
    f = sh_word(path)
    return (f"i=0; while :; do [ -e {f} ] && exec cat {f}; [ $i -ge {round(wait / RESULT_POLL)} ] && exit 0; "
            f"i=$((i + 1)); sleep {RESULT_POLL}; done")  # fmt: skip


def fetch_result(ssh_config: Path, chief: str, run_id: str, wait: float = P.RESULT_WAIT) -> dict[str, Any] | None:
    """The supervisor's result.json from the chief, waiting up to ``wait`` seconds for it (one
    ssh session that looks every RESULT_POLL; ``wait=0`` looks once, without sleeping)."""
    deadline = time.monotonic() + wait
    script = cat_when_there(f"{remote_dir(run_id)}/{P.RESULT}", wait)
    while True:
        try:
            # its loop counts looks: on a busy chief each sleep overruns, so the ssh gets twice the wait
            p = subprocess.run(ssh_argv(ssh_config, chief, script), capture_output=True, text=True,
                               timeout=2 * wait + 15, check=False, start_new_session=True)  # fmt: skip
            if p.returncode == 0 and p.stdout.strip():
                return dict(json.loads(p.stdout))
        except (subprocess.TimeoutExpired, ValueError):
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


STOPPED_WAIT = 10.0  # how long an interrupted launch waits for the stopped verdict before its own kill round


def verdict_or_stop(ssh_config: Path, chief: str, run_id: str,
                    wait: float = 0.0) -> tuple[dict[str, Any] | None, bool, dict[str, Any] | None]:  # fmt: skip
    """One ssh to the chief: the run's result.json when it has one (the run had ended), else the
    stop asked of its supervisor (:func:`request_stop`'s file), then, in the same session, its
    verdict once written (up to ``wait`` seconds). ``(result, False, None)`` when it had ended;
    ``(None, True, verdict)`` once asked (``verdict`` None: not within ``wait``); ``(None, False,
    None)`` when neither could be done (the chief unreachable). A session lost after the ask
    waits for the verdict in another (:func:`fetch_result`)."""
    script = (f"cd {sh_word(remote_dir(run_id))} || exit 1; "
              f"if [ -e {P.RESULT} ]; then echo ended; exec cat {P.RESULT}; fi; "
              f"{ASK_STOP} && echo asked && {{ {cat_when_there(P.RESULT, wait)}; }}")  # fmt: skip
    deadline = time.monotonic() + wait
    try:
        p = subprocess.run(ssh_argv(ssh_config, chief, script), capture_output=True, text=True, errors="replace",
                           timeout=20 + 2 * wait, check=False, start_new_session=True)  # fmt: skip
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = None, e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    head, _, body = out.partition("\n")
    if head not in ("ended", "asked"):
        return None, False, None
    try:
        doc = dict(json.loads(body)) if body.strip() else None
    except ValueError:
        doc = None
    if head == "ended":
        return (doc, False, None) if rc == 0 else (None, False, None)
    if doc is None and rc != 0:  # asked, then the session was lost: wait for the verdict in another
        doc = fetch_result(ssh_config, chief, run_id, wait=max(0.0, deadline - time.monotonic()))
    return None, True, doc


def confirmed_stopped(result: dict[str, Any] | None) -> dict[str, str]:
    """The hosts whose guard confirmed, in the supervisor's result, that it stopped the run there
    and nothing of it was left (the agent's own kill, the one kill.sh runs): host -> its state
    as ``agent.py status`` words it. Lost hosts, and hosts the stop did not reach, are not; nor
    is any host unless the result is the supervisor's own stop (outcome stopped, stop_confirmed:
    a verdict carried over between two attempts has not that)."""
    out: dict[str, str] = {}
    if not result or result.get("outcome") != "stopped" or result.get("stop_confirmed") is not True:
        return out
    for host, h in (result.get("hosts") or {}).items():
        if not isinstance(h, dict):
            continue
        ended = h.get("ended")
        if h.get("left") == 0 and isinstance(ended, str) and (ended == "killed" or ended.lstrip("-").isdigit()):
            out[host] = "killed" if ended == "killed" else f"exited {ended}"
    return out


def await_next(ssh_config: Path, chief: str, run_id: str, attempt: int,
               wait: float = P.RESULT_WAIT) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:  # fmt: skip
    """Once attempt ``attempt``'s jobs ended (automatic restarts): ``(result, None)`` when the
    supervisor wrote its verdict, ``(None, attempts)`` when it started a later attempt (the
    chief's attempts.json). It waits as long as the supervisor lives (a back-off, a preflight
    and a start take what they take), and ``wait`` seconds more once it is gone; ``(None,
    None)`` when neither came."""
    d = sh_word(remote_dir(run_id))
    script = (f"cd {d} || exit 3; dead=0; for _ in $(seq 0 300); do "
              f"if [ -e {P.RESULT} ]; then echo result; exec cat {P.RESULT}; fi; "
              f'if [ "$(cat {P.ATTEMPT} 2>/dev/null || echo 1)" -gt {int(attempt)} ]; then echo attempts; '
              f"exec cat {P.ATTEMPTS}; fi; "
              f'p=$(cat {P.SUPERVISOR_PID} 2>/dev/null); if grep -qs supervisor.py "/proc/$p/cmdline"; then dead=0; '
              f"else dead=$((dead + 1)); [ $dead -gt {int(wait * 5)} ] && exit 4; fi; "
              "sleep 0.2; done; exit 5")  # fmt: skip
    while True:
        try:
            p = subprocess.run(ssh_argv(ssh_config, chief, script), capture_output=True, text=True, timeout=120,
                               check=False, start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            continue
        head, _, body = p.stdout.partition("\n")
        try:
            if p.returncode == 0 and head == "result":
                return dict(json.loads(body)), None
            if p.returncode == 0 and head == "attempts":
                return None, dict(json.loads(body))
        except ValueError:
            pass
        if p.returncode != 5:  # 5: the supervisor is still at work; anything else: no more to wait for
            return None, None
        time.sleep(0.2)


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
    attempt: int = 0,
) -> JobResult:
    """Stream every host's log until all jobs end, then read the supervisor's verdict.

    This only reads: fail-fast is the chief's supervisor's decision, for attached and detached
    runs alike. On Ctrl-C or SIGTERM with ``stop_on_interrupt`` (``nodeops launch``), it asks
    the supervisor to stop the run and waits for every host to end; only when the chief cannot
    be reached (or nothing ends within 20 s) does it run kill on every host itself. Without it
    (``nodeops logs -f``) Ctrl-C only stops reading. ``addresses``: address -> host, to name the
    host in pdsh's lines (DeepSpeed's runner); ``rank_hosts``: mpirun's rank -> host.
    ``fold_after_failure`` (an attached launch): what the live stream keeps back while the run
    fails (``failures.LiveFold``: victims' tracebacks, torchrun's failure report, the hosts'
    lines during the teardown); it stays in the logs and the tails and is counted in
    ``folded``, so the failure report is not buried under it.
    ``attempt`` (automatic restarts: the attempt followed, from 1): once its jobs ended, the
    supervisor may start the next attempt instead of ending the run; the result then carries it
    (``next_attempts``) and this attempt's own verdict.
    """
    states = {h: HostState(h) for h in hosts}
    kill_hosts = list(kill_hosts) or list(hosts)
    remote_tails: dict[str, deque[str]] = {}  # pdsh: each node's own lines, by address
    rank_tails: dict[int, deque[str]] = {}  # mpirun: each rank's own lines, whole, exit marks included
    rank_joined = mpi_split.Lines()  # mpirun's pieces of them
    events: queue.Queue[tuple[str, str | None]] = queue.Queue()
    procs: dict[str, subprocess.Popen[str]] = {}
    script = sh_word(f"{remote_dir(run_id)}/follow.sh")

    def reader(host: str) -> None:
        # Its own session: a Ctrl-C in the terminal reaches nodeops, which decides; not the ssh.
        try:
            p = subprocess.Popen(ssh_argv(ssh_config, host, "bash", script), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, errors="replace",
                                 start_new_session=True)  # fmt: skip
        except OSError as e:  # this machine's own limit (open files, processes): the host is named, never waited on
            events.put((host, f"@@nodeops-lost cannot follow it from here: {limit_error(e) or e}"))
            events.put((host, None))
            return
        procs[host] = p
        assert p.stdout is not None and p.stderr is not None
        joined = mpi_split.RankLines()  # torchrun's tee can cut a rank's line in two
        for line in p.stdout:
            for whole in joined.feed(line.rstrip("\n")):
                events.put((host, whole))
        for whole in joined.flush():
            events.put((host, whole))
        rc = p.wait()
        err = p.stderr.read().strip().splitlines()
        if rc != 0:
            events.put((host, f"@@nodeops-lost ssh exited {rc}: {err[-1] if err else ''}"))
        events.put((host, None))

    for h in hosts:
        threading.Thread(target=reader, args=(h,), daemon=True).start()
    interrupted = False
    teardown_result: dict[str, str] = {}
    early: dict[str, Any] | None = None  # an interrupted launch's verdict, read before its kill round
    done: set[str] = set()
    fold = LiveFold()  # fold_after_failure: what the live stream keeps back while the run fails
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    def show(pairs: list[tuple[str, str]]) -> None:
        for host, line in pairs:
            emit(host, line)

    def pump(until: float | None = None) -> None:
        while len(done) < len(hosts) and (until is None or time.monotonic() < until):
            show(fold.due(time.monotonic()))
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
            elif line.startswith(ST.NOTE_MARK):  # the supervisor's notice (a stall): shown, never a host's tail
                emit(host, line)
            elif line.startswith(P.EXIT_MARK):
                value = line.removeprefix(P.EXIT_MARK).strip()
                st.exit_code = int(value) if value.lstrip("-").isdigit() else -1
                st.ended_at = time.monotonic()
                if st.exit_code == -1:
                    st.stopped = value == "killed"
                    st.lost_reason = "the job was stopped" if st.stopped else f"the job {value}"
                if st.exit_code != 0 and not st.stopped:
                    show(fold.job_failed(host))  # its held lines are its own failure's: shown after all
            else:
                st.tail.append(line)
                if fold_after_failure:
                    show(fold.line(host, line, time.monotonic()))
                else:
                    emit(host, line)
                prefixed = pdsh_split(line, addresses or {})
                if prefixed is not None:
                    remote_tails.setdefault(prefixed[0], deque(maxlen=TAIL_LINES)).append(prefixed[1])
                for rank, text in rank_joined.feed(line) if rank_hosts and mpi_split.TAG.search(line) else ():
                    if rank is not None:
                        rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        pump()
        show(fold.flush())
    except KeyboardInterrupt:
        interrupted = True
        if stop_on_interrupt:
            # The supervisor stops every host (its guards' connections are already open); then
            # kill on every host its verdict does not confirm clean (as `nodeops stop` does)
            # confirms that nothing is left, and does the job itself when the chief could not be
            # asked or nothing ended within 20 s.
            # A second Ctrl-C must not cut the teardown short: ignore SIGINT/SIGTERM meanwhile.
            with ignoring_interrupts():
                asked = request_stop(ssh_config, chief, run_id)
                pump(until=time.monotonic() + (20 if asked else 0))
                early = fetch_result(ssh_config, chief, run_id, wait=STOPPED_WAIT) if asked else None
                confirmed = confirmed_stopped(early)
                rest = [h for h in kill_hosts if h not in confirmed]
                teardown_result = {h: "" for h in confirmed} | (teardown(ssh_config, rest, run_id) if rest else {})
        for p in procs.values():
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    nxt: dict[str, Any] | None = None
    if interrupted and not stop_on_interrupt:
        result = None
    elif attempt and not interrupted:
        result, nxt = await_next(ssh_config, chief, run_id, attempt)
        if nxt is not None:  # this attempt's own verdict, as the supervisor kept it
            mine = [a for a in nxt.get("attempts") or [] if a.get("attempt") == attempt]
            result = dict((mine[0].get("result") or {}) if mine else {})
    else:
        result = early if early is not None else fetch_result(ssh_config, chief, run_id)
    root: HostState | None = None
    stopped = (result or {}).get("outcome") == "stopped"
    hang = (result or {}).get("hang") if (result or {}).get("outcome") == "hung" else None
    if not interrupted and not stopped and hang is None:
        first = (result or {}).get("first_failure")
        named = first["host"] if first else ""
        root = None
        if rank_hosts:  # mpirun: its report and the ranks' exit marks name the rank
            mpirun_state = root_cause(list(states.values()), named=named)
            root = blame_mpi_rank(mpirun_state, rank_tails, rank_hosts) if mpirun_state is not None else None
            root = None if root is mpirun_state else root  # it named no rank
        if root is None:  # a peer that gloo says went away may be the cause (pdsh)
            blame_peers(states, remote_tails, addresses or {})
            root = root_cause(list(states.values()), named=named)
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
        folded=fold.folded(root.host if root is not None else ""),
        hang=hang,
        next_attempts=nxt,
    )
