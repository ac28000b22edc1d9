"""The Slurm batch script's driver: what a job does on its batch node once the batch shell has set
the run up (run dir, workdir, env file, Python env). Stdlib only (Python 3.8+), one file: the
batch script carries it and writes it into the run dir, beside its settings (``config.json``,
from ``nodeops.backends.slurm.job.batch_config``), and ``exec``s it, so the driver is the batch
shell's own process and gets Slurm's signals. Every node's srun task runs the same file:

    python3 -I slurm_batch.py batch CONFIG SCRIPT [ARGS...]
        the job: the preflight step and its gate, the fabric step and its gate, the GPU count
        (runners mpirun and deepspeed), the training step (srun, or mpirun), the time-limit
        signal's forwarding, the hang watchdog, the nodes' heartbeats (a lost node ends the
        step in seconds; the step's timeline), launch.restarts' attempts (slurm_failures.py's
        rules), result.json and attempts.jsonl, and the requeue
    python3 -I slurm_batch.py task CONFIG LAUNCHER RDZV_ID MAX_RESTARTS SCRIPT [ARGS...]
        one node's task of an srun step: torchrun (or DeepSpeed's per-node launcher), waited
        for to its own end whatever signal comes, the signal passed on where Slurm signals only
        the task's own process (NODEOPS_FORWARD_SIGNALS), and its heartbeats to the batch node
        (NODEOPS_HEARTBEAT)

What the controller reads is said here as the bash script said it: the ``nodeops: ...`` lines of
the batch log, result.json and attempts.jsonl (one JSON object a line), the exit codes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# the signals torchrun handles unless told (and the task's bash trapped): each passed on as itself
TASK_SIGNALS = ("TERM", "INT", "HUP", "QUIT")
COUNT_TASK = 'echo "$SLURMD_NODENAME ${SLURM_GPUS_ON_NODE:-0} ${CUDA_VISIBLE_DEVICES:-}"'
# runner deepspeed, on each node: the .deepspeed_env lines evaluated as pdsh's remote shell does
# ($VAR expands there), the ranks' stack hook kept first on PYTHONPATH, then the launcher
DS_SHELL = (
    "_no_hook=$1; shift\n"
    'eval "$NODEOPS_DS_EXPORTS" || { echo "nodeops: the .deepspeed_env lines failed on $SLURMD_NODENAME" >&2; '
    "exit 97; }\n"
    'if [ -r "$_no_hook/sitecustomize.py" ]; then\n'
    '  case ":${PYTHONPATH:-}:" in *":$_no_hook:"*) ;; *) export PYTHONPATH="$_no_hook${PYTHONPATH:+:$PYTHONPATH}" '
    ";; esac\nfi\n"
    'exec "$@"'
)


# Each node's task sends the batch node a heartbeat (one UDP datagram) every BEAT_EVERY seconds,
# and its end. A node heard before whose task goes silent without its end is lost: its machine
# or its network is gone (srun would wait its --wait for that task, then 12 s more).
BEAT_EVERY = 1.0
LOST_AFTER = 5.0  # silent this long: lost
# silent this long once another node's task failed: srun is then stopping every task, and a live
# node's task either says its end or is killed by Slurm, which srun hears at once (its step ends)
LOST_QUICK = 3.0
LOST_GRACE = 5.0  # after the SIGTERM that ends a lost node's step: the others' tasks end, then SIGKILL to srun
BEAT_MAX = 4096  # bytes: a heartbeat is far smaller
# a line a rank printed, and torchrun's report of a failed rank (protocol.RANK_OUTPUT and
# protocol.AGENT_FAILED: this file imports no nodeops module)
RANK_OUTPUT = re.compile(r"\[rank\d+\]:|\[\d+,\d+\]<std(?:out|err)>:")
AGENT_FAILED = re.compile(r"failed \(exitcode: ([1-9]\d*|-\d+)\) local_rank: \d+(?: \(pid: (\d+)\))?")


def say(text: str, err: bool = False) -> None:
    """One line of the batch log, written at once (the steps' own output goes to the same file),
    unbuffered: a signal handler says its line while the main flow may be saying one."""
    data = (text + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(2 if err else 1, data) :]


def shell_rc(code: int) -> int:
    """A child's exit as bash's ``$?`` says it: 128+N for one a signal ended."""
    return 128 - code if code < 0 else code


def background() -> None:
    """What bash gives a command started with ``&`` (no job control): SIGINT and SIGQUIT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def start(argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
    """A command started as bash's ``&`` starts it: stdin /dev/null, SIGINT and SIGQUIT ignored."""
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(list(argv), preexec_fn=background, **kw)


def output(argv: Sequence[str], **kw: Any) -> tuple[int, str]:
    """``$(...)``: the exit and the output without its trailing newlines ('' when it cannot run)."""
    try:
        p = subprocess.run(list(argv), stdout=subprocess.PIPE, **kw)
    except OSError as e:
        say(f"nodeops: {argv[0]}: {e}", err=True)
        return 127, ""
    return shell_rc(p.returncode), p.stdout.decode("utf-8", "replace").rstrip("\n")


def status(argv: Sequence[str], **kw: Any) -> int:
    """A command run in the foreground: its exit, as ``$?`` says it."""
    try:
        return shell_rc(subprocess.run(list(argv), **kw).returncode)
    except OSError as e:
        say(f"nodeops: {argv[0]}: {e}", err=True)
        return 127


def readable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.R_OK)


# --------------------------------------------------------------------------- pure parts
def result_text(result: dict[str, Any] | None) -> str:
    """result.json's line: the keys in the order written, as printf wrote them."""
    return "null" if result is None else json.dumps(result)


def attempt_line(attempt: int, nodes: str, result: dict[str, Any] | None) -> str:
    """One line of attempts.jsonl: this run of the job (``None``: it has begun) and how it ended."""
    return json.dumps({"attempt": attempt, "nodes": nodes, "result": result})


def ended(exit: int, restart: int, signal_name: str, *, requeued: bool = False, hung: bool = False,
          ) -> dict[str, Any]:  # fmt: skip
    """The result of a run that reached (or was refused) its training step."""
    return {"exit": exit, "restart": restart, "signal": signal_name, "requeued": requeued, "hang": hung}


def forward_signals(slurm_config: str) -> bool:
    """Whether each node's task passes a signal on to torchrun: Slurm signals (all but SIGKILL)
    every process of a step, torchrun included, except under proctrack/cgroup, where only each
    task's own process gets it (twice would end torchrun's shutdown early: it stops at a second
    signal). ``slurm_config``: ``scontrol show config``."""
    cgroup = re.search(r"^ProctrackType += +proctrack/cgroup", slurm_config, re.M)
    children = re.search(r"^SignalChildrenProcesses += +(yes|1)", slurm_config, re.M | re.I)
    return bool(cgroup) and not children


def node_addr(show_node: str) -> str:
    """The NodeAddr in ``scontrol show node NAME`` ('' when none)."""
    return "\n".join(m.group(1) for m in re.finditer(r"^.*NodeAddr=([^ \n]*)", show_node, re.M))


def gpu_counts(text: str) -> dict[str, tuple[int, str]]:
    """The counting step's lines (``NODE GPUS [IDS]``): node -> (GPUs Slurm gave it, its ids)."""
    out: dict[str, tuple[int, str]] = {}
    for line in text.split("\n"):
        words = line.split(None, 2)
        if words:
            gpus = words[1] if len(words) > 1 else ""
            out[words[0]] = (int(gpus) if gpus.isdigit() else 0, words[2].strip() if len(words) > 2 else "")
    return out


class RankPlan:
    """Runners mpirun and deepspeed: one rank per GPU Slurm gave each node (``nproc`` where it
    gave none), nodes in the allocation's order."""

    def __init__(self, slots: list[int], rank_nodes: list[str], world: list[str], other_gpus: int) -> None:
        self.slots, self.rank_nodes, self.world, self.other_gpus = slots, rank_nodes, world, other_gpus

    @property
    def ranks(self) -> int:
        return sum(self.slots)

    @property
    def per_node(self) -> str:
        return ",".join(str(k) for k in self.slots)


def plan_ranks(nodes: Sequence[str], counts: dict[str, tuple[int, str]], nproc: int, batch_node: str,
               count_rc: int) -> tuple[RankPlan | None, str]:  # fmt: skip
    """The ranks on each node, or why none can start."""
    slots: list[int] = []
    rank_nodes: list[str] = []
    world: list[str] = []
    other = 0
    for n in nodes:
        if n not in counts:
            return None, f"{n} did not answer the srun step that counts each node's GPUs (it exited {count_rc})"
        gpus, ids = counts[n]
        k = gpus if gpus > 0 else nproc
        slots.append(k)
        world.append(f"{n}={k}={ids}")
        rank_nodes += [n] * k
        if n != batch_node:
            other += gpus
    plan = RankPlan(slots, rank_nodes, world, other)
    if plan.ranks <= 0:
        return None, "no node in the allocation (scontrol show hostnames gave none)"
    return plan, ""


def plm_args(slurm_gpus: str, other_gpus: int) -> list[str]:
    """mpirun's daemons' srun step would ask for the job's GPU total (--gpus) on fewer nodes, which
    Slurm refuses: it asks for the other nodes' own GPUs instead."""
    if not slurm_gpus:
        return []
    return ["--mca", "plm_slurm_args", f"--gpus={other_gpus}" if other_gpus > 0 else "--gres=none"]


def mpirun_argv(plan: RankPlan, plm: Sequence[str], shim: str, args: Sequence[str]) -> list[str]:
    return ["mpirun", "-np", str(plan.ranks), *plm, "--bind-to", "none", "--map-by", "slot", "--tag-output",
            "sh", shim, "python3", *args]  # fmt: skip


def step_argv(cfg: dict[str, Any], task: Sequence[str], launcher: str, rdzv: str, max_restarts: int,
              args: Sequence[str], *, nodes: Sequence[str] = (), overlap: bool = False, wait: int | None = None,
              log_dir: str) -> list[str]:  # fmt: skip
    """A training (or fabric) step: one srun task per node running ``task`` (this file's task
    mode); ``nodes``: launch.restarts' attempt's own nodes."""
    out = ["srun"] + (["--overlap"] if overlap else [])
    if nodes:
        out += [f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", f"--nodelist={','.join(nodes)}"]
    out += ["--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--wait={cfg['step_wait'] if wait is None else wait}",
            "--open-mode=append", f"--output={log_dir}/%N.log"]  # fmt: skip
    return [*out, *task, launcher, rdzv, str(max_restarts), *args]


def torchrun_argv(cfg: dict[str, Any], env: dict[str, str], rdzv: str, max_restarts: str,
                  args: Sequence[str]) -> list[str]:  # fmt: skip
    """One node's torchrun: the step's node count, one rank per GPU Slurm gave the node."""
    nnodes = env.get("SLURM_STEP_NUM_NODES" if cfg["restarts"] else "SLURM_JOB_NUM_NODES", "")
    nproc = env.get("SLURM_GPUS_ON_NODE") or str(cfg["nproc"])
    master = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return ["python", "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={master}", f"--rdzv-id={rdzv}",
            f"--max-restarts={max_restarts}", *cfg["torchrun_extra"], *args]  # fmt: skip


def deepspeed_argv(python: str, env: dict[str, str], node_rank: int, args: Sequence[str]) -> list[str]:
    """One node's DeepSpeed launcher (what its pdsh runner runs on each node)."""
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={env.get('NODEOPS_DS_WORLD', '')}",
            f"--node_rank={node_rank}", f"--master_addr={env.get('MASTER_ADDR', '')}",
            f"--master_port={env.get('MASTER_PORT', '')}", *args]  # fmt: skip


def task_signals(launcher: str, time_limit: str | None) -> dict[str, tuple[str, bool]]:
    """What a node's task does with each signal it gets: the name it passes on (where it passes
    signals on) and whether it is the time limit's (then torchrun's exit 1 means it ended its
    ranks on it). DeepSpeed's launcher ends its ranks on TERM and INT only: HUP and QUIT reach it
    as TERM."""
    out = {s: (s, False) for s in TASK_SIGNALS}
    if launcher == "deepspeed":
        out.update(HUP=("TERM", False), QUIT=("TERM", False))
    if time_limit:
        out[time_limit] = (time_limit, True)
    return out


def next_attempt(answer: str) -> float | None:
    """``recover decide``'s answer: the back-off before the next attempt ('go NODES SECONDS'), or
    None ('stop', or nothing)."""
    words = answer.split("\n", 1)[0].split(None, 2)
    if len(words) < 2 or words[0] != "go":
        return None
    try:
        return max(0.0, float(words[2])) if len(words) > 2 else 0.0
    except ValueError:
        return 0.0


def beat_target(value: str) -> tuple[str, int, str] | None:
    """``NODEOPS_HEARTBEAT`` ('ADDRESS PORT TOKEN'): where a node's task sends its heartbeats."""
    words = value.split()
    if len(words) != 3 or not words[1].isdigit():
        return None
    return words[0], int(words[1]), words[2]


class Beats:
    """What the batch node heard from each node's task during one training step, fed the
    datagrams and the clock: the step's timeline (its ranks up, its last progress, its first
    failure, in epoch seconds) and the nodes that went silent."""

    def __init__(self, token: str, nodes: Sequence[str]) -> None:
        self.token, self.nodes = token, list(nodes)
        self.heard: dict[str, float] = {}  # node -> when its last heartbeat came (monotonic)
        self.heard_at: dict[str, float] = {}  # the same, in epoch seconds
        self.said: dict[str, tuple[int, float]] = {}  # node -> its log's growth and progress time, last said
        self.up: set[str] = set()
        self.failed: set[str] = set()  # nodes where torchrun reported a failed rank, or whose task failed
        self.ended: dict[str, int] = {}  # node -> its task's exit
        self.times: dict[str, float] = {}

    def take(self, data: bytes, mono: float, wall: float) -> None:
        try:
            msg = json.loads(data.decode("utf-8", "replace"))
            node, grown, progress = str(msg["node"]), int(msg["grown"]), float(msg["progress"])
            end = msg.get("end")
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        if msg.get("token") != self.token or node not in self.nodes:
            return
        self.heard[node], self.heard_at[node] = mono, wall
        if self.said.get(node, (0, 0.0)) != (grown, progress):
            self.times["last_progress"] = wall
        self.said[node] = (grown, progress)
        if msg.get("up") and node not in self.up:
            self.up.add(node)
            if self.up >= set(self.nodes):
                self.times.setdefault("ranks_up", wall)
        if msg.get("failed") is True and node not in self.failed:
            self.failed.add(node)
            self.times.setdefault("failed", wall)
        if isinstance(end, int) and not isinstance(end, bool) and node not in self.ended:
            self.ended[node] = end
            if end != 0:
                self.failed.add(node)
                self.times.setdefault("failed", wall)
                self.times.setdefault("stop_sent", wall)  # srun's --kill-on-bad-exit stops the others now

    def lost(self, mono: float) -> list[tuple[str, float]]:
        """The nodes heard before whose task went silent without its end, each with how long
        it has been silent, the longest first: LOST_AFTER, or LOST_QUICK once a rank failed on
        another node (a lost node's peers fail soon: their connections to it break)."""
        limit = LOST_QUICK if self.failed else LOST_AFTER
        silent = [(n, mono - t) for n, t in self.heard.items() if n not in self.ended and mono - t >= limit]
        return sorted(silent, key=lambda x: -x[1])

    def settled(self, mono: float, lost: str) -> bool:
        """Every other node's task heard from has ended (or has gone silent: Slurm killed it)."""
        return all(n in self.ended or mono - t >= BEAT_EVERY + 0.5 for n, t in self.heard.items() if n != lost)


def step_times(began: float, heard: dict[str, float], ended_at: float) -> dict[str, float]:
    """A training step's timeline, in the ssh supervisor's form (epoch seconds): when it began,
    what the heartbeats said (every node's ranks up, the last progress, the first failure, the
    stop: a task's failed exit, on which srun's --kill-on-bad-exit stops every other task, or
    the SIGTERM for a lost node), when srun ended."""
    return {k: round(v, 3) for k, v in {"began": began, **heard, "ended": ended_at}.items()}


def step_marks(run_dir: str, d: str, since: float) -> set[str]:
    """The marks in ``d`` of the run dir (HOST-PID.txt) written since ``since`` (by mtime, 1 s
    early counted), in one listing."""
    try:
        names = os.listdir(os.path.join(run_dir, d))
    except OSError:
        return set()
    out = set()
    for n in names:
        with contextlib.suppress(OSError):  # gone meanwhile, or a stale handle: not counted
            if os.path.getmtime(os.path.join(run_dir, d, n)) >= since - 1:
                out.add(n)
    return out


def finished_ranks(run_dir: str, files: dict[str, str], nodes: Sequence[str], since: float,
                   ended_since: float | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Each node's ranks in a step (begun at ``since``) that ended their script (the ranks' hook's
    finished/NODE-PID.txt; with ``ended_since``, only those that ended from then on) and that
    started (its stacks/NODE-PID.txt), [ended, started]: the shared run dir holds every node's.
    The restart rules and the run's exit code tell "finished, then crashed in teardown" by them
    (agent.finished_ranks counts the same over ssh)."""
    started = step_marks(run_dir, files["stacks_dir"], since)
    # a rank counts as ended only where it counts as started
    ended = step_marks(run_dir, files["finished_dir"], since if ended_since is None else ended_since) & started
    return {n: [sum(1 for m in ended if mark_host(m) == n), sum(1 for m in started if mark_host(m) == n)]
            for n in nodes}  # fmt: skip


def mark_host(name: str) -> str:
    """The node of a mark's file name (HOST-PID.txt; stacks.mark_host, which this file cannot
    import), '' for another name: node "gpu" never counts gpu-1's marks."""
    host, sep, pid = name[:-4].rpartition("-") if name.endswith(".txt") else ("", "", "")
    return host if sep and pid.isascii() and pid.isdigit() else ""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (a zombie does not: its parent, or a container's init
    that reaps nothing, has yet to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        return False


def hang_times(path: str) -> dict[str, float]:
    """When the hang watchdog fired and sent its stop (hang.json's ``fired``, ``stop_sent``)."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return {}
    pairs = (("failed", got.get("fired")), ("stop_sent", got.get("stop_sent"))) if isinstance(got, dict) else ()
    return {k: round(float(v), 3) for k, v in pairs if isinstance(v, (int, float)) and not isinstance(v, bool)}


# --------------------------------------------------------------------------- a node's task
class NodeLog:
    """This node's log as its task sees it (slurmstepd writes it from this node, so no shared
    filesystem's cache stands between): how much it grew since the task began, and whether a
    rank's line came meanwhile."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.began = self.offset = self.size()
        self.up = self.failed = False

    def size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def look(self) -> int:
        size = self.size()
        if size > self.offset and not (self.up and self.failed):
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(min(size - self.offset, 1 << 20))
            except OSError:
                return size - self.began
            whole = data.rfind(b"\n") + 1 or (len(data) if len(data) == 1 << 20 else 0)  # whole lines only
            text = data[:whole].decode("utf-8", "replace")
            self.up = self.up or bool(RANK_OUTPUT.search(text))
            self.failed = self.failed or bool(AGENT_FAILED.search(text))
            self.offset += whole
        return size - self.began


class Heart:
    """A node's task's heartbeats to the batch node (``NODEOPS_HEARTBEAT``), from a thread, and
    its end (said three times: a datagram can be lost). Nothing is sent where the batch node
    cannot be reached: the step then ends as srun ends it."""

    def __init__(self, value: str, node: str, run_dir: str) -> None:
        self.target = beat_target(value)
        self.node, self.seq = node, 0
        self.log = NodeLog(os.path.join(run_dir, "logs", f"{node}.log"))
        self.progress = os.path.join(run_dir, "progress")
        self.done = threading.Event()
        self.sock: socket.socket | None = None
        self.where: Any = None
        if self.target is not None:
            with contextlib.suppress(OSError, IndexError):
                family, kind, proto, _, self.where = socket.getaddrinfo(self.target[0], self.target[1], 0,
                                                                        socket.SOCK_DGRAM)[0]  # fmt: skip
                self.sock = socket.socket(family, kind, proto)

    def start(self) -> None:
        if self.sock is not None:
            threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        self.send(None)  # at once: a node lost in its first second is known to the batch node
        while not self.done.wait(BEAT_EVERY):
            self.send(None)

    def send(self, end: int | None) -> None:
        if self.sock is None or self.target is None:
            return
        try:
            progress = os.stat(self.progress).st_mtime
        except OSError:
            progress = 0.0
        self.seq += 1
        # the node and its count, how much its log grew since the task began, whether a rank's
        # line is in it and whether torchrun reported a failed rank there, the progress file's
        # time as this node sees it, and the task's exit (None while it runs)
        beat = {"token": self.target[2], "node": self.node, "seq": self.seq, "grown": self.log.look(),
                "up": self.log.up, "failed": self.log.failed, "progress": progress, "end": end}  # fmt: skip
        with contextlib.suppress(OSError):
            self.sock.sendto(json.dumps(beat).encode(), self.where)

    def end(self, rc: int) -> None:
        self.done.set()
        for _ in range(3):
            self.send(rc)


def ended_on_signal(rc: int, run_dir: str, files: dict[str, str], node: str, since: float, signalled: float,
                    wait: float) -> bool:  # fmt: skip
    """Whether torchrun's exit ``rc`` after the time-limit signal (at ``signalled``) says it
    ended its ranks on it: 1 (its SignalException), or any other failure once every rank it
    started on this node (since ``since``) has ended its script after the signal. The rendezvous
    host's torchrun can end as soon as its own ranks are done and take the TCPStore with it; a
    torchrun still waiting for a rank that checkpoints longer then dies in its own teardown
    (SIGABRT, 134: seen in a CI run), before or after that rank ends. So the ranks still running
    (their pids are in their started marks' names) are waited for, up to ``wait`` seconds."""
    if rc == 1:
        return True
    pids = [int(m[len(node) + 1:-4]) for m in step_marks(run_dir, files["stacks_dir"], since)
            if mark_host(m) == node]  # fmt: skip
    deadline = time.monotonic() + wait
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    done, up = finished_ranks(run_dir, files, [node], since, ended_since=signalled)[node]
    return up > 0 and done >= up


def task_main(cfg: dict[str, Any], argv: Sequence[str]) -> int:
    """LAUNCHER RDZV_ID MAX_RESTARTS SCRIPT ARGS...: one node's torchrun (or DeepSpeed's launcher),
    waited for to its own end whatever signal comes."""
    launcher, rdzv, restarts, *args = argv
    env = dict(os.environ)
    node = env.get("SLURMD_NODENAME", "")
    run_dir = env.get("NODEOPS_RUN_DIR", "")
    env["PET_LOG_DIR"] = f"{run_dir}/ranks/{node}"
    time_limit = cfg.get("signal")
    forward = bool(env.get("NODEOPS_FORWARD_SIGNALS"))
    state: dict[str, Any] = {"proc": None, "got": False, "at": 0.0}

    def handler(to: str, marks: bool) -> Callable[[int, Any], None]:
        def on(_sig: int, _frame: Any) -> None:
            if marks and not state["got"]:
                state["at"] = time.time()
            state["got"] = state["got"] or marks
            proc = state["proc"]
            if forward and proc is not None and proc.returncode is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(getattr(signal, "SIG" + to))

        return on

    for name, (to, marks) in task_signals(launcher, time_limit).items():
        signal.signal(getattr(signal, "SIG" + name), handler(to, marks))
    if launcher == "deepspeed":
        nodes = env.get("NODEOPS_DS_NODES", "").split()
        if node not in nodes:
            say(f"nodeops: {node} is not in the node list DeepSpeed was given", err=True)
            return 97
        rank = len(nodes) - 1 - nodes[::-1].index(node)
        hook = f"{run_dir}/hook"
        launch = deepspeed_argv(shutil.which("python") or "python", env, rank, args)
        cmd = ["bash", "-c", DS_SHELL, "nodeops-deepspeed", hook, *launch]
    else:
        cmd = torchrun_argv(cfg, env, rdzv, restarts, args)
    heart = Heart(env.get("NODEOPS_HEARTBEAT", ""), node, run_dir)
    heart.start()
    began = time.time()
    try:
        state["proc"] = proc = start(cmd, env=env)
    except OSError as e:
        say(f"nodeops: {cmd[0]}: {e}", err=True)
        heart.end(127)
        return 127
    rc = shell_rc(proc.wait())  # a handled signal does not end the wait: torchrun's own end does
    if state["got"] and rc != 0 and ended_on_signal(rc, run_dir, cfg["files"], node, began, state["at"],
                                                    float(cfg["step_wait"])):  # fmt: skip
        who = "DeepSpeed's launcher" if launcher == "deepspeed" else "torchrun"
        if rc == 1:
            say(f"nodeops: {who} on {node} ended its ranks after SIG{time_limit}")
        else:
            say(f"nodeops: {who} on {node} ended its ranks after SIG{time_limit}, then exited {rc} in its own "
                "teardown (every rank here had ended its script; the rendezvous host's torchrun may have ended "
                "first)")  # fmt: skip
        os.makedirs(f"{run_dir}/signalled", exist_ok=True)
        open(f"{run_dir}/signalled/{node}", "w").close()
        rc = 0
    heart.end(rc)
    return rc


# --------------------------------------------------------------------------- the batch node
def running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` runs: not reaped, and not a zombie (ended, its parent yet to reap it)."""
    if proc.returncode is not None:
        return False
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Listener:
    """The batch node's side of the heartbeats of one training step: a UDP socket (any free
    port), and a thread that reads it into :class:`Beats` and, when a node is lost, ends the
    step: SIGTERM to srun (srun then has Slurm kill every task), and once the other nodes' tasks
    have ended, SIGKILL (srun would go on waiting for the lost node's task)."""

    def __init__(self, address: str, nodes: Sequence[str]) -> None:
        self.beats = Beats(secrets.token_hex(8), nodes)
        self.address = address
        self.lost: dict[str, Any] | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        family = socket.getaddrinfo(address, 0, 0, socket.SOCK_DGRAM)[0][0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind(("", 0))
        self.sock.setblocking(False)

    @property
    def env(self) -> str:
        """``NODEOPS_HEARTBEAT`` for the step's tasks."""
        return f"{self.address} {self.sock.getsockname()[1]} {self.beats.token}"

    def start(self, step: subprocess.Popen[bytes]) -> None:
        self.thread = threading.Thread(target=self.run, args=(step,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(LOST_GRACE + 5)
        self.sock.close()

    def drain(self, wait: float) -> None:
        if select.select([self.sock], [], [], wait)[0]:
            while True:
                try:
                    data = self.sock.recv(BEAT_MAX)
                except OSError:  # (BlockingIOError: none left)
                    break
                self.beats.take(data, time.monotonic(), time.time())

    def run(self, step: subprocess.Popen[bytes]) -> None:
        while not self.done.is_set():
            self.drain(0.25)
            lost = self.beats.lost(time.monotonic())
            if lost and running(step):
                self.end_lost(step, *lost[0])
                return

    def end_lost(self, step: subprocess.Popen[bytes], node: str, silent: float) -> None:
        b = self.beats
        failed = sorted(b.failed)
        last = time.strftime("%H:%M:%S", time.localtime(b.heard_at[node]))
        why = (f"its task has sent no heartbeat for {silent:.1f}s (the last at {last})"
               + (f", after a rank failed on {', '.join(failed)}" if failed else ""))  # fmt: skip
        now = time.time()
        self.lost = {"node": node, "why": why, "heard": round(b.heard_at[node], 3), "detected": round(now, 3)}
        # the fault happened when the node was last heard (what came later, its peers' errors, is no
        # progress); it was detected now (a peer's failure heard before was its consequence)
        timeline = {"last_progress": min(b.times.get("last_progress", now), b.heard_at[node]), "failed": now,
                    "stop_sent": now}  # fmt: skip
        say(f"nodeops: {node} lost: {why}; stopping the training step")
        with contextlib.suppress(OSError):
            step.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + LOST_GRACE
        while running(step) and time.monotonic() < deadline and not b.settled(time.monotonic(), node):
            self.drain(0.1)
        if running(step):
            say(f"nodeops: srun still waits for {node}'s task: SIGKILL")
            with contextlib.suppress(OSError):
                step.send_signal(signal.SIGKILL)
        b.times.update(timeline)


class Exit(Exception):
    """The job ends here with this code (its result already written)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Batch:
    """One run of the job on its batch node."""

    def __init__(self, cfg: dict[str, Any], config_path: str, args: Sequence[str]) -> None:
        self.cfg, self.args = cfg, list(args)
        self.env = os.environ
        self.run_dir = self.env["NODEOPS_RUN_DIR"]
        restart = self.env.get("SLURM_RESTART_COUNT", "")
        self.restart = int(restart) if restart.isdigit() else 0
        self.job = self.env.get("SLURM_JOB_ID", "")
        self.nodelist = self.env.get("SLURM_JOB_NODELIST", "")
        self.batch_node = self.env.get("SLURMD_NODENAME", "")
        self.num_nodes = self.env.get("SLURM_JOB_NUM_NODES", "")
        self.task = ["python3", "-I", os.path.abspath(__file__), "task", os.path.abspath(config_path)]
        self.got_signal = ""
        self.step: subprocess.Popen[bytes] | None = None  # srun (or mpirun): the time-limit signal goes there
        self.watch: subprocess.Popen[bytes] | None = None
        self.nodes: list[str] = []
        self.began = time.time()  # the first training step's timeline begins with the job (its preflight included)
        self.beat_address = ""  # where the nodes' tasks send their heartbeats: the batch node's NodeAddr
        self.steps = 0
        self.times: dict[str, float] = {}  # the last training step's timeline (step_times)
        self.lost: dict[str, Any] | None = None  # the node whose heartbeats stopped, and why, when one did
        self.finished: dict[str, list[int]] = {}  # the last training step's nodes: [ranks ended, started]

    def path(self, key: str) -> str:
        return os.path.join(self.run_dir, self.cfg["files"][key])

    def result(self, result: dict[str, Any] | None) -> None:
        """result.json (read by launch and status) and this run's line in attempts.jsonl."""
        if result is not None:
            with open(os.path.join(self.run_dir, "result.json"), "w") as f:
                f.write(result_text(result) + "\n")
        with open(os.path.join(self.run_dir, "attempts.jsonl"), "a") as f:
            f.write(attempt_line(self.restart + 1, self.nodelist, result) + "\n")

    def fail(self, code: int, result: dict[str, Any]) -> Exit:
        self.result(result)
        return Exit(code)

    def forward(self, _sig: int, _frame: Any) -> None:
        """slurm.signal: Slurm signals the batch shell only (B:) before the time limit; srun forwards
        it to every node's torchrun, which (told by --signals-to-handle) sends it on to its ranks
        and gives them its shutdown timeout to checkpoint before it ends them."""
        name = self.cfg["signal"]
        self.got_signal = f"SIG{name}"
        who = {"deepspeed": "DeepSpeed's launcher on every node", "mpirun": "mpirun"}.get(
            self.cfg["runner"], "torchrun on every node"
        )
        say(f"nodeops: SIG{name} (the time limit is near): forwarding it to {who}")
        # the ranks may now go quiet to checkpoint: the hang watchdog stands down
        for proc, sig in ((self.watch, signal.SIGTERM), (self.step, getattr(signal, f"SIG{name}"))):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(sig)

    def run(self) -> int:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the batch shell: Python's KeyboardInterrupt is not
        _, names = output(["scontrol", "show", "hostnames", self.nodelist])
        self.nodes = [n for n in names.split("\n") if n]
        # Since 22.05 srun does not inherit --cpus-per-task from sbatch.
        if self.env.get("SLURM_CPUS_PER_TASK"):
            self.env["SRUN_CPUS_PER_TASK"] = self.env["SLURM_CPUS_PER_TASK"]
        if self.cfg["signal"]:  # (set before the preflight and fabric steps: training then gets it)
            signal.signal(getattr(signal, "SIG" + self.cfg["signal"]), self.forward)
        try:
            self.preflight()
            self.rendezvous()
            self.fabric()
            return self.train()
        except Exit as e:
            return e.code

    def preflight(self) -> None:
        """Unless launch was told --no-check (then there is no preflight.in): the node probe of
        `nodeops check`, one srun task per node, judged here by the same rules. A node that fails
        ends the job now, before any training rank starts."""
        if not readable(self.path("preflight_in")):
            return
        say(f"nodeops: preflight: probing the {self.num_nodes} node(s) of the allocation in one srun step")
        rows = self.path("preflight_out")
        if os.path.lexists(rows):
            os.remove(rows)
        out = os.path.join(self.run_dir, "preflight.out")
        # each node's own error (its python3 gone, the probe crashing) in its own file: the gate
        # shows it for a node that did not answer
        errs = self.path("preflight_errors")
        os.makedirs(errs, exist_ok=True)
        for name in os.listdir(errs):
            os.remove(os.path.join(errs, name))
        with open(self.path("preflight_in"), "rb") as stdin, open(out, "wb") as stdout:
            srun_rc = status(["timeout", "--kill-after=30", str(self.cfg["preflight_timeout"]), "srun",
                              "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--input=all",
                              f"--error={errs}/%N.err", "python3", "-c", self.cfg["boot"]["probe"]],
                             stdin=stdin, stdout=stdout)  # fmt: skip
        pre = status(["python3", "-c", self.cfg["boot"]["gate"], self.path("preflight_in"), out, self.run_dir,
                      str(srun_rc), *self.nodes])  # fmt: skip
        if pre != 0:
            # no rows written: the preflight itself broke (python3 missing here, a crash), not a node
            kind = "failed" if readable(rows) else "error"
            say(f"nodeops: preflight {kind} (exit {pre}): no training rank was started in this run "
                f"(restart {self.restart}; every row: {rows})")  # fmt: skip
            raise self.fail(pre, {"exit": pre, "restart": self.restart, "signal": "", "requeued": False,
                                  "preflight": kind})  # fmt: skip
        say(f"nodeops: preflight ok on {self.num_nodes} node(s)")

    def rendezvous(self) -> None:
        """MASTER_ADDR: the NodeAddr (node names need not resolve on the nodes) of the batch node
        with launch.restarts (it runs this and rank 0 in every attempt, so a restart never replaces
        it), else of the first node. MASTER_PORT from the job id, below the ephemeral range
        (32768-60999): jobs sharing a node differ. Then whether the tasks pass signals on."""
        head = self.batch_node if self.cfg["restarts"] else (self.nodes[0] if self.nodes else "")
        _, shown = output(["scontrol", "show", "node", head])
        self.env["MASTER_ADDR"] = node_addr(shown) or head
        if head != self.batch_node:
            _, shown = output(["scontrol", "show", "node", self.batch_node])
        self.beat_address = node_addr(shown) or self.batch_node
        job = int(self.job) if self.job.isdigit() else 0
        self.env["MASTER_PORT"] = str(self.cfg["port_base"] + job % self.cfg["port_span"])
        _, config = output(["scontrol", "show", "config"], stderr=subprocess.DEVNULL)
        self.env["NODEOPS_FORWARD_SIGNALS"] = "1" if forward_signals(config) else ""

    def fabric(self) -> None:
        """launch --fabric-check (then there is fabric.args): the fabric measurement of `check
        --fabric` on the nodes of this allocation, judged here by nodeops' own rules (shipped in
        fabric-gate/). A slow node ends the job now, before any training rank starts."""
        if not readable(self.path("fabric_args")):
            return
        say(f"nodeops: fabric: measuring the links of the {self.num_nodes} node(s) before training")
        with open(self.path("fabric_args")) as f:
            fabric_args = f.read().split("\n")
        if fabric_args and fabric_args[-1] == "":
            fabric_args.pop()
        doc, report = self.path("fabric_doc"), self.path("fabric_report")
        for p in (doc, report):
            if os.path.lexists(p):
                os.remove(p)
        logs = os.path.join(self.run_dir, "logs")
        env = dict(self.env, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
        step = step_argv(self.cfg, self.task, "torchrun", f"{self.job}-fabric", 0,
                         [os.path.join(self.run_dir, "fabric.py"), *fabric_args, "--out", doc], wait=60,
                         log_dir=logs)  # fmt: skip
        fabric_rc = status(["timeout", "--kill-after=30", str(self.cfg["fabric_timeout"]), *step], env=env)
        # from the gate's own dir: `python3 -m` looks in the current dir first (a workdir's nodeops/ must not answer)
        gate, fab = self.path("fabric_gate"), 1
        if os.path.isdir(gate):
            fab = status(["python3", "-m", "nodeops.node.fabric", self.path("fabric_config"), doc, report,
                          *[os.path.join(logs, f"{n}.log") for n in self.nodes]], cwd=gate)  # fmt: skip
        # failed: the gate judged the fabric slow; error: no judgement (no result, the gate broke, or
        # the step did not end cleanly on every node after its measurement)
        kind = ""
        if fab == 1 and readable(report):
            kind = "failed"
        elif fab != 0 or not readable(report) or fabric_rc != 0:
            kind = "error"
        if kind:
            say(f"nodeops: fabric check {kind} (its srun step exited {fabric_rc}, the gate {fab}): no training "
                f"rank was started in this run (restart {self.restart})")  # fmt: skip
            raise self.fail(1, {"exit": 1, "restart": self.restart, "signal": self.got_signal, "requeued": False,
                                "fabric": kind, "fabric_step": fabric_rc, "fabric_gate": fab})  # fmt: skip

    def runner_fail(self, why: str) -> Exit:
        say(f"nodeops: {self.cfg['runner']}: {why}; no rank was started", err=True)
        return self.fail(1, ended(1, self.restart, self.got_signal))

    def count(self) -> RankPlan:
        """Runners mpirun and deepspeed: the GPUs Slurm gave each node, counted by a short srun
        step before any rank starts."""
        if self.cfg["runner"] == "mpirun":
            for key in ("mpi_split", "mpi_shim", "mpi_protocol"):
                if not readable(self.path(key)):
                    raise self.runner_fail(f"{self.path(key)} is missing (nodeops launch writes it; runner mpirun "
                                           "needs it)")  # fmt: skip
        count_rc, counted = output(["timeout", "--kill-after=30", str(self.cfg["preflight_timeout"]), "srun",
                                    "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c",
                                    COUNT_TASK])  # fmt: skip
        plan, why = plan_ranks(self.nodes, gpu_counts(counted), self.cfg["nproc"], self.batch_node, count_rc)
        if plan is None:
            raise self.runner_fail(why)
        say(f"nodeops: {self.cfg['runner']}: {plan.ranks} rank(s) on {self.num_nodes} node(s) "
            f"(ranks per node: {plan.per_node})")  # fmt: skip
        return plan

    def train(self) -> int:
        # `nodeops stacks` and the hang watchdog (launch writes their files; a job submitted by hand
        # has none): the ranks' stack hook first on their PYTHONPATH, and the file a script may
        # touch to show progress without printing.
        self.env["NODEOPS_PROGRESS_FILE"] = os.path.join(self.run_dir, "progress")
        try:  # the env's python3, for `nodeops stacks`
            with open(self.path("python_path"), "w") as f:
                f.write((shutil.which("python3") or "") + ("\n" if shutil.which("python3") else ""))
        except OSError:
            pass
        hook = os.path.join(self.run_dir, "hook")
        if readable(os.path.join(hook, "sitecustomize.py")):
            self.prepend_path(hook)
        shutil.rmtree(os.path.join(self.run_dir, "signalled"), ignore_errors=True)  # the tasks' marks
        runner = self.cfg["runner"]
        if runner == "mpirun":
            return self.finish(*self.mpirun(self.count()))
        if runner == "deepspeed":
            self.deepspeed_env(self.count())
            return self.finish(*self.attempt("deepspeed", self.job, self.nodes))
        if not self.cfg["restarts"]:
            return self.finish(*self.attempt("torchrun", self.job, self.nodes))
        return self.finish(*self.restarts())

    def prepend_path(self, d: str) -> None:
        old = self.env.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = d + (":" + old if old else "")

    def deepspeed_env(self, plan: RankPlan) -> None:
        """DeepSpeed's world_info (every node's GPUs, the ids in Slurm's CUDA_VISIBLE_DEVICES, in
        the allocation's order) and the .deepspeed_env lines, read as DeepSpeed's runner reads
        them, which each node's task evals after the spec's env (as pdsh's remote shell does)."""
        rc, world = output(["python3", "-I", "-c", self.cfg["boot"]["ds_world"], *plan.world])
        if rc != 0:
            raise self.runner_fail("cannot write DeepSpeed's world_info")
        rc, ds_env = output(["python3", "-I", "-c", self.cfg["boot"]["ds_env"]])
        if rc != 0:
            raise self.runner_fail("a .deepspeed_env that cannot be used as it is (above)")
        if status(["bash", "-n", "-c", ds_env]) != 0:
            raise self.runner_fail("the .deepspeed_env lines are not valid shell (above)")
        self.env.update(NODEOPS_DS_WORLD=world, NODEOPS_DS_NODES=" ".join(self.nodes), NODEOPS_DS_EXPORTS=ds_env)
        # DeepSpeed's runner puts its current dir (the workdir) first on the ranks' PYTHONPATH
        self.prepend_path(self.env.get("PWD") or os.getcwd())

    def mpirun(self, plan: RankPlan) -> tuple[int, bool]:
        """Open MPI's mpirun runs here and starts its daemons on the other nodes through srun (its
        own Slurm support): ranks filled node by node (Open MPI takes a node's slots from
        SLURM_TASKS_PER_NODE, set here). Each rank runs the MPI shim; mpi_split.py writes each
        rank's lines, tagged by mpirun, into its own node's log."""
        read, write = os.pipe()
        try:
            split = start(["python3", "-I", self.path("mpi_split"), self.run_dir, *plan.rank_nodes], stdin=read)
            env = dict(self.env, SLURM_TASKS_PER_NODE=plan.per_node)
            argv = mpirun_argv(plan, plm_args(self.env.get("SLURM_GPUS", ""), plan.other_gpus),
                               self.path("mpi_shim"), self.args)  # fmt: skip
            try:
                self.step = start(argv, env=env, stdout=write, stderr=write)
            except OSError as e:
                say(f"nodeops: mpirun: {e}", err=True)
        finally:
            os.close(read)
            os.close(write)
        self.start_watch(self.nodes)
        rc = self.wait_step() if self.step is not None else 127
        split_rc = shell_rc(split.wait())
        if split_rc != 0:
            say(f"nodeops: mpirun: its output splitter exited {split_rc}: ranks' lines may be missing from logs/",
                err=True)  # fmt: skip
        say(f"nodeops: mpirun exited {rc}")
        return self.after_step(rc)

    def attempt(self, launcher: str, rdzv: str, nodes: Sequence[str], *, step_nodes: Sequence[str] = (),
                overlap: bool = False) -> tuple[int, bool]:  # fmt: skip
        """One training step: one srun task per node running torchrun (or DeepSpeed's launcher).
        --wait: srun ends the other nodes' tasks this long after one has ended (at least the
        signal's seconds: a node still checkpointing is not cut short)."""
        argv = step_argv(self.cfg, self.task, launcher, rdzv, self.cfg["max_restarts"], self.args,
                         nodes=step_nodes, overlap=overlap, log_dir=os.path.join(self.run_dir, "logs"))  # fmt: skip
        began = self.began if self.steps == 0 else time.time()
        self.steps += 1
        listener = self.listen(nodes)
        try:
            self.step = start(argv, env=dict(self.env, NODEOPS_HEARTBEAT=listener.env) if listener else None)
        except OSError as e:
            say(f"nodeops: srun: {e}", err=True)
            say("nodeops: srun exited 127")
            if listener is not None:
                listener.stop()
            return self.after_step(127)
        if listener is not None:
            listener.start(self.step)
        self.start_watch(nodes)
        rc = self.wait_step()
        ended_at = time.time()
        if listener is not None:
            listener.stop()
        self.lost = listener.lost if listener is not None else None
        self.times = step_times(began, listener.beats.times if listener is not None else {}, ended_at)
        self.finished = finished_ranks(self.run_dir, self.cfg["files"], nodes, began)
        if self.lost is not None:  # srun's exit is the SIGKILL that ended its wait for the lost node
            say(f"nodeops: srun exited {rc}: the step was ended for {self.lost['node']}, lost (exit 1)")
            rc = 1
        else:
            say(f"nodeops: srun exited {rc}")
        rc, hung = self.after_step(rc)
        self.record_step()
        return rc, hung

    def listen(self, nodes: Sequence[str]) -> Listener | None:
        """The heartbeats' listener for a step on ``nodes`` (None where it cannot listen: the
        step then ends as srun ends it)."""
        if not self.beat_address:
            return None
        try:
            return Listener(self.beat_address, nodes)
        except OSError as e:
            say(f"nodeops: no heartbeats from the nodes in this step (a lost node is found by srun alone): {e}",
                err=True)  # fmt: skip
            return None

    def record_step(self) -> None:
        """The step's timeline and its lost node, for the restart rules (``decide``)."""
        attempt = self.env.get("NODEOPS_ATTEMPT", "1")
        doc = {"attempt": int(attempt) if attempt.isdigit() else 1, "times": self.times, "lost": self.lost,
               "finished": self.finished}  # fmt: skip
        try:
            with open(self.path("step") + ".tmp", "w") as f:
                json.dump(doc, f)
            os.replace(self.path("step") + ".tmp", self.path("step"))
        except OSError as e:
            say(f"nodeops: cannot record the step's timeline: {e}", err=True)

    def start_watch(self, nodes: Sequence[str]) -> None:
        """The hang watchdog: no log line and no progress for launch's hang timeout -> every rank's
        stack (an srun --overlap step), the verdict in hang.json, and SIGTERM to the step's
        launcher (srun, or mpirun for runner mpirun)."""
        watch = os.path.join(self.run_dir, "watch.py")
        if readable(self.path("watch_config")) and readable(watch) and not self.got_signal and self.step:
            try:
                self.watch = start(["python3", watch, self.run_dir, str(self.step.pid), *nodes])
            except OSError as e:
                say(f"nodeops: the hang watchdog: {e}", err=True)

    def wait_step(self) -> int:
        """srun's (or mpirun's) own exit: a signal handled meanwhile does not end the wait."""
        assert self.step is not None
        if self.got_signal:  # it came before the step started
            with contextlib.suppress(OSError):
                self.step.send_signal(getattr(signal, "SIG" + self.cfg["signal"]))
        return shell_rc(self.step.wait())

    def after_step(self, rc: int) -> tuple[int, bool]:
        """The step's exit as the run's: 1 when the ranks ended on the time-limit signal, 124 when
        the hang watchdog stopped it. Returns (exit, hung)."""
        if self.cfg["signal"] and self.got_signal and rc == 0 and os.path.isdir(os.path.join(self.run_dir,
                                                                                            "signalled")):  # fmt: skip
            rc = 1
            say(f"nodeops: the ranks ended on {self.got_signal} before the time limit; the run did not finish "
                "(exit 1)")  # fmt: skip
        if self.watch is not None:
            if self.watch.returncode is None:
                with contextlib.suppress(OSError):
                    self.watch.terminate()
            self.watch.wait()
        hung = readable(self.path("hang"))
        if hung:
            rc = 124
            say("nodeops: the hang watchdog stopped the run (exit 124)")
            self.times.update(hang_times(self.path("hang")))
        self.step = self.watch = None  # (a signal from now on has no step to go to)
        return rc, hung

    def recover(self, *args: str) -> tuple[int, str]:
        """launch.restarts' rules (recover/nodeops/node/slurm_failures.py, shipped by launch)."""
        d = self.path("recover")
        if not os.path.isdir(d):
            say(f"nodeops: cannot run the restart rules: no {d}", err=True)
            return 1, ""
        return output(["python3", "-E", "-s", "-m", "nodeops.node.slurm_failures", *args], cwd=d)

    def restarts(self) -> tuple[int, bool]:
        """launch.restarts: each attempt is one srun step on its own nodes, inside this allocation
        (sbatch --no-kill: a failed node does not end the job). After a failure, the rules of an
        ssh run name the fault and its node, exclude that node, bring in a spare (or go on with
        fewer nodes, down to launch.min_nodes), and record every attempt in attempts.json; the
        next step starts with --overlap (a lost node's step is never reported ended, and would
        hold the other nodes)."""
        _, active = self.recover("start", self.run_dir, self.batch_node, *self.nodes)
        if not active:
            say("nodeops: restarts: cannot plan the attempts (above); no rank was started", err=True)
            raise self.fail(1, ended(1, self.restart, self.got_signal))
        attempt, rc, hung = 1, 0, False
        while True:
            if attempt > 1:
                _, active = self.recover("begin", self.run_dir, str(attempt))
                if not active:
                    self.recover("abort", self.run_dir, "the rules failed (above)")
                    break
            step_nodes = active.split("\n", 1)[0].split(",")
            self.env.update(NODEOPS_RESTART_COUNT=str(attempt - 1), NODEOPS_ATTEMPT=str(attempt))
            say(f"nodeops: attempt {attempt} of {self.cfg['restarts'] + 1} on {active}")
            rc, hung = self.attempt("torchrun", f"{self.job}-{attempt}", step_nodes, step_nodes=step_nodes,
                                    overlap=attempt > 1)  # fmt: skip
            # the attempt's verdict and the next one's nodes: 'go NODES SECONDS', or 'stop'
            code, answer = self.recover("decide", self.run_dir, str(attempt), str(rc), self.got_signal)
            backoff = next_attempt(answer) if code == 0 else None
            if backoff is None:
                break
            deadline = time.monotonic() + backoff
            while not self.got_signal and time.monotonic() < deadline:  # a signal ends the back-off at once
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            if self.got_signal:
                self.recover("abort", self.run_dir, f"{self.got_signal} came (the time limit is near)")
                break
            attempt += 1
            shutil.rmtree(os.path.join(self.run_dir, "signalled"), ignore_errors=True)
        return rc, hung

    def finish(self, rc: int, hung: bool) -> int:
        """The run's result, and with slurm.max_requeues, the requeue of a failed run."""
        limit = self.cfg["max_requeues"]
        finished = bool(self.finished) and all(up > 0 and done >= up for done, up in self.finished.values())
        # a run whose every rank had finished its work before one crashed in teardown is not run again
        requeue = bool(limit and rc != 0 and self.restart < limit and not (finished and self.lost is None and not hung))
        res = ended(rc, self.restart, self.got_signal, requeued=requeue, hung=hung)
        if self.times:  # the last training step's timeline, and the node it lost
            res["times"] = self.times
        if self.lost is not None:
            res["lost"] = self.lost
        if rc != 0 and any(started for _, started in self.finished.values()):  # told apart by them: job.teardown
            res["finished"] = self.finished
        if requeue:
            say(f"nodeops: requeueing job {self.job} (restart {self.restart + 1} of {limit})")
            self.result(res)
            status(["scontrol", "requeue", self.job])
            return rc
        self.result(res)
        return rc


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("batch", "task"):
        say("usage: slurm_batch.py batch CONFIG SCRIPT [ARGS...] | task CONFIG LAUNCHER RDZV MAX_RESTARTS "
            "SCRIPT [ARGS...]", err=True)  # fmt: skip
        return 2
    with open(argv[1]) as f:
        cfg = json.load(f)
    if argv[0] == "task":
        if len(argv) < 5:
            say("nodeops: task: LAUNCHER RDZV MAX_RESTARTS SCRIPT... expected", err=True)
            return 2
        return task_main(cfg, argv[2:])
    return Batch(cfg, argv[1], argv[2:]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) & 255)
