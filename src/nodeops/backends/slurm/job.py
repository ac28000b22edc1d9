"""nodeops on a Slurm cluster: the batch script, and submitting, watching and cancelling it.

The batch script (``templates/slurm/job.sbatch.j2``) takes the training script and its arguments
as its own arguments (``sbatch job.sbatch train.py --lr 1e-3``), so ``nodeops render`` writes the
very file ``launch`` submits, and arguments never pass through a template. One ``srun`` step
runs torchrun on every node (one task per node, ``--kill-on-bad-exit=1 --wait=60``), with c10d
rendezvous on the first node's ``NodeAddr`` and a port derived from the job id. The template is
a thin bash part (run dir, workdir, env, activation); what the job then does is the batch
driver it carries (``nodeops.node.slurm_batch``, with :func:`batch_config`'s settings).

Everything runs on the login node (``slurm.login``, over the spec's ssh with pinned host keys) or
on this machine when there is none: one ``bash -s`` per action, the script on stdin. The run dir
(``~/.nodeops/runs/RUN`` on the login node) must be on the filesystem the nodes share; the
batch log and one log per node (``logs/NODE.log``) are read from there.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeops.errors import NodeopsError
from nodeops.launch.plan import TEE_ENV
from nodeops.node import check_rules, failures, mpi_split, probe
from nodeops.node import recovery as R
from nodeops.node import slurm_batch as B
from nodeops.node import slurm_failures as SF
from nodeops.node import slurm_watch as W
from nodeops.node import stacks as S
from nodeops.node.slurm_failures import RESTART_MARK, first_failure
from nodeops.quoting import sh_path, sh_run_word, sh_word
from nodeops.resources import data_dir
from nodeops.setup.render import activation
from nodeops.spec import deepspeed as ds
from nodeops.spec.model import ENV_NAME, LoadedSpec, ResourceSpec
from nodeops.transport import ssh_argv

if TYPE_CHECKING:
    from nodeops.node.slurm_failures import Tails

COMMENT = "nodeops-run="  # the job's --comment: nodeops-run=RUN_ID
PORT_BASE = 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN: below Linux's ephemeral range
PORT_SPAN = 10000
BATCH_LOG = "batch.log"
SCRIPT = "job.sbatch"
PREFLIGHT_IN = "preflight.in"  # the preflight step's input (launch writes it unless --no-check)
PREFLIGHT_OUT = "preflight.json"  # every row of the preflight step (check_rules.gate writes it)
FABRIC_ARGS = "fabric.args"  # launch --fabric-check: the probe's arguments, one per line (the step runs if it is there)
FABRIC_CONFIG = "fabric.json"  # its thresholds, for the gate (nodeops.node.fabric.gate_main)
FABRIC_DOC = "fabric.doc.json"  # the probe's document (rank 0 writes it)
FABRIC_REPORT = "fabric.report.json"  # the gate's report (FabricReport.to_json)
FABRIC_GATE_DIR = "fabric-gate"  # the gate's package: nodeops/{__init__,errors,fabric,fabric_probe}.py
FABRIC_TIMEOUT = 300  # seconds the fabric step may take (start-up, the 30 s budget, a stuck rank's timeouts)
RUN_ENV = "run.env"  # in the run dir: this run's own env (`export K=V` lines), sourced after the spec's env file
PYTHON_PATH = "python3.path"  # in the run dir: the job's python3 (its activated env's), for `nodeops stacks`
PREFLIGHT_TIMEOUT = 300  # seconds the preflight step may take before the job ends as failed
# Job states after which nothing of the job runs any more (squeue's long names).
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED", "REVOKED", "SPECIAL_EXIT")  # fmt: skip
# States in which the job is alive (waiting, running or on its way back): status exits 0.
LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED",
        "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")  # fmt: skip
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun handles unless told
STEP_WAIT = 60  # srun --wait: the seconds the other tasks of a step have after one ended
READ_MAX = 1 << 20  # bytes of one log read per poll
MPI_SPLIT = "mpi_split.py"  # runner mpirun: in the run dir, each rank's lines into its node's log
MPI_SHIM = S.SHIM  # runner mpirun: in the run dir, Open MPI's rank variables -> env:// names
MPI_PROTOCOL = "protocol.py"  # runner mpirun: beside mpi_split.py, which reads its PEER_LOST
BATCH_DIR = "batch"  # in the run dir: the batch driver (nodeops.node.slurm_batch) and its settings
BATCH_DRIVER = "slurm_batch.py"
BATCH_CONFIG = "config.json"
KILL_WAIT_MAX = 70  # how long `stop` waits after scancel before SIGKILL: KillWait (30 s default) plus margin


class SlurmError(NodeopsError):
    pass


def shape_options(spec: ResourceSpec) -> list[str]:
    """Where the job may run and what it gets, as sbatch and srun both take them."""
    s = spec.slurm
    assert s is not None
    return [f"--{opt}={value}" for opt, value in (
        ("partition", s.partition), ("account", s.account), ("qos", s.qos), ("constraint", s.constraint),
        ("gpus-per-node", s.gpus_per_node), ("gpus", s.gpus),
    ) if value is not None]  # fmt: skip


def spares(spec: ResourceSpec) -> int:
    """The spare nodes a job asks for (slurm.spare_nodes, with launch.restarts only)."""
    s = spec.slurm
    assert s is not None
    return s.spare_nodes if spec.launch.restarts else 0


def allocated(spec: ResourceSpec) -> int:
    """The nodes a job asks for: slurm.nodes and its spares."""
    assert spec.slurm is not None
    return spec.slurm.nodes + spares(spec)


def sbatch_lines(spec: ResourceSpec, cluster: str) -> list[str]:
    """The ``#SBATCH`` options, one per line, from the spec's ``slurm:`` section."""
    s = spec.slurm
    assert s is not None
    out = [f"--job-name=nodeops-{cluster}", f"--nodes={allocated(spec)}", "--ntasks-per-node=1", "--open-mode=append"]
    out += shape_options(spec)
    for opt, value in (("time", s.time), ("cpus-per-task", s.cpus_per_task), ("mem", s.mem)):
        if value is not None:
            out.append(f"--{opt}={value}")
    if s.exclusive:
        out.append("--exclusive")
    if spec.launch.restarts:  # a failed node must not end the job: the batch script restarts without it
        out.append("--no-kill")
    if s.signal is not None:
        out.append(f"--signal=B:{s.signal.name}@{s.signal.seconds}")
    out.append("--requeue" if s.max_requeues else "--no-requeue")
    for k, v in sorted(s.sbatch_extra.items()):
        name = k.removeprefix("--")
        if v is True:
            out.append(f"--{name}")
        elif v is not False:
            out.append(f"--{name}={v}")
    return out


def env_file(cluster: str) -> str:
    return f"~/.nodeops/{cluster}/env.sh"


def _safe_name(name: str) -> str:
    """A file name as it may appear in a comment of the script (no newline can end the comment)."""
    return re.sub(r"[^\w.+-]", "_", name)


def batch_config(loaded: LoadedSpec) -> dict[str, Any]:
    """The batch driver's settings (``nodeops.node.slurm_batch``): the runner, the signal, the
    restarts and requeues, the run dir's file names and the boot code of the steps it runs."""
    spec = loaded.spec
    s = spec.slurm
    assert s is not None
    signals = DEFAULT_SIGNALS + (f",SIG{s.signal.name}" if s.signal and s.signal.name not in ("TERM", "INT") else "")
    runner = spec.launch.runner
    boot = {"probe": probe.BOOT, "gate": check_rules.GATE_BOOT}
    if runner == "deepspeed":
        boot.update(ds_world=ds.WORLD_INFO_BOOT, ds_env=ds.ENV_FILE_BOOT)
    files = {"preflight_in": PREFLIGHT_IN, "preflight_out": PREFLIGHT_OUT,
             "preflight_errors": check_rules.PREFLIGHT_ERRORS, "watch_config": W.CONFIG, "hang": W.HANG,
             "python_path": PYTHON_PATH, "fabric_args": FABRIC_ARGS, "fabric_config": FABRIC_CONFIG,
             "fabric_doc": FABRIC_DOC, "fabric_report": FABRIC_REPORT, "fabric_gate": FABRIC_GATE_DIR,
             "mpi_split": MPI_SPLIT, "mpi_shim": MPI_SHIM, "mpi_protocol": MPI_PROTOCOL,
             "recover": SF.PACKAGE_DIR, "step": SF.STEP, "finished_dir": S.FINISHED_DIR,
             "stacks_dir": S.STACKS_DIR}  # fmt: skip
    return {
        "runner": runner, "signal": s.signal.name if s.signal else None, "max_requeues": s.max_requeues,
        "restarts": spec.launch.restarts if runner == "torchrun" else 0, "max_restarts": spec.launch.max_restarts,
        "nproc": spec.launch.nproc_per_node or 1,
        "step_wait": STEP_WAIT if s.signal is None else max(STEP_WAIT, s.signal.seconds),
        "torchrun_extra": [] if s.signal is None else [f"--signals-to-handle={signals}"],
        "port_base": PORT_BASE, "port_span": PORT_SPAN, "preflight_timeout": PREFLIGHT_TIMEOUT,
        "fabric_timeout": FABRIC_TIMEOUT, "files": files, "boot": boot,
    }  # fmt: skip


def batch_script(loaded: LoadedSpec) -> str:
    """The batch script for the spec (the same bytes for every run: the run is in its env): the
    shell that sets the run up, then the batch driver it carries (``nodeops.node.slurm_batch``)."""
    import jinja2

    spec = loaded.spec
    s = spec.slurm
    assert s is not None
    login = spec.login_node() or spec.chief
    env = {"PYTHONUNBUFFERED": "1", **TEE_ENV}
    driver = Path(B.__file__).read_text()
    j = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, autoescape=False,
                           keep_trailing_newline=True)  # fmt: skip
    j.filters["sh_run_word"] = sh_run_word
    j.filters["sh_path"] = sh_path
    tpl = j.from_string((data_dir("templates") / "slurm" / "job.sbatch.j2").read_text())
    return str(tpl.render(
        cluster=loaded.cluster_name, spec_file=_safe_name(Path(loaded.file).name),
        sbatch=sbatch_lines(spec, loaded.cluster_name),
        workdir=spec.workdir.path if spec.workdir is not None else "~", env_file=env_file(loaded.cluster_name),
        activate=activation(spec, login), env=env, max_requeues=s.max_requeues, restart_mark=RESTART_MARK,
        hang_file=W.HANG, run_env=RUN_ENV, runner=spec.launch.runner, batch_dir=BATCH_DIR,
        driver_file=BATCH_DRIVER, config_file=BATCH_CONFIG, driver=driver,
        config=json.dumps(batch_config(loaded), indent=1, sort_keys=True),
    ))  # fmt: skip


def env_lines(env: Mapping[str, str]) -> str:
    """A run's own env as the batch script sources it (``RUN_ENV``); a name that is not one is
    refused (ValueError), values are quoted for bash."""
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"not environment variable names: {bad}")
    return "".join(f"export {k}={sh_word(v)}\n" for k, v in sorted(env.items()))


# --------------------------------------------------------------------------- the login node
@dataclass(frozen=True)
class Login:
    """Where sbatch/squeue/scancel run: over ssh (``host`` in ``ssh_config``) or on this machine."""

    host: str | None
    ssh_config: Path | None = None
    connect_timeout: int | None = None  # seconds for ssh's connection, instead of nodeops' usual 10

    def run(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``bash -s`` with ``script`` on stdin (nothing of it on a command line)."""
        argv = ["bash", "-s"]
        if self.host is not None:
            argv = ssh_argv(self.ssh_config or Path(), self.host, *argv, connect_timeout=self.connect_timeout)
        try:
            # its own session: a Ctrl-C at the terminal reaches nodeops, which decides (ssh is
            # then ended by subprocess, or left to finish a submission)
            return subprocess.run(argv, input=script, capture_output=True, text=True, timeout=timeout, check=False,
                                  start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{self.where}: no answer within {timeout:.0f}s") from None

    @property
    def where(self) -> str:
        return f"login node {self.host}" if self.host else "this machine"


def run_dir_sh(run_id: str) -> str:
    return f'"$HOME"/.nodeops/runs/{sh_word(run_id)}'


def submit(login: Login, run_id: str, script: str, user_argv: Sequence[str],
           files: Mapping[str, str] | None = None, in_run_dir: bool = False) -> str:  # fmt: skip
    """Write the run dir, the batch script and ``files`` (name -> text, a name may hold one dir:
    the preflight's input, the stacks and hang-watchdog files) on
    the login node and ``sbatch --parsable`` it; returns the job id. The user's arguments become
    the script's, quoted for the login shell; ``in_run_dir``: the first one names a file of
    ``files`` (a probe nodeops ships), and becomes its absolute path."""
    d = run_dir_sh(run_id)
    words = [sh_word(a) for a in user_argv]
    if in_run_dir and words:
        words[0] = f'"$d"/{words[0]}'
    args = " ".join(words)
    dirs = sorted({name.rsplit("/", 1)[0] for name in files or {} if "/" in name})
    writes = "".join(f'mkdir -p "$d/"{sh_word(sub)}\n' for sub in dirs) + "".join(
        f'printf %s {base64.b64encode(text.encode()).decode()} | base64 -d > "$d/"{sh_word(name)}\n'
        for name, text in {SCRIPT: script, **(files or {})}.items()
    )
    text = (
        "set -eu\numask 077\n"
        f'd={d}\nmkdir -p "$d/logs"\nchmod 700 "$d"\n'
        f"{writes}"
        "command -v sbatch >/dev/null || { echo 'sbatch is not on PATH here' >&2; exit 3; }\n"
        # the run dir reaches the job by name on sbatch's command line (SBATCH_EXPORT=NONE cannot
        # drop it; values would be split at commas); the run id also goes into the job's comment,
        # so a job whose sbatch did not answer in time can be found again
        'exp=${SBATCH_EXPORT:-ALL}; case $exp in NONE|NIL|none|nil) exp=;; *) exp="$exp,";; esac\n'
        f'jid=$(NODEOPS_RUN_DIR="$d" NODEOPS_RUN_ID={run_id} sbatch --parsable '
        f'--export="${{exp}}NODEOPS_RUN_DIR,NODEOPS_RUN_ID" --comment={COMMENT}{run_id} '
        f'--output="$d/{BATCH_LOG}" "$d/{SCRIPT}" {args})\n'
        'echo "NODEOPS_JOB=${jid%%;*}"\n'
    )
    try:
        p = login.run(text)
    except SlurmError as e:  # no answer in time: sbatch may still have queued it, under our comment
        job_id = find_job(login, run_id)
        if job_id:
            return job_id
        raise SlurmError(f"{e}; squeue shows no job of run {run_id}, so none was queued") from None
    found = [line.split("=", 1)[1] for line in p.stdout.splitlines() if line.startswith("NODEOPS_JOB=")]
    job_id = found[-1] if found else ""
    if p.returncode != 0 or not job_id.isdigit():
        why = (p.stderr.strip() or p.stdout.strip() or f"exit {p.returncode}").splitlines()[-1]
        raise SlurmError(f"sbatch failed on {login.where}: {why}")
    return job_id


# A reader run on the login node: the job's state and what its logs gained since last time.
_POLL = r"""
import json, os, subprocess
a = json.loads(ARGS)
d = os.path.expanduser(a["run_dir"])
out = {"state": "", "reason": "", "exit": "", "nodes": "", "files": {}, "result": None, "error": ""}
def ask(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"{argv[0]}: {e}"
    # a job Slurm no longer knows is an answer, not an error
    bad = p.returncode != 0 and "Invalid job id" not in p.stderr
    return p.stdout, (f"{argv[0]}: " + (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]) if bad else ""
text, err1 = ask(["squeue", "-h", "-t", "all", "-j", a["job"], "-o", "%T|%r|%N"])
if text.strip():
    out["state"], out["reason"], out["nodes"] = (text.strip().splitlines()[0].split("|") + ["", ""])[:3]
text, err2 = ask(["scontrol", "show", "job", "-o", a["job"]])
if not out["state"] and err1 and err2:
    out["error"] = err1 + "; " + err2
for kv in text.split():
    k, _, v = kv.partition("=")
    if k == "ExitCode":
        out["exit"] = v
    elif k == "JobState" and not out["state"]:
        out["state"] = v
    elif k == "Reason" and not out["reason"]:
        out["reason"] = v
if not out["state"] and not out["error"]:
    # forgotten by slurmctld (MinJobAge): the accounting database, where there is one, still knows it
    try:
        p = subprocess.run(["sacct", "-X", "-n", "-P", "-j", a["job"], "-o", "State,ExitCode,NodeList"],
                           capture_output=True, text=True, timeout=30)
        row = p.stdout.strip().splitlines()[-1].split("|") if p.returncode == 0 and p.stdout.strip() else []
        if len(row) == 3:
            out["state"], out["exit"], out["nodes"] = row[0].split()[0], row[1], row[2]
    except (OSError, subprocess.TimeoutExpired):
        pass
names = [a["batch"]] + sorted("logs/" + f for f in os.listdir(os.path.join(d, "logs"))
                              if f.endswith(".log")) if os.path.isdir(os.path.join(d, "logs")) else [a["batch"]]
for name in names:
    off = a["offsets"].get(name, 0)
    try:
        with open(os.path.join(d, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if a["tail"]:
                off = max(0, size - a["max"])
            elif off > size:
                off = 0  # the file was truncated or replaced: read it again from its start
            f.seek(off)
            data = f.read(a["max"])
    except OSError:
        continue
    if a["tail"] and off > 0 and b"\n" in data:
        cut = data.index(b"\n") + 1  # the first line is cut: start at the next one
        off, data = off + cut, data[cut:]
    if not a["all"] and b"\n" in data:
        data = data[: data.rfind(b"\n") + 1]  # whole lines only, until the job has ended
    elif not a["all"] and len(data) < a["max"]:
        data = b""  # a line still being written (one longer than max goes out in pieces)
    out["files"][name] = [off, len(data), data.decode("utf-8", "replace")]
try:
    with open(os.path.join(d, "result.json")) as f:
        out["result"] = json.load(f)
    if out["result"].get("preflight"):  # the rows that failed the preflight step
        with open(os.path.join(d, a["preflight"])) as f:
            out["result"]["preflight_rows"] = [r for r in json.load(f)["rows"] if r["status"] == "fail"]
    if out["result"].get("fabric"):  # launch --fabric-check's report, when the step before training failed
        with open(os.path.join(d, a["fabric"])) as f:
            out["result"]["fabric_report"] = json.load(f)
    if out["result"].get("hang"):  # the hang watchdog's verdict, without every rank's dump
        with open(os.path.join(d, a["hang"])) as f:
            out["result"]["hang_report"] = {k: v for k, v in json.load(f).items() if k != "dumps"}
except (OSError, ValueError, KeyError, TypeError, AttributeError):
    pass
out["attempts"] = []  # one line per run of the job that ended (a requeue adds one)
try:
    with open(os.path.join(d, "attempts.jsonl")) as f:
        for line in f.read(1 << 20).splitlines():
            try:
                out["attempts"].append(json.loads(line))
            except ValueError:
                pass
except OSError:
    pass
try:  # launch.restarts: every attempt inside the allocation (slurm_failures.py on the batch node)
    with open(os.path.join(d, a["recovery"])) as f:
        out["recovery"] = json.load(f)
except (OSError, ValueError):
    out["recovery"] = None
try:  # the stall watch's reports (watch.py on the batch node)
    with open(os.path.join(d, a["stalls"])) as f:
        out["stalls"] = json.load(f)
except (OSError, ValueError):
    out["stalls"] = []
print(json.dumps(out))
"""


@dataclass
class Poll:
    state: str  # squeue/scontrol's long name, '' when Slurm no longer knows the job (or could not say)
    reason: str
    exit: str  # scontrol's ExitCode=code:signal
    nodes: str
    files: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # name -> (offset, bytes, text)
    result: dict[str, Any] | None = None  # the batch script's result.json: {exit, restart, signal, requeued}
    error: str = ""  # squeue and scontrol both failed: the state is not known (not: the job is gone)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # attempts.jsonl: each run of the job that ended
    recovery: dict[str, Any] | None = None  # attempts.json (launch.restarts): every attempt inside the allocation
    stalls: list[dict[str, Any]] = field(default_factory=list)  # stalls.json: the stall watch's reports

    @property
    def forgotten(self) -> bool:
        """Slurm answered and no longer knows the job (MinJobAge after its end)."""
        return not self.state and not self.error

    @property
    def settled(self) -> bool:
        """The batch script has ended and left its result, and Slurm is still completing the job:
        a node that no longer answers (a lost one) holds it in COMPLETING until Slurm sets that
        node down (SlurmdTimeout, 300 s by default). Nothing of the job runs on the others."""
        return self.state == "COMPLETING" and self.result is not None and not self.result.get("requeued")

    @property
    def ended(self) -> bool:
        """Nothing of the job runs any more: a final state, or forgotten with a final result."""
        if self.state in TERMINAL or self.settled:
            return True
        return self.forgotten  # Slurm never forgets a job that is still queued or requeued


def poll(login: Login, run_id: str, job_id: str, offsets: dict[str, int], max_bytes: int = READ_MAX,
         whole: bool = False, tail: bool = False) -> Poll:  # fmt: skip
    """The job's state and each log's bytes from ``offsets`` on (whole lines, unless ``whole``);
    ``tail``: each log's last ``max_bytes`` instead."""
    args = json.dumps({"run_dir": f"~/.nodeops/runs/{run_id}", "job": job_id, "offsets": offsets,
                       "batch": BATCH_LOG, "max": max_bytes, "all": whole, "tail": tail,
                       "preflight": PREFLIGHT_OUT, "hang": W.HANG, "fabric": FABRIC_REPORT,
                       "recovery": SF.ATTEMPTS, "stalls": W.STALLS})  # fmt: skip
    code = _POLL.replace("json.loads(ARGS)", f"json.loads({args!r})")
    p = login.run(f"python3 - <<'NODEOPS_POLL'\n{code}\nNODEOPS_POLL\n")
    if p.returncode != 0:
        raise SlurmError(f"cannot read job {job_id} on {login.where}: {(p.stderr.strip() or 'no output')[-300:]}")
    try:
        raw = json.loads(p.stdout.strip().splitlines()[-1])
        return Poll(state=raw["state"], reason=raw["reason"], exit=raw["exit"], nodes=raw["nodes"],
                    files={k: (int(v[0]), int(v[1]), str(v[2])) for k, v in raw["files"].items()},
                    result=raw["result"], error=raw["error"],
                    attempts=[a for a in raw.get("attempts") or [] if isinstance(a, dict)],
                    recovery=raw.get("recovery") if isinstance(raw.get("recovery"), dict) else None,
                    stalls=[s for s in raw.get("stalls") or [] if isinstance(s, dict)])  # fmt: skip
    except (ValueError, KeyError, IndexError, TypeError):
        raise SlurmError(f"cannot read job {job_id} on {login.where}: unexpected output "
                         f"{p.stdout.strip()[-200:]!r}") from None  # fmt: skip


def find_job(login: Login, run_id: str) -> str:
    """The id of this user's job whose comment names the run ('' when there is none)."""
    p = login.run(f"squeue --me -h -t all -o '%i %k' | grep -F -- {sh_word(' ' + COMMENT + run_id)} | head -n 1")
    head = p.stdout.split()[:1]
    return head[0] if head and head[0].isdigit() else ""


def cancel(login: Login, job_id: str, *, kill: bool = False) -> str:
    """scancel the job ('' when done); ``kill``: SIGKILL to every step and the batch shell."""
    flags = "--signal=KILL --full " if kill else ""
    p = login.run(f"scancel {flags}{sh_word(job_id)}")
    return "" if p.returncode == 0 else (p.stderr.strip() or f"exit {p.returncode}")


def wait_gone(login: Login, run_id: str, job_id: str, timeout: float) -> Poll:
    """Poll until the job is in a final state (or Slurm forgot it), at most ``timeout`` seconds.
    A poll that could not tell (squeue and scontrol failed) is never taken for "gone"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = poll(login, run_id, job_id, {}, max_bytes=0)
        except SlurmError as e:
            st = Poll(state="", reason="", exit="", nodes="", error=str(e))
        if st.state in TERMINAL or st.forgotten or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


# --------------------------------------------------------------------------- following and verdicts
def host_of(name: str) -> str:
    """The log file's host: ``logs/node2.log`` is node2's; the batch log is ``batch``'s."""
    return "batch" if name == BATCH_LOG else Path(name).stem


class Follower:
    """Reads a job's logs from where it left off, emitting each new line with its host, and keeps
    every host's last lines (for the failure report)."""

    def __init__(self, login: Login, run_id: str, job_id: str, emit: Callable[[str, str], None] | None) -> None:
        self.login, self.run_id, self.job_id, self.emit = login, run_id, job_id, emit
        self.offsets: dict[str, int] = {}
        self.tails: dict[str, deque[str]] = {}
        self.partial: dict[str, str] = {}  # a line a read ended inside of, until its end comes
        self.joined: dict[str, mpi_split.RankLines] = {}  # torchrun's tee can cut a rank's line in two

    def step(self, whole: bool = False) -> Poll:
        """One poll; with ``whole``, as many as it takes to reach the end of every log (a full
        read means more is there; a job that keeps writing cannot keep this going), and then
        the last line even without its newline."""
        st = self._step(whole)
        while whole and any(nbytes >= READ_MAX for _, nbytes, _ in st.files.values()):
            st = self._step(whole)
        if whole:
            for name, rest in sorted(self.partial.items()):
                if rest:
                    self._physical(name, rest)
            self.partial.clear()
            for name, joined in sorted(self.joined.items()):
                for line in joined.flush():
                    self._line(host_of(name), line)
        return st

    def _physical(self, name: str, line: str) -> None:
        for whole in self.joined.setdefault(name, mpi_split.RankLines()).feed(line):
            self._line(host_of(name), whole)

    def _line(self, host: str, line: str) -> None:
        self.tails.setdefault(host, deque(maxlen=failures.TAIL_LINES)).append(line)
        if self.emit is not None:
            self.emit(host, line)

    def _step(self, whole: bool) -> Poll:
        st = poll(self.login, self.run_id, self.job_id, self.offsets, whole=whole)
        for name, (off, nbytes, text) in sorted(st.files.items()):
            if off > self.offsets.get(name, 0):
                continue
            if off < self.offsets.get(name, 0):
                self.partial.pop(name, None)  # the file was truncated: it is read again from its start
                for line in self.joined.pop(name, mpi_split.RankLines()).flush():
                    self._line(host_of(name), line)
            self.offsets[name] = off + nbytes
            lines = (self.partial.pop(name, "") + text).split("\n")
            self.partial[name] = lines.pop()  # '' after a newline; else the start of a line
            for line in lines:
                self._physical(name, line.removesuffix("\r"))
        return st

    def until_end(self, interval: float = 0.5, on_poll: Callable[[Poll], None] | None = None,
                  patience: float = 60) -> Poll:  # fmt: skip
        """Follow until the job has ended (or Slurm forgot it); then read what is left of every
        log. Polls that fail (ssh, or squeue and scontrol) are retried for ``patience`` seconds,
        then SlurmError says the job may still run."""
        failing_since: float | None = None
        while True:
            try:
                st = self.step()
                problem = st.error
            except SlurmError as e:
                problem = str(e)
            if problem:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > patience:
                    raise SlurmError(f"{problem} (for {patience:.0f}s); job {self.job_id} may still be running")
            else:
                failing_since = None
                if on_poll is not None:
                    on_poll(st)
                if st.ended:
                    break
            time.sleep(interval)
        try:
            final = self.step(whole=True)
        except SlurmError:  # the job has ended: its verdict stands without the last lines
            return st
        return final if final.state or final.forgotten else st


def outcome(st: Poll) -> str:
    """ok, stopped (cancelled), hung (the hang watchdog ended it) or failed: a finished job's
    outcome, as a run's verdict says it."""
    if st.state == "COMPLETED" or ((st.forgotten or st.settled) and (st.result or {}).get("exit") == 0):
        return "ok"
    if st.state == "CANCELLED":
        return "stopped"
    return "hung" if hang_of(st) is not None else "failed"


# Final states whose ranks may all have ended their script (a signal handler's checkpoint, then
# sys.exit) without any crash: never "finished, then crashed in teardown"
NOT_A_CRASH = ("TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE", "OUT_OF_MEMORY", "BOOT_FAIL", "CANCELLED")


def teardown(st: Poll) -> bool:
    """Whether a failed job had finished its work: every rank of its last training step ended
    its script before one crashed in its teardown (recovery.finished_then_crashed). With
    launch.restarts, the last attempt's kind (the restart rules judged it); else the batch
    driver's count in result.json (``finished``), for a failure that was no lost node and no hang."""
    if outcome(st) != "failed":
        return False
    attempts = [a for a in (st.recovery or {}).get("attempts") or [] if isinstance(a, dict)]
    if attempts:
        return attempts[-1].get("kind") == "teardown"
    res = st.result or {}
    counts = res.get("finished")
    if res.get("lost") or res.get("signal") or st.state in NOT_A_CRASH or not isinstance(counts, dict) or not counts:
        return False  # a lost node, the time-limit signal, a preemption: the ranks ended on them
    pairs = [(v[0], v[1]) if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) else None
             for v in counts.values()]  # fmt: skip
    return R.finished_then_crashed("script", pairs)


def exit_code(st: Poll, batch_lines: Sequence[str] = (), tails: Tails | None = None) -> int:
    """What `nodeops launch` exits with for a finished job (failures.exit_code_for): for a
    failure, the first failing task's code (srun's own exit is often 143 from stopping the others),
    or failures.TEARDOWN_EXIT when every rank had finished its work first (:func:`teardown`)."""
    if outcome(st) != "failed":
        return failures.exit_code_for(outcome(st)) or 0
    if teardown(st):
        return failures.exit_code_for("failed", kind="teardown") or 1
    first = first_failure(batch_lines, tails)
    code = first[1] if first else st.result.get("exit") if st.result else None
    if not isinstance(code, int):
        head = st.exit.partition(":")[0]
        code = int(head) if head.isdigit() else 1
    return failures.exit_code_for("failed", code) or 1


def preflight_failure(st: Poll) -> str:
    """'' unless the job ended in its preflight step; then which node failed which check."""
    if not st.result or not st.result.get("preflight"):
        return ""
    if st.result.get("preflight") == "error":
        return (f"the preflight step itself failed (exit {st.result.get('exit')}; python3 on the batch node? "
                "its error is in the batch log); no training rank was started")  # fmt: skip
    rows = st.result.get("preflight_rows") or []
    hosts = ", ".join(dict.fromkeys(str(r.get("host")) for r in rows)) or "a node (no rows were kept)"
    first = rows[0] if rows else {}
    what = f" ({first.get('check')}: {first.get('detail')})" if first else ""
    return f"the preflight failed on {hosts}{what}; no training rank was started"


def fabric_failure(st: Poll) -> str:
    """'' unless launch --fabric-check's step ended the job; then what it found."""
    if not st.result or not st.result.get("fabric"):
        return ""
    if st.result.get("fabric") == "error":
        step, gate = st.result.get("fabric_step"), st.result.get("fabric_gate")
        why = (
            f"its srun step exited {step}"
            if step not in (0, None)
            else f"the gate on the batch node exited {gate}"
            if gate not in (0, None)
            else "no report was written"
        )
        return (f"the fabric check before training gave no verdict ({why}; the batch and node logs say more); "
                "no training rank was started")  # fmt: skip
    report = st.result.get("fabric_report")
    problems = report.get("problems") if isinstance(report, dict) else None
    what = "; ".join(str(p) for p in problems) if problems else "its report could not be read"
    return f"the fabric check before training failed ({what}); no training rank was started"


def hang_of(st: Poll) -> dict[str, Any] | None:
    """The hang watchdog's report when it ended the job (and no requeue followed), else None."""
    res = st.result or {}
    if not res.get("hang") or res.get("requeued"):
        return None
    report = res.get("hang_report")
    return report if isinstance(report, dict) else {}


def fault_of(st: Poll) -> dict[str, Any] | None:
    """What the batch node named as the fault of the job's last training step, where it named
    one: a lost node (its heartbeats stopped), the hang watchdog's suspect, or with
    launch.restarts the last attempt's culprit (``first_failure``'s form: host, kind, why)."""
    res = st.result or {}
    lost = res.get("lost")
    if isinstance(lost, dict) and lost.get("node"):
        return {"host": str(lost["node"]), "code": None, "kind": "lost", "why": str(lost.get("why") or "lost")}
    hang = hang_of(st)
    if hang is not None:
        return {"host": str(hang.get("host") or ""), "code": None, "kind": "hang", "why": str(hang.get("why") or "")}
    attempts = [a for a in (st.recovery or {}).get("attempts") or [] if isinstance(a, dict)]
    if attempts and attempts[-1].get("culprit"):
        a = attempts[-1]
        return {"host": str(a["culprit"]), "code": None, "kind": str(a.get("kind") or ""), "why": str(a.get("why"))}
    return None


def timeline_result(st: Poll, first: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's timeline in the ssh supervisor's form, for ``store.timeline``: every attempt
    inside the allocation with its times (attempts.json, launch.restarts), else the job's one
    training step (result.json's ``times``) with its fault (:func:`fault_of`, else ``first``:
    the node whose failure the logs named). {} when the batch driver recorded none (an older
    release's job, runner mpirun, a job that ended before training)."""
    stalls = {"stalls": st.stalls} if st.stalls else {}
    attempts = [a for a in (st.recovery or {}).get("attempts") or [] if isinstance(a, dict)]
    if attempts:
        return {"attempts": attempts, **stalls}
    times = (st.result or {}).get("times")
    if not isinstance(times, dict) or not times:
        return stalls
    fault = fault_of(st)
    if fault is None and first is not None and first.get("host"):
        fault = dict(first, kind=first.get("kind") or R.kind_of_exit(first.get("code")))
    return {"times": times, "first_failure": fault, **stalls}


def attempt_lines(st: Poll) -> list[str]:
    """Each run of the job (attempts.jsonl: a line when it begins, one when it ends), once it
    was requeued; else []."""
    runs: dict[int, dict[str, Any]] = {}
    for a in st.attempts:
        if isinstance(a.get("attempt"), int):
            runs[a["attempt"]] = a  # its last line: the result, when it wrote one
    if len(runs) < 2 and not any((a.get("result") or {}).get("requeued") for a in runs.values()):
        return []
    out = []
    for n, a in sorted(runs.items()):
        res = a.get("result")
        r: dict[str, Any] = res if isinstance(res, dict) else {}
        if not r:
            last = n == max(runs)
            state = f": {st.state}" if last and st.state else ""
            how = ["running"] if last and st.state in LIVE else [f"ended with no result (Slurm ended it{state})"]
        else:
            how = [f"exit {r.get('exit')}"]
            how += [f"got {r['signal']}"] if r.get("signal") else []
            how += ["the hang watchdog stopped it"] if r.get("hang") else []
            how += [f"preflight {r['preflight']}"] if r.get("preflight") else []
            how += [f"fabric check {r['fabric']}"] if r.get("fabric") else []
            how.append("requeued" if r.get("requeued") else "not requeued")
        out.append(f"attempt {n} on {a.get('nodes')}: {', '.join(how)}")
    return out


def restart_lines(st: Poll) -> list[str]:
    """launch.restarts: each attempt inside the allocation in a line, once there was a restart
    or a decision (recovery.summary); else []."""
    rec = st.recovery or {}
    attempts = [a for a in rec.get("attempts") or [] if isinstance(a, dict)]
    try:
        total = int(rec.get("total") or len(attempts))
    except (TypeError, ValueError):
        total = len(attempts)
    return R.summary(attempts, total)


def describe(st: Poll) -> str:
    pre = preflight_failure(st) or fabric_failure(st)
    if pre:
        return f"{st.state or 'ended'}: {pre}"
    if st.error and not st.state:
        return f"state unknown ({st.error})"
    hang = hang_of(st)
    if hang is not None:
        suspect = f"; suspect node {hang['host']}" if hang.get("host") else ""
        return f"{st.state or 'ended'}: {hang.get('why') or 'the hang watchdog stopped it'}{suspect}"
    if not st.state:
        if st.result is not None:
            return f"ended (exit {st.result.get('exit')}; Slurm has forgotten it since)"
        return "unknown to Slurm now (it forgets jobs MinJobAge after they end)"
    if st.settled:
        code = (st.result or {}).get("exit")
        return f"ended (exit {code}); Slurm is still completing it on {st.nodes or 'its nodes'}"
    out = st.state
    if st.state == "PENDING" and st.reason not in ("", "None"):
        out += f" ({st.reason})"
    elif st.state not in ("COMPLETED", "RUNNING", "PENDING") and st.exit and st.exit != "0:0":
        out += f" (ExitCode {st.exit})"
    if st.nodes and st.state != "PENDING":
        out += f" on {st.nodes}"
    return out
