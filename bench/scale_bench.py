#!/usr/bin/env python3
"""Benchmark: how setup, check and launch scale with the number of sandbox nodes.

For each N (default 1 4 8 16 32) a sandbox of N sshd containers is started and the same
spec is used throughout (a wheelhouse package, a workdir, env vars, ib off):

- cold setup: the first `nodeops setup` (venv, package install, workdir copy, env files);
- no-op setup: the second one, which must report 0 changes (the fast path: one read-only probe
  per node, no Ansible play);
- no-op, --full: the same no-op with `setup --full`, which runs every role through Ansible (what
  a no-op setup cost before the fast path), measured in the same run as the baseline;
- check: `nodeops check` (the full-mesh preflight);
- the launch rows, from one torch env shared read-only by every node (built once from the torch
  wheelhouse in a throwaway node container, bind-mounted at /opt/nodeops-shared/env; the spec
  points at it with the ssh group's `python_venv`, as a cluster's shared filesystem would hold
  it), so no node installs torch:
  - launch, pdsh: the same torchrun command fanned out with `pdsh -R ssh -f N` (DeepSpeed's PDSH
    runner's way: same ssh_config, env file and env), measured in the same run, alternating. It
    runs torchrun with the output settings of nodeops' job.sh (PET_TEE=3 and its line prefix,
    PYTHONUNBUFFERED=1): torchrun's tee polls every rank's log files every 0.1 s, which at 64
    sandbox nodes cost torchrun ~11 CPU s, so a baseline without it is not the same command;
  - launch, pdsh, plain torchrun: the same without those settings (each rank's output straight
    to torchrun's), for reference;
  - launch: `nodeops launch --no-check` of a trivial gloo job (init, barrier, exit);
  - stacks: `nodeops stacks --json` of a detached run whose every rank is alive (counted in the
    containers), and how many ranks it returned; "stacks, pdsh": the same ranks' `py-spy dump
    --json` fanned out by pdsh, just before;
  - stop: `nodeops stop`, then how long until no process of the run is left on any node, read
    from the host's /proc by the containers' cgroups, and confirmed with `docker exec ps`;
    "stop, pdsh TERM": an idle torchrun started on every node by pdsh, and pdsh sending every
    torchrun SIGTERM (which torchrun passes on to its ranks), timed the same way; "stop, pdsh
    KILL": the same with SIGKILL to torchrun and its ranks at once (no shutdown: the floor);
  - failure: rank N-1 exits 1 mid-training; seconds until no rank is left anywhere. "failure,
    pdsh": the same script started by pdsh, where nothing but the other ranks' own failing
    collective (gloo's connection to the dead rank closing) and torchrun end them (at 64
    sandbox nodes they were still running after the row's 60 s: the row then kills them and
    says how many were left);
  The stacks, stop and failure rows run ``--teardown-runs`` times each, alternating with their
  pdsh baseline (lower medians); ``--launch-runs 0`` leaves the launch vs pdsh rows out.
  On 2 cores shared by every node the baselines show what the machine allows: at 64 nodes the
  nodes' own teardown (torchrun's and the ranks' exits) is several CPU seconds.
  Without a torch wheelhouse (.cache/wheelhouse-torch, or --torch-wheelhouse) they are "not run".

Each nodeops step is sampled (bench/_cost.py) for what it costs per node: the controller's ssh
connections into the sandbox and open files (its process tree and its ssh masters), the chief's
(node1's container) open files, ssh connections and CPU seconds.

Each step reports wall seconds and the controller's own CPU seconds (user+sys of every
process the step started on this machine, ansible and ssh included) per node. The nodes
share this machine's cores, so wall time at large N also measures the nodes' own work; the
controller CPU per node is what grows on a real cluster. Ratios are printed against the
1-node row and checked against issues 12 and 29's goals:

- no-op setup at 1 node <= 5 s; at 4 nodes <= 8 s; at 16 nodes <= 2x the 1-node time;
- cold setup at 8 nodes <= 2x the 1-node time;
- no-op setup <= 1.25x check at every N (a setup with nothing to do costs about one preflight).

    python bench/scale_bench.py [--nodes 1 4 8 16 32] [--torch-wheelhouse DIR] [--skip STEP ...]
        [--chief-weight 1|n|W] [--name scale] [--subnet 10.218.0.0/24] [--json-out FILE]

The sandbox's containers share this machine's cores: under load the chief, which alone runs the
supervisor and its link to every host, gets 1/N of them. ``--chief-weight n`` gives the chief's
container N times every other node's CPU weight, as if it had its own machine (the launch rows
only; run it beside the default to see how much of a row is the sandbox's).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _bench import WHEELS  # noqa: E402  (bench/, beside this script)
from _cost import Cost, Sampler, container_cmdlines, cpu_seconds, mem_available_gib  # noqa: E402

from nodeops.launch.plan import TEE_ENV  # noqa: E402
from nodeops.quoting import sh_word  # noqa: E402
from nodeops.sandbox import cluster as sandbox  # noqa: E402
from nodeops.spec.loading import load_spec  # noqa: E402

NAME = "scale"
SUBNET = "10.218.0.0/24"
NODEOPS = [sys.executable, "-m", "nodeops"]
FULL = "no-op, --full"
SETUP_STEPS = ["cold setup", "no-op setup", FULL, "check"]
PLAIN = "launch, pdsh, plain torchrun"
LAUNCH_STEPS = [
    "launch, pdsh",
    PLAIN,
    "launch",
    "stacks, pdsh",
    "stacks",
    "stop, pdsh TERM",
    "stop, pdsh KILL",
    "stop",
    "failure, pdsh",
    "failure",
]
FAILED_MARKER = "/tmp/nodeops-scale-failed"  # where the failing rank writes when it failed
FAILURE_WAIT = 60.0  # the failure rows wait this long for every rank to end
MAX_CHIEF_WEIGHT = 256  # docker's cpu-shares go up to 262144 (256 x the default 1024)
SHARED = "/opt/nodeops-shared"  # where every node sees the shared env (read-only)
TRIVIAL = "import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\nd.destroy_process_group()\n"
IDLE = "import time\nimport torch.distributed as d\nd.init_process_group('gloo')\nwhile True:\n    time.sleep(0.5)\n"
FAIL = """import sys, time
import torch, torch.distributed as d
d.init_process_group('gloo')
t = torch.ones(1)
for step in range(100000):
    if d.get_rank() == int(sys.argv[1]) and step == 10:
        open(sys.argv[2], 'w').write(repr(time.time()))
        sys.exit(1)
    d.all_reduce(t)
    time.sleep(0.05)
"""
# every process of a run on a node: the ranks, torchrun, nodeops' agents, supervisor, guards, ssh
LEFTOVER = re.compile(r"agent\.py|supervisor\.py|watch\.py|wait\.sh|follow\.sh|kill\.sh|job\.sh|tail -n|"
                      r"grep -m1|fail\.py|idle\.py|trivial\.py|torch\.distributed\.run|(^|\s)ssh\s")  # fmt: skip
RANK = re.compile(r"python3? (-u )?(fail|idle)\.py")


@dataclass
class Step:
    wall: float
    cpu: float
    rc: int
    tail: str
    stdout: str = ""
    stderr: str = ""
    cost: Cost | None = None


@dataclass
class Bench:
    """One sandbox's bench context: what every step needs to run and be sampled."""

    sb: sandbox.Sandbox
    subnet: str
    ids: list[str]  # the nodes' container ids, node1 (the chief) first
    env: dict[str, str]

    def timed(self, argv: list[str], env: dict[str, str] | None = None) -> Step:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or self.env)
        with Sampler(p.pid, self.subnet, self.ids[0]) as sampler:
            out, err = p.communicate()
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        lines = (out + err).strip().splitlines()
        return Step(wall, cpu, p.returncode, lines[-1] if lines else "", out, err, sampler.cost)

    def alive(self, pattern: re.Pattern[str]) -> int:
        """Processes matching ``pattern`` on every node, read from the host (cheap enough to poll)."""
        return sum(1 for i in self.ids for line in container_cmdlines(i) if pattern.search(line))

    def left_by_ps(self) -> dict[str, int]:
        """The run's processes still on each node, as `docker exec NODE ps -eo args` lists them."""

        def one(n: sandbox.NodeInfo) -> tuple[str, int]:
            ps = subprocess.run(["docker", "exec", n.container, "ps", "-eo", "args"], capture_output=True,
                                text=True, check=False).stdout.splitlines()  # fmt: skip
            return n.name, sum(1 for line in ps if LEFTOVER.search(line))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return {k: v for k, v in pool.map(one, self.sb.nodes) if v}

    def wait_quiet(self, cores: float, seconds: float) -> float:
        """Wait until every node together uses under ``cores`` CPUs (over 2 s), at most ``seconds``:
        how long it waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            before = sum(cpu_seconds(i) for i in self.ids)
            time.sleep(2)
            if sum(cpu_seconds(i) for i in self.ids) - before < 2 * cores:
                break
        return time.monotonic() - t0

    def wait_for(self, pattern: re.Pattern[str], count: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.alive(pattern) >= count:
                return True
            time.sleep(0.2)
        return False


def check_verdict(step: Step, torch: bool) -> tuple[int, str]:
    """check's own verdict, except that without torch in the env (the default here: a small
    wheel) its torch rows fail by design; any other failing row is a failure."""
    try:
        doc = json.loads(step.stdout)
    except json.JSONDecodeError:
        return step.rc, step.tail
    failing = Counter(r["check"] for rows in doc["hosts"].values() for r in rows if r["status"] == "fail")
    other = {k: v for k, v in failing.items() if torch or k != "torch"}
    text = ", ".join(f"{k} x{v}" for k, v in failing.items()) or "none"
    return (1 if other else 0), f"failing rows: {text}" + ("" if torch else " (torch is expected: not installed)")


def make_project(work: Path) -> Path:
    (work / "project").mkdir()
    (work / "project" / "train.py").write_text(
        "import os\nprint('rank', os.environ.get('RANK'), 'of', os.environ.get('WORLD_SIZE'))\n"
    )
    for name, text in (("trivial.py", TRIVIAL), ("idle.py", IDLE), ("fail.py", FAIL)):
        (work / "project" / name).write_text(text)
    (work / "project" / "lib").mkdir()
    for i in range(20):
        (work / "project" / "lib" / f"m{i}.py").write_text(f"X = {i}\n" * 50)
    make_wheel = ROOT / "roles/python_env/molecule/default/make_wheel.py"
    subprocess.run([sys.executable, str(make_wheel), str(work / "wheels")], check=True, capture_output=True)
    return work / "wheels"


def shared_env(torch_wheels: Path, say: sandbox.Say) -> Path:
    """A venv with torch, numpy and py-spy, built once (cached in .cache/, keyed by the wheels) in
    a throwaway node container, so it runs on the nodes' Python; the dir holding it is what
    every node mounts read-only at SHARED."""
    key = hashlib.sha256(" ".join(sorted(p.name for p in torch_wheels.glob("*.whl"))).encode()).hexdigest()[:12]
    host_dir = ROOT / ".cache" / f"shared-env-{key}"
    if (host_dir / "complete").is_file():
        return host_dir
    image = sandbox.ensure_image(None, "auto", say)
    say(f"building the shared torch env in {host_dir} (once)")
    host_dir.mkdir(parents=True, exist_ok=True)
    script = (
        f"set -e; rm -rf {SHARED}/env; python3 -m venv --without-pip {SHARED}/env; "
        'python3 -c \'import glob, zipfile; z = zipfile.ZipFile(glob.glob("/wheels/uv-*.whl")[0]); '
        'n = [x for x in z.namelist() if x.endswith("/scripts/uv")][0]; open("/tmp/uv", "wb").write(z.read(n))\'; '
        f"chmod +x /tmp/uv; /tmp/uv pip install -q --compile-bytecode --python {SHARED}/env/bin/python "
        "--no-index --find-links /wheels 'torch==2.13.0' numpy py-spy; "
        f"{SHARED}/env/bin/python -c 'import torch'; touch {SHARED}/complete"
    )
    builder = f"nodeops-scale-env-{os.getpid()}"
    try:
        sandbox.docker("run", "--name", builder, "--label", f"{sandbox.LABEL}.build=1",
                       "-v", f"{host_dir}:{SHARED}", "-v", f"{torch_wheels}:/wheels:ro",
                       image, "sh", "-c", script, timeout=900)  # fmt: skip
    finally:
        sandbox.docker("rm", "-f", builder, check=False)
    return host_dir


def spec_for(sb: sandbox.Sandbox, work: Path, wheels: Path) -> Path:
    spec = work / f"cluster-{len(sb.nodes)}.yaml"
    spec.write_text(sb.spec_path.read_text() + (
        "env: {OMP_NUM_THREADS: 1}\n"
        # py_spy: false: the bench's wheelhouse has no py-spy, and a tool setup could not install
        # is tried again by every setup (python_env runs): the bench measures a converged cluster
        f"python: {{packages: [nodeops-probe==1.0], wheelhouse: {wheels}, py_spy: false}}\n"
        f"workdir: {{path: /srv/scale, source: {work / 'project'}}}\n"
        "network: {ib: 'off'}\n"
    ))  # fmt: skip
    return spec


def launch_spec_for(sb: sandbox.Sandbox, work: Path) -> Path:
    """The same cluster and workdir, its Python the shared env (the ssh group's python_venv)."""
    spec = work / f"cluster-{len(sb.nodes)}-launch.yaml"
    text = sb.spec_path.read_text().replace(
        "\n  sandbox:\n", f"\n  sandbox:\n    python_venv: source {SHARED}/env/bin/activate\n"
    )
    spec.write_text(text + (
        "env: {OMP_NUM_THREADS: 1}\n"
        f"workdir: {{path: /srv/scale, source: {work / 'project'}}}\n"
        "network: {ib: 'off'}\n"
    ))  # fmt: skip
    return spec


def say_step(say: sandbox.Say, label: str, s: Step) -> None:
    c = s.cost
    cost = "" if c is None else (f"; peaks: controller {c.ctl_ssh} ssh, {c.ctl_fds} fds (at most {c.ctl_fds_max} in "
                                 f"one process), {c.ctl_procs} procs; chief {c.chief_ssh_in} ssh in, "
                                 f"{c.chief_ssh_out} out, {c.chief_fds} fds, {c.chief_cpu:.1f}s CPU; "
                                 f"min MemAvailable {c.mem_avail_min_gib:.1f} GiB")  # fmt: skip
    say(f"{label}: {s.wall:.2f}s wall, {s.cpu:.1f}s controller CPU, rc={s.rc}: {s.tail}{cost}")


def setup_rows(b: Bench, spec: Path, skip: set[str], say: sandbox.Say) -> dict[str, Step | None]:
    out: dict[str, Step | None] = {}
    steps = [
        ("cold setup", [*NODEOPS, "setup", str(spec)]),
        ("no-op setup", [*NODEOPS, "setup", str(spec)]),
        (FULL, [*NODEOPS, "setup", str(spec), "--full"]),
        ("check", [*NODEOPS, "check", str(spec), "--json"]),
    ]
    for label, argv in steps:
        if label in skip:
            out[label] = None
            continue
        say(label)
        out[label] = s = b.timed(argv)
        if label == "check":
            s.rc, s.tail = check_verdict(s, False)
        say_step(say, label, s)
        # why a setup ran Ansible where the fast path had nothing to do, and the probe's notes
        for line in s.stderr.splitlines() if label != "check" else ():
            if line.startswith(("note:", "warning:", "    ")) and "setup --full" not in line:
                say(f"  {line.strip()}")
    return out


def pdsh_env(b: Bench, work: Path) -> dict[str, str]:
    """pdsh over ssh with the sandbox's ssh_config (strict host keys, ControlMaster)."""
    cfg = work / "ssh_config"
    cfg.write_text(b.sb.ssh_config.read_text())
    return {**b.env, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS": f"-F {cfg} -x %h"}


def pdsh_on_all(b: Bench, remote: str) -> list[str]:
    """``remote`` on every node at once (fan-out N), each line prefixed with its node."""
    return ["pdsh", "-S", "-f", str(len(b.sb.nodes)), "-w", ",".join(nd.name for nd in b.sb.nodes), remote]


def pdsh_argv(b: Bench, spec: Path, work: Path, tee: bool = True, script: str = "trivial.py",
              args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The launch's torchrun command on every node at once with pdsh, as DeepSpeed's PDSH runner
    does: the same ssh_config (strict host keys, ControlMaster), env file and shared env. ``tee``:
    with the output settings of nodeops' job.sh (launch.plan.TEE_ENV, PYTHONUNBUFFERED=1), the
    ranks' log files in a directory of the run's own, removed after it."""
    n = len(b.sb.nodes)
    torchrun = (
        f"python3 -m torch.distributed.run --nnodes {n} --nproc-per-node 1 --node-rank %n "
        f"--master-addr {b.sb.nodes[0].address} --master-port 29500 " + " ".join(sh_word(a) for a in (script, *args))
    )
    if tee:
        exports = " ".join(f"{k}={sh_word(v)}" for k, v in {**TEE_ENV, "PYTHONUNBUFFERED": "1"}.items())
        torchrun = (f'logs=$(mktemp -d) && export PET_LOG_DIR="$logs" {exports} && {{ {torchrun}; rc=$?; '
                    'rm -rf "$logs"; exit $rc; }')  # fmt: skip
    remote = f"cd /srv/scale && . ~/.nodeops/{load_spec(spec).cluster_name}/env.sh && . {SHARED}/env/bin/activate && "
    return pdsh_on_all(b, remote + torchrun), pdsh_env(b, work)


def launch_rows(b: Bench, spec: Path, work: Path, runs: int, teardown_runs: int,
                say: sandbox.Say) -> dict[str, Step | None]:  # fmt: skip
    n = len(b.sb.nodes)
    pdsh, pdsh_env = pdsh_argv(b, spec, work)
    plain, _ = pdsh_argv(b, spec, work, tee=False)
    launch = [*NODEOPS, "launch", str(spec), "--no-check", "--", "trivial.py"]
    tries: dict[str, list[Step]] = {k: [] for k in LAUNCH_STEPS}
    for i in range(runs):  # alternating, so all see the same page cache and ssh masters
        for label, argv, env in (("launch, pdsh", pdsh, pdsh_env), (PLAIN, plain, pdsh_env), ("launch", launch, None)):
            s = b.timed(argv, env)
            tries[label].append(s)
            say_step(say, f"{label} (run {i + 1})", s)
    # stacks, stop and a failure, each beside the same thing done with pdsh (the baseline: what
    # the sandbox's shared cores allow), alternating run by run
    for i in range(teardown_runs):
        say(f"stacks, stop and a failure (run {i + 1} of {teardown_runs})")
        by_pdsh, ours = stacks_rows(b, spec, work, n, say)
        tries["stacks, pdsh"].append(by_pdsh)
        tries["stacks"].append(ours)
        tries["stop"].append(stop_row(b, spec, say))
        for sig in ("TERM", "KILL"):
            tries[f"stop, pdsh {sig}"].append(pdsh_stop_row(b, spec, work, n, sig, say))
        tries["failure"].append(failure_row(b, [*NODEOPS, "launch", str(spec), "--no-check", "--"], None, n, say))
        argv, env = pdsh_argv(b, spec, work, script="fail.py", args=(str(n - 1), FAILED_MARKER))
        tries["failure, pdsh"].append(failure_row(b, argv, env, n, say, label="failure, pdsh"))
    return {k: median(v) for k, v in tries.items()}


def median(steps: list[Step]) -> Step | None:
    """The lower median by wall time; a failed try counts as failed (the row says so)."""
    if not steps:
        return None
    failed = [s for s in steps if s.rc != 0]
    return failed[0] if failed else sorted(steps, key=lambda s: s.wall)[(len(steps) - 1) // 2]


def start_idle(b: Bench, n: int) -> tuple[float, str]:
    """Wait for an idle run just started to have a rank on every node, then for the nodes to
    be quiet (the ranks import torch and meet: a minute of both cores at 64 nodes; a stuck run is
    idle): (seconds it waited for quiet, "") or (0, why it never had every rank)."""
    if not b.wait_for(RANK, n, 300):
        return 0, f"the idle run never had {n} ranks ({b.alive(RANK)} seen)"
    return b.wait_quiet(0.5 + 0.01 * n, 240), ""


def stacks_rows(b: Bench, spec: Path, work: Path, n: int, say: sandbox.Say) -> tuple[Step, Step]:
    """A detached idle run (which the stop row then stops); its ranks' stacks by pdsh fanning out
    `py-spy dump` on every node (the baseline), then by `nodeops stacks`."""
    start = b.timed([*NODEOPS, "launch", str(spec), "--no-check", "--detach", "--", "idle.py"])
    settled, why = start_idle(b, n) if start.rc == 0 else (0, start.tail or f"launch rc={start.rc}")
    if why:
        bad = dataclasses.replace(start, rc=start.rc or 1, tail=why)
        return bad, bad
    dump = (f"for p in $(pgrep -f 'python3? (-u )?idle[.]py'); do {SHARED}/env/bin/py-spy dump --pid $p --json "
            '&& echo "dumped $p"; done')  # fmt: skip
    env = pdsh_env(b, work)
    # every node's ssh master up first, as the supervisor's links to the guards are
    subprocess.run(pdsh_on_all(b, "true"), env=env, capture_output=True, check=False)
    by_pdsh = b.timed(pdsh_on_all(b, dump), env)
    got = by_pdsh.stdout.count(" dumped ")
    by_pdsh.tail = f"{got} of {n} ranks' stacks by pdsh and py-spy"
    by_pdsh.rc = by_pdsh.rc or (0 if got == n else 1)
    say_step(say, "stacks, pdsh", by_pdsh)
    s = b.timed([*NODEOPS, "stacks", str(spec), "--json"])
    try:
        doc = json.loads(s.stdout)
        ranks = len(doc.get("ranks") or []) or sum(len(g.get("ranks", [])) for g in doc.get("groups", []))
        s.tail = f"{ranks} of {n} ranks' stacks ({settled:.0f} s after the ranks started, once the nodes were quiet)"
        s.rc = s.rc or (0 if ranks == n else 1)
    except json.JSONDecodeError:
        s.rc = s.rc or 1
    say_step(say, "stacks", s)
    return by_pdsh, s


def until_nothing_left(b: Bench, t0: float, ended: Callable[[], bool] = lambda: True) -> tuple[float, dict[str, int]]:
    """Seconds from ``t0`` until no process of the run is left on any node (and ``ended``), read
    from the host's /proc (at most 60 s), then what `docker exec ps` still lists."""
    while (b.alive(LEFTOVER) or not ended()) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    return time.monotonic() - t0, b.left_by_ps()


def stop_row(b: Bench, spec: Path, say: sandbox.Say) -> Step:
    t0 = time.monotonic()
    s = b.timed([*NODEOPS, "stop", str(spec)])
    gone, left = until_nothing_left(b, t0)
    s.tail = f"nothing left {gone:.2f}s after stop began; docker exec ps: {left or 'nothing'} left"
    s.rc = s.rc or (1 if left else 0)
    say_step(say, "stop", s)
    s.wall = gone
    return s


def pdsh_stop_row(b: Bench, spec: Path, work: Path, n: int, sig: str, say: sandbox.Say) -> Step:
    """The baselines of the stop row: an idle torchrun started on every node by pdsh, stopped by
    pdsh sending on every node SIGTERM to torchrun (``sig`` TERM: which passes it on to its ranks,
    as a user's `pdsh pkill` would), or SIGKILL to torchrun and its ranks at once (KILL: no
    shutdown at all, the floor of a teardown here); seconds from the kill's start until nothing of
    the run is left on any node and pdsh has ended."""
    argv, env = pdsh_argv(b, spec, work, script="idle.py")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, why = start_idle(b, n)
        if why:
            s = Step(0, 0, 1, why)
        else:
            t0 = time.monotonic()
            # the brackets keep pkill from matching the remote shell that runs it
            # (anchored at the interpreter: not the wrapper shell, whose command line holds both)
            what = "-m torch[.]distributed[.]run" + ("|(-u )?idle[.]py" if sig == "KILL" else "")
            s = b.timed(pdsh_on_all(b, f"pkill -{sig} -f '^[^ ]*python3? ({what})'"), env)
            gone, left = until_nothing_left(b, t0, lambda: proc.poll() is not None)
            s.tail = f"nothing left {gone:.2f}s after pdsh's kill began; docker exec ps: {left or 'nothing'} left"
            s.rc = 1 if left or proc.poll() is None else 0  # pkill's own rc: 1 where nothing matched
            s.wall = gone
    finally:
        end_pdsh_run(b, proc, env)
    say_step(say, f"stop, pdsh {sig}", s)
    return s


def end_pdsh_run(b: Bench, proc: subprocess.Popen[Any], env: dict[str, str]) -> None:
    """Whatever a pdsh run left, on the nodes and here (a row that failed midway)."""
    with contextlib.suppress(ProcessLookupError):  # pdsh's group: its ssh children too, even once pdsh ended
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if b.alive(LEFTOVER):
        subprocess.run(pdsh_on_all(b, "pkill -KILL -f 'torch[.]distributed[.]run|(idle|fail)[.]py'"), env=env,
                       capture_output=True, check=False)  # fmt: skip


def failure_row(b: Bench, argv: list[str], env: dict[str, str] | None, n: int, say: sandbox.Say,
                label: str = "failure") -> Step:  # fmt: skip
    """Rank n-1 exits 1 at its 10th step; seconds from its failure until no rank is left anywhere.
    ``argv`` is a launch command to which the script is added (nodeops), or the whole command
    (pdsh, the baseline: nothing stops the others there but their own collective failing)."""
    last = b.sb.nodes[-1]
    if argv[-1] == "--":
        argv = [*argv, "fail.py", str(n - 1), FAILED_MARKER]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env or b.env,
                            start_new_session=env is not None)  # fmt: skip
    try:
        failed_at = None
        deadline = time.monotonic() + 600
        while failed_at is None and time.monotonic() < deadline and proc.poll() is None:
            got = subprocess.run(["docker", "exec", last.container, "cat", FAILED_MARKER], capture_output=True,
                                 text=True, check=False).stdout.strip()  # fmt: skip
            failed_at = float(got) if got else None
            time.sleep(0.1)
        if failed_at is None:
            if env is not None:
                end_pdsh_run(b, proc, env)
            else:
                proc.kill()
            err = proc.communicate()[1]
            why = " ".join(err.strip().splitlines()[-2:])
            s = Step(0, 0, 1, f"rank {n - 1} never failed; launch rc={proc.returncode}: {why}")
            say_step(say, label, s)
            return s
        while b.alive(RANK) and time.time() - failed_at < FAILURE_WAIT:
            time.sleep(0.05)
        latency = time.time() - failed_at
        if env is not None and latency >= FAILURE_WAIT:  # the baseline: nothing stopped them; now this does
            ranks = b.alive(RANK)
            end_pdsh_run(b, proc, env)
            tail = f"{ranks} of {n} ranks still running {FAILURE_WAIT:.0f}s after rank {n - 1} failed (then killed)"
            s = Step(latency, 0, 0, tail)
            say_step(say, label, s)
            return s
        ok = True
        try:
            err = proc.communicate(timeout=120)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1] + "\n(the launch had not ended 120 s after the ranks: killed)"
            ok = False
        left = b.left_by_ps()
        tail = (f"no rank left {latency:.2f}s after rank {n - 1} failed; launch rc={proc.returncode}; "
                f"left: {left or 'nothing'}")  # fmt: skip
        ok = ok and proc.returncode != 0 and not left and latency < FAILURE_WAIT
        s = Step(latency, 0, 0 if ok else 1, tail, stderr=err)
        say_step(say, label, s)
        return s
    finally:
        subprocess.run(["docker", "exec", last.container, "rm", "-f", FAILED_MARKER], capture_output=True,
                       check=False)  # fmt: skip
        if env is not None:
            end_pdsh_run(b, proc, env)


def weight_chief(b: Bench, weight: int, say: sandbox.Say) -> None:
    """Give the chief's container ``weight`` times every other node's CPU weight (docker's
    cpu-shares, 1024 each by default). All N containers share this machine's cores, so under
    load the chief gets 1/N of them while it alone runs the supervisor and its ssh link to
    every host: a real chief has its own machine. With ``weight`` N the chief's share no longer
    shrinks as N grows; the default (1) is the plain sandbox."""
    weight = min(weight, MAX_CHIEF_WEIGHT)
    if weight != 1:
        sandbox.docker("update", "--cpu-shares", str(1024 * weight), b.sb.nodes[0].container)
        say(f"the chief's container ({b.sb.nodes[0].name}) weighs {weight}x every other node's in CPU")


def run_n(n: int, work: Path, wheels: Path, env_dir: Path | None, args: argparse.Namespace,
          env: dict[str, str]) -> dict[str, Step | None]:  # fmt: skip
    say = lambda m: print(f"==> [{n} node(s)] {m}", flush=True)  # noqa: E731
    shared = [(env_dir, SHARED)] if env_dir is not None else []
    sb = sandbox.up(name=args.name, n=n, subnet=args.subnet, say=say, shared=shared)
    try:
        ids = sandbox.docker("inspect", "--format", "{{.Id}}", *(nd.container for nd in sb.nodes)).split()
        b = Bench(sb, args.subnet, ids, env)
        say(f"MemAvailable {mem_available_gib():.1f} GiB with the sandbox up")
        out = setup_rows(b, spec_for(sb, work, wheels), set(args.skip), say)
        if env_dir is None or n > args.launch_max_nodes:
            out |= dict.fromkeys(LAUNCH_STEPS)
        else:
            weight_chief(b, n if args.chief_weight == "n" else int(args.chief_weight), say)
            out |= launch_rows(b, launch_spec_for(sb, work), work, args.launch_runs, args.teardown_runs, say)
        return out
    finally:
        sandbox.down(args.name)


def machine_reference(env_dir: Path | None) -> dict[str, float]:
    """How fast this machine is today, so figures from different days compare: the CPU seconds of
    `import torch` in the shared env (the nodes' Python; best of 3) and the wall seconds of 200
    fork+exec+exit of /bin/true (the kernel's share: process start and end). The same machine
    was seen ~2x apart between sessions (48% of the CPU in the kernel on the slow days)."""
    out: dict[str, float] = {}
    python = env_dir / "env" / "bin" / "python" if env_dir is not None else None
    if python is not None and python.exists():
        best = float("inf")
        for _ in range(3):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if subprocess.run([str(python), "-c", "import torch"], capture_output=True, check=False).returncode != 0:
                break
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            best = min(best, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        if best != float("inf"):
            out["import_torch_cpu_s"] = round(best, 3)
    t0 = time.monotonic()
    for _ in range(200):
        subprocess.run(["/bin/true"], check=False)
    out["fork_exec_200_s"] = round(time.monotonic() - t0, 3)
    return out


def reference_line(ref: dict[str, float]) -> str:
    torch_s = ref.get("import_torch_cpu_s")
    return ("this machine today: " + (f"`import torch` {torch_s:.2f} CPU s, " if torch_s is not None else "")
            + f"200 fork+exec+exit {ref['fork_exec_200_s']:.2f} s")  # fmt: skip


def runs(v: str) -> int:
    if v.isdigit():
        return int(v)
    raise argparse.ArgumentTypeError(f"a number of runs (0 or more), not {v!r}")


def chief_weight(v: str) -> str:
    if v == "n" or (v.isdigit() and int(v) > 0):
        return v
    raise argparse.ArgumentTypeError(f"a positive integer or n, not {v!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--torch-wheelhouse", type=Path, default=WHEELS,
                    help="wheels of torch, numpy, py-spy and uv: the launch rows' shared env")  # fmt: skip
    ap.add_argument("--skip", nargs="*", default=[], choices=SETUP_STEPS, help="setup steps not to run")
    ap.add_argument("--launch-runs", type=runs, default=1,
                    help="runs of launch and of pdsh each (lower median); 0: no launch vs pdsh rows")  # fmt: skip
    ap.add_argument("--teardown-runs", type=runs, default=1,
                    help="runs of stacks, stop and failure, each beside pdsh doing it (lower median)")  # fmt: skip
    ap.add_argument("--launch-max-nodes", type=int, default=64,
                    help="launch rows only up to this many nodes (a node's torchrun and rank: ~130 MiB)")  # fmt: skip
    ap.add_argument("--chief-weight", default="1", type=chief_weight,
                    help="the launch rows with the chief's container weighing this many times every other "
                         "node in CPU (n: the node count, as if the chief had its own machine; default 1)")  # fmt: skip
    ap.add_argument("--name", default=NAME, help="the sandbox's name")
    ap.add_argument("--subnet", default=SUBNET, help="the sandbox's subnet")
    ap.add_argument("--json-out", type=Path, help="also write every step's figures here")
    args = ap.parse_args()
    # SIGTERM ends like Ctrl-C: the sandbox and the temp dir (the home included) are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    say = lambda m: print(f"==> {m}", flush=True)  # noqa: E731
    env_dir = None
    if list(args.torch_wheelhouse.glob("torch-2.13.0*.whl")) and list(args.torch_wheelhouse.glob("uv-*.whl")):
        env_dir = shared_env(args.torch_wheelhouse.resolve(), say)
        # into the page cache before the first launch, so launch and pdsh both start warm
        subprocess.run(["find", str(env_dir), "-type", "f", "-exec", "cat", "{}", "+"], stdout=subprocess.DEVNULL,
                       check=False)  # fmt: skip
    else:
        say(f"no torch-2.13.0 and uv wheels in {args.torch_wheelhouse}: the launch rows are not run")
    ref = machine_reference(env_dir)
    say(reference_line(ref))
    results: dict[int, dict[str, Step | None]] = {}
    with tempfile.TemporaryDirectory(prefix="nodeops-scale-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, NODEOPS_HOME=str(work / "home"))  # its own: the user's setup records stay out
        wheels = make_project(work)
        for n in args.nodes:
            results[n] = run_n(n, work, wheels, env_dir, args, env)
    if args.json_out:
        doc = {n: {k: (None if v is None else {**dataclasses.asdict(v), "stdout": "", "stderr": ""})
                   for k, v in r.items()} for n, r in results.items()}  # fmt: skip
        args.json_out.write_text(json.dumps({"chief_weight": args.chief_weight, "machine": ref, "results": doc},
                                            indent=1))  # fmt: skip
    print_times(results)
    print(reference_line(ref))
    print_costs(results)
    if args.chief_weight != "1":
        print(
            f"\nthe launch rows ran with the chief weighing {args.chief_weight}x (at most {MAX_CHIEF_WEIGHT}x) "
            "every other node in CPU"
        )
    return print_goals(results)


def print_times(results: dict[int, dict[str, Step | None]]) -> None:
    base_n = min(results)
    print(f"\nscale, nodes {' '.join(map(str, results))} (wall s / controller CPU s per node / wall vs {base_n} node):")
    print(f"{'step':18} " + " ".join(f"{f'N={n}':>22}" for n in results))
    for step in SETUP_STEPS + LAUNCH_STEPS:
        cells = []
        for n, r in results.items():
            s, base = r.get(step), results[base_n].get(step)
            if s is None:
                cells.append(f"{'not run':>22}")
                continue
            bad = "" if s.rc == 0 else "!"
            ratio = s.wall / base.wall if base is not None and base.wall else float("nan")
            cells.append(f"{s.wall:7.2f}{bad} {s.cpu / n:6.2f} {ratio:5.2f}x")
        print(f"{step:18} " + " ".join(cells))
    print("  stop: seconds until nothing of the run is left on any node; failure: until no rank is left")


def print_costs(results: dict[int, dict[str, Step | None]]) -> None:
    print("\ncost per node (peaks during the step / N; CPU seconds / N):")
    cols = ("ctl CPU", "ctl ssh", "ctl fds", "ctl fds/proc", "chief CPU", "chief ssh in", "chief ssh out", "chief fds")
    print(f"{'step':14} {'N':>3} " + " ".join(f"{c:>13}" for c in cols))
    for step in SETUP_STEPS + LAUNCH_STEPS:
        for n, r in results.items():
            s = r.get(step)
            if s is None or s.cost is None:
                continue
            c = s.cost
            vals = (
                s.cpu,
                c.ctl_ssh,
                c.ctl_fds,
                c.ctl_fds_max,
                c.chief_cpu,
                c.chief_ssh_in,
                c.chief_ssh_out,
                c.chief_fds,
            )
            print(f"{step:14} {n:3} " + " ".join(f"{v / n:13.2f}" for v in vals))


def print_goals(results: dict[int, dict[str, Step | None]]) -> int:
    print("\ngoals (issues 12, 29 and 43):")

    def wall(n: int, step: str) -> float | None:
        s = results.get(n, {}).get(step)
        return None if s is None or s.rc != 0 else s.wall

    def goal(text: str, value: float | None, limit: float, unit: str) -> None:
        if value is None:
            print(f"  {text}: not measured")
        else:
            print(f"  {text}: {value:.2f}{unit} (goal <= {limit:g}{unit}) {'ok' if value <= limit else 'MISSED'}")

    one = wall(1, "no-op setup")
    goal("no-op setup, 1 node", one, 5, " s")
    goal("no-op setup, 4 nodes", wall(4, "no-op setup"), 8, " s")
    n16 = wall(16, "no-op setup")
    goal("no-op setup, 16 nodes vs 1", n16 / one if n16 and one else None, 2, "x")
    c8, c1 = wall(8, "cold setup"), wall(1, "cold setup")
    goal("cold setup, 8 nodes vs 1", c8 / c1 if c8 and c1 else None, 2, "x")
    for n in results:
        noop, check = wall(n, "no-op setup"), wall(n, "check")
        goal(f"no-op setup vs check, {n} node(s)", noop / check if noop and check else None, 1.25, "x")
        full = wall(n, FULL)
        if noop and full:
            print(f"  no-op setup vs --full (the Ansible no-op), {n} node(s): {noop / full:.2f}x")
        launch, pdsh = wall(n, "launch"), wall(n, "launch, pdsh")
        goal(f"launch vs pdsh, {n} node(s)", launch / pdsh if launch and pdsh else None, 1.2, "x")
        bare = wall(n, PLAIN)
        if launch and bare:
            print(f"  launch vs pdsh of plain torchrun (no tee), {n} node(s): {launch / bare:.2f}x")
        for step, text, limit in (("stacks", "stacks of every rank", 2), ("stop", "stop: nothing left", 3),
                                  ("failure", "a failure stops every rank", 3)):  # fmt: skip
            ours = wall(n, step)
            goal(f"{text}, {n} node(s)", ours, limit, " s")
            for label in (k for k in LAUNCH_STEPS if k.startswith(f"{step}, pdsh")):
                base = wall(n, label)
                capped = label == "failure, pdsh" and base is not None and base >= FAILURE_WAIT
                if ours and base:
                    print(f"    {label}: {'>= ' if capped else ''}{base:.2f} s (nodeops {ours / base:.2f}x)")
    failed = [(n, s) for n, r in results.items() for s, v in r.items() if v is not None and v.rc != 0]
    for n, s in failed:
        print(f"  FAILED: {s} at {n} node(s): {results[n][s].tail}")  # type: ignore[union-attr]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
