"""The launch protocol: run-dir layout, file names, markers and timings, shared by the
controller (``nodeops.backends.ssh.run``, ``nodeops.backends.starter``), the per-host agent and the chief's
supervisor. Stdlib only: shipped beside ``agent.py`` and ``supervisor.py`` in every run dir.

A run dir is ``~/.nodeops/runs/<run id>/`` on every host of the run.
"""

from __future__ import annotations

import re

RUNS_DIR = ".nodeops/runs"  # relative to the login user's home
TAG_VAR = "NODEOPS_RUN_ID"  # every process of a job carries NODEOPS_RUN_ID=<run id>; never the agent's own

# Files in the run dir.
JOB = "job.sh"  # what this host runs (absent where mpirun/deepspeed start the ranks from the chief)
LOG = "host.log"  # the job's stdout+stderr
PGID = "pgid"  # the job's process group (its leader is bash job.sh)
EXIT = "exit_code"  # the job's exit code, written by the agent when the job ends
KILLED = "killed"  # written when the job was stopped while running (by stop, fail-fast or lost supervision)
LOST = "lost"  # why the agent stopped the job on its own (the dead man's switch)
# A line a rank printed, in a host's log: torchrun's `[rankN]:` prefix (after its \x1e mark),
# mpirun's --tag-output `[job,rank]<stdout>:`, anywhere on the line (pdsh puts its address first).
RANK_OUTPUT = re.compile(r"\[rank\d+\]:|\[\d+,\d+\]<std(?:out|err)>:")
# A training step a rank printed ("step 5", "step=5", "Step: 5/100"): the last one on a host goes
# into a failure's signature (recovery.signature).
STEP = re.compile(r"\bstep\b\W{0,3}(\d+)", re.I)
HEARTBEAT = "heartbeat"  # touched by the guard at every heartbeat from the supervisor
PROGRESS = "progress"  # the script may touch it ($NODEOPS_PROGRESS_FILE): progress for the hang watchdog
HANG = "hang.json"  # the hang watchdog's report and every rank's stack (chief only)
STALLS = "stalls.json"  # every stall the stall watch reported or judged a quiet phase (chief only)
RUN_CONFIG = "run.json"  # the supervisor's input (chief only)
RESULT = "result.json"  # the supervisor's verdict (chief only); its presence means the run is over
STOP_REQUEST = "stop_request"  # the controller asks the supervisor to stop the run (chief only)
# `nodeops stacks` asks the supervisor (chief only): STACKS_ASK + ID holds {"native", "method"};
# the supervisor takes it (unlinks it: whoever unlinks it owns it), has every guard take its
# host's stacks, and writes STACKS_ANSWER + ID + ".json": {"hosts": {host: that host's
# `agent.py stacks` output}} with the hosts whose guard answered.
STACKS_ASK = "stacks-ask."
STACKS_ANSWER = "stacks-answer."
STACKS_ID = re.compile(r"[0-9a-f]{8,32}\Z")
STACKS_ASK_WAIT = 30.0  # how long the supervisor waits for every guard's answer to one ask
SUPERVISOR_LOG = "supervisor.log"
AGENT_LOG = "agent.log"
AGENT_PID = "agent.pid"  # the host agent's pid, while it runs
SUPERVISOR_PID = "supervisor.pid"  # written by the supervisor once it runs
# Automatic restarts (launch.restarts): see recovery.py.
SPARE_JOB = "spare-job.sh"  # a spare's job.sh until an attempt gives it a node rank (then renamed job.sh)
ATTEMPT_ENV = "attempt.env"  # this attempt's node count, node rank, world size and restart count (job.sh reads it)
ATTEMPTS = "attempts.json"  # the chief's record of every attempt so far (the supervisor's, while it runs)
ATTEMPT = "attempt"  # the number of the attempt whose jobs the supervisor last started (after the first)
ATTEMPTS_DIR = "attempts"  # attempts/K/: what attempt K left on a host (host.log, exit_code, ...) once K+1 began

# Markers on stdout of the scripts the controller runs over ssh.
STARTED = "@@nodeops-started"
EXIT_MARK = "@@nodeops-exit "  # follow.sh: "@@nodeops-exit CODE" / "killed" / "never-started"
STOPPED = "@@nodeops-stopped"  # kill: nothing of the run is left on this host
LEFT = "@@nodeops-left "  # kill: "@@nodeops-left N" processes survived SIGKILL
STATE = "@@nodeops-state "  # kill: the host's state after it (agent.py status), for `nodeops stop`'s table

# Timings (seconds).
# supervisor -> every guard. Each heartbeat wakes the chief's link to the host, the host's sshd and
# its guard: every 3 s rather than every second cut those wakes, which at 64 sandbox nodes took the
# nodes' CPU from the ranks for the whole run (docs/design.md); 5 go by within HEARTBEAT_STALE.
HEARTBEAT_EVERY = 3.0
# A guard (or agent) that hears nothing this long stops the job: the dead man's switch for a chief
# that died or vanished (its ranks' peers fail in their collectives anyway; the switch cleans up).
# It was 5 s; 15 s leaves a CPU-starved chief margin, and time the host itself did not run (LATE)
# is not counted (:func:`late`).
HEARTBEAT_STALE = 15.0
LATE = 1.0  # a sleep that overran by this much: the host (or this process) was not running meanwhile
# A job that no supervisor armed within this is stopped (its agent), and an unarmed guard stops after
# this much silence. The supervisor arms once every guard is watching: at 64 sandbox nodes (a starved
# chief) that came up to ~107 s after the agents started, so 150 s was a thin margin.
ATTACH_DEADLINE = 300.0
GRACE = 2.0  # SIGTERM, then this long, then SIGKILL
RESULT_WAIT = 20.0  # how long the controller waits for result.json after the last host ended

# ssh options every launch connection uses, from the controller and from the chief: fail in 10 s
# when a host does not answer, and notice a dead connection within ~6 s.
SSH_TIMEOUTS = ["ConnectTimeout=10", "ServerAliveInterval=2", "ServerAliveCountMax=3"]

# torchrun's agent, the moment it sees a worker fail (before its own shutdown and exit): final
# when there are no restarts.
AGENT_FAILED = re.compile(r"failed \(exitcode: ([1-9]\d*|-\d+)\) local_rank: \d+(?: \(pid: (\d+)\))?")
# What a rank prints when it fails because another rank died first (gloo, NCCL, the TCPStore):
# such a failure is a consequence, never the root cause when a rank that failed on its own is
# reported within ROOT_CAUSE_WINDOW of it.
PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|remote worker crash|remote process exited|communicator was aborted"
    r"|[Ww]atchdog caught collective operation timeout|DistNetworkError|Failed to recv"
)
# Lines of each host's (or, under mpirun, each rank's) output kept to judge a failure: torchrun's
# failure summary and shutdown alone is ~40 lines; keep the rank's last words too
TAIL_LINES = 200
ROOT_CAUSE_WINDOW = 5.0  # seconds after the first failure in which a likelier root cause replaces it
# When the first report is a victim's (its ranks lost a peer), the teardown waits this long for the
# host whose own rank failed to report: stopped first, that host would lose its own exit code.
PEER_GRACE = 2.0
# How likely a failure report is the root cause, most likely first.
CAUSE_OWN = 0  # a worker exited with a code of its own, its lines naming no lost peer
CAUSE_LOST = 1  # a host lost, its agent dead, its job stopped outside the supervisor
CAUSE_EXIT = 2  # a job's non-zero exit, a worker's signal death: no more known
CAUSE_PEER = 3  # a worker whose lines say a peer went away first


def replaces_first(first_rank: int, first_age: float, rank: int, after_stop: bool) -> bool:
    """Whether a later failure report becomes the run's first failure instead: only a likelier
    cause, within ROOT_CAUSE_WINDOW of the first, and never one that came after that host was
    told to stop (a worker may exit 1 from its own SIGTERM handler)."""
    return not after_stop and rank < first_rank and first_age < ROOT_CAUSE_WINDOW


# pdsh (DeepSpeed's runner) reports a node whose command failed, and keeps waiting.
PDSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")


def log_lines(text: str) -> list[str]:
    """A log's lines, cut at newlines only (a ``\\r`` before one dropped): ``str.splitlines()``
    also cuts at ``\\x1e``, the mark before torchrun's rank prefix (RANK_PREFIX), and at other
    characters a rank may print (``\\x1c``-``\\x1d``, ``\\x85``, ``\\u2028``), which gave every
    rank line an empty line before it."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def run_dir(run_id: str) -> str:
    return f"{RUNS_DIR}/{run_id}"


def late(asked: float, began: float, now: float) -> float:
    """How long a wait of ``asked`` seconds begun at ``began`` (monotonic) overran, when by more
    than LATE: this process was not running (a starved or frozen host), so that time is no
    evidence of anyone's silence. 0 otherwise."""
    over = now - began - asked
    return over if over > LATE else 0.0
