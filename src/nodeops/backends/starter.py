"""Start a launch plan on the hosts: render every host's run-dir files, ship them, start the job.

The files (``job.sh``, ``follow.sh``, ``kill.sh``, ``status.sh``, ``start.sh``, the MPI shim, the
agent and the protocol it shares, the ranks' stack hook, and on the chief the supervisor with
its ``run.json``) are rendered from the collection's launch role (``roles/launch/templates`` and
``roles/launch/files``) and carried by one of two transports that end the same way, by running
``start.sh`` on the host:

- ``ssh`` (default): one ssh per host, in parallel, piping a small bash bundle (pdsh's cost);
- ``ansible``: the collection's launch playbook through ansible-runner: the role renders the same
  templates with Ansible's template module from the same :func:`run_vars` (passed ``!unsafe``).

Paths under the remote user's home are written ``@@HOME@@/...`` and become ``"$HOME"/...`` in the
scripts (the controller does not know the remote home). The token is reserved: an argument that
contains ``@@HOME@@`` literally would be expanded too.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeops import _shell
from nodeops.launch import launchers
from nodeops.launch import plan as _launch_plan
from nodeops.node import protocol as P
from nodeops.node import stacks as S
from nodeops.quoting import sh_expand, sh_run_word, sh_word
from nodeops.resources import data_dir
from nodeops.setup.render import activation
from nodeops.spec.model import LoadedSpec
from nodeops.transport import fan_out, last_line, ssh_argv

HOME = _shell.HOME_TOKEN
ROLE = "launch"  # the collection's launch role: its templates/ and files/ are the run files' source
SHIPPED = ("agent.py", "protocol.py", "stacks.py", "recovery.py")  # beside every host's job (files/)


@dataclass(frozen=True)
class RunFile:
    name: str
    content: str
    mode: str  # octal, as text: "0700"


# What a spare imports once at launch (`spare-job.sh --warm`, at low priority): what every rank of
# a torchrun job imports, so its env is in the spare's page cache when it takes a failed node's
# place (a cold `import torch` took 2.3 s against 1.45 s warm on a sandbox node; far more from a
# cold disk or a network filesystem).
WARM_MODULES = ("torch", "torch.distributed")

shell_quote = sh_run_word  # one bash word, @@HOME@@ as "$HOME" (expanded by the remote shell)


def _jinja() -> Any:
    """Jinja as the launch role's templates expect it: the collection's filters by their FQCN."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, autoescape=False,
                             keep_trailing_newline=True)  # fmt: skip
    env.filters["nodeops.cluster.nodeops_sh_run_word"] = sh_run_word
    env.filters["nodeops.cluster.nodeops_sh_expand"] = sh_expand
    return env


def role_dir(sub: str) -> Path:
    return data_dir("roles") / ROLE / sub


def render_job(**kw: Any) -> str:
    """job.sh from its template with the production filters (what both transports ship)."""
    kw = {"run_id": "", "host": "", "node_rank": 0, "runner": "torchrun", "env_file": "", "activate": "",
          "env": {}, "shared_envs": {}, "secret_names": [], **kw}  # fmt: skip
    return str(_jinja().from_string((role_dir("templates") / "job.sh.j2").read_text()).render(**kw))


def run_dir(run_id: str) -> str:
    return str(_launch_plan.run_dir(run_id))


def job_env(runner: str, h: launchers.HostLaunch, rdir: str) -> dict[str, str]:
    """What job.sh exports on a host, beyond env.sh and secrets.env (which setup wrote)."""
    return dict(_launch_plan.job_env(runner, h.env, rdir))


def job_workdir(loaded: LoadedSpec, run_id: str) -> str:
    """Where job.sh runs: the spec's workdir, else the run dir."""
    wd = loaded.spec.workdir
    return wd.path if wd is not None else run_dir(run_id)


def markers() -> dict[str, str]:
    """The protocol's markers, as the launch role's templates name them."""
    return {"started_marker": P.STARTED, "stopped_marker": P.STOPPED, "left_marker": P.LEFT,
            "exit_marker": P.EXIT_MARK}  # fmt: skip


def run_vars(
    loaded: LoadedSpec, plan: list[launchers.HostLaunch], run_id: str, run_config: dict[str, Any]
) -> dict[str, Any]:
    """The run as the launch role takes it (``launch_run``): run id, chief, runner, the
    protocol's markers, the supervisor's run.json, and each host's job.sh inputs (None where the
    host starts nothing itself). Both transports render the run files from this."""

    spec = loaded.spec
    rdir = run_dir(run_id)
    nodes = {spec.alias(n): n for n in spec.nodes}
    runner = spec.launch.runner
    hosts: dict[str, Any] = {}
    for h in plan:
        node = nodes[h.host]
        job = None
        if h.argv:
            job = {"host": h.host, "node_rank": h.node_rank, "runner": runner, "workdir": job_workdir(loaded, run_id),
                   "env_file": f"{HOME}/.nodeops/{loaded.cluster_name}/env.sh", "activate": activation(spec, node),
                   "env": job_env(runner, h, rdir), "shared_envs": dict(spec.group(node).shared_envs),
                   "argv": h.argv, "secret_names": [k for k, v in spec.env.items() if v.secret],
                   "warm": list(WARM_MODULES) if h.node_rank < 0 else []}  # fmt: skip
        hosts[h.host] = {"node_rank": h.node_rank, "job": job}
    return {"run_id": run_id, "chief": spec.alias(spec.chief), "runner": runner, "markers": markers(),
            "run_config": run_config, "hosts": hosts}  # fmt: skip


def files_from_vars(run: dict[str, Any]) -> dict[str, list[RunFile]]:
    """Every host's run-dir files, by host alias: what the launch role writes from the same vars
    (tests/unit/collection/test_launch_role.py holds the two to the same bytes)."""
    j = _jinja()
    tdir, fdir = role_dir("templates"), role_dir("files")
    compiled: dict[str, Any] = {}  # each template once, not once per host (1.3 s of 64 hosts' start)

    def tpl(name: str, **kw: Any) -> str:
        if name not in compiled:
            compiled[name] = j.from_string((tdir / name).read_text())
        return str(compiled[name].render(run_id=run["run_id"], **run["markers"], **kw))

    out: dict[str, list[RunFile]] = {}
    for host, hv in run["hosts"].items():
        files = [RunFile(f"{s}.sh", tpl(f"{s}.sh.j2", host=host), "0700") for s in ("follow", "kill", "status")]
        files += [RunFile(f, (fdir / f).read_text(), "0600") for f in SHIPPED]
        if run["runner"] == "mpirun":
            files.append(RunFile(launchers.MPI_SHIM_FILE, (fdir / launchers.MPI_SHIM_FILE).read_text(), "0755"))
        if hv["job"] is not None:  # a spare's waits under another name until an attempt needs it
            name = P.SPARE_JOB if hv["node_rank"] < 0 else P.JOB
            files.append(RunFile(name, tpl("job.sh.j2", **hv["job"]), "0700"))
        if host == run["chief"]:  # the run's one authority, for every runner and any number of hosts
            files += [RunFile(f, (fdir / f).read_text(), "0600") for f in ("supervisor.py", "stall.py")]
            files.append(RunFile(P.RUN_CONFIG, json.dumps(run["run_config"], indent=2), "0600"))
        # the ranks' stack hook, shipped rather than written by start.sh (a python3 on every node's start)
        files.append(RunFile(f"{S.HOOK_DIR}/sitecustomize.py", S.HOOK, "0600"))
        files.append(RunFile("start.sh", tpl("start.sh.j2", host=host), "0700"))
        out[host] = files
    return out


def host_files(
    loaded: LoadedSpec, plan: list[launchers.HostLaunch], run_id: str, run_config: dict[str, Any]
) -> dict[str, list[RunFile]]:
    """Every host's run-dir files, by host alias."""
    return files_from_vars(run_vars(loaded, plan, run_id, run_config))


def bundle(run_id: str, files: list[RunFile]) -> str:
    """A bash script that writes the files into the run dir and runs start.sh (stdin of ssh): the
    files as one gzipped tar, base64 in the script, unpacked by one ``tar`` with their modes (two
    processes a host, where a printf, base64 and chmod per file took ~0.4 s of a busy node's start)."""
    buf = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        for f in files:
            data = f.content.encode()
            info = tarfile.TarInfo(f.name)
            info.size, info.mode, info.mtime = len(data), int(f.mode, 8), now
            tar.addfile(info, io.BytesIO(data))
    b64 = base64.b64encode(buf.getvalue()).decode()
    lines = ["set -euo pipefail", "umask 077", f'd="$HOME/.nodeops/runs/{run_id}"', 'mkdir -p "$d"', 'chmod 700 "$d"',
             'cd "$d"', f"printf '%s' '{b64}' | base64 -d | tar -xzpmf - --no-same-owner",
             "exec bash start.sh"]  # fmt: skip
    return "\n".join(lines) + "\n"


def start_ssh(ssh_config: Path, run_id: str, files: dict[str, list[RunFile]], timeout: float = 60) -> dict[str, str]:
    """Ship and start on every host in parallel; returns host -> error ('' when started)."""

    def one(host: str) -> str:
        try:
            p = subprocess.run(ssh_argv(ssh_config, host, "bash", "-s"), input=bundle(run_id, files[host]),
                               capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"did not start within {timeout:.0f}s"
        if p.returncode == 0 and P.STARTED in p.stdout:
            return ""
        return last_line(p.stderr, f"exit {p.returncode}")

    return fan_out(list(files), one)


def start_supervisor(ssh_config: Path, run_id: str, chief: str, timeout: float = 30) -> str:
    """Once every host has started: start the supervisor on the chief ('' when started)."""
    try:
        p = subprocess.run(ssh_argv(ssh_config, chief, "bash", sh_word(f"{P.run_dir(run_id)}/start.sh"), "supervise"),
                           capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the supervisor did not start within {timeout:.0f}s"
    return "" if p.returncode == 0 and P.STARTED in p.stdout else last_line(p.stderr, f"exit {p.returncode}")


def ansible_vars(run: dict[str, Any]) -> dict[str, Any]:
    """Extra vars for the collection's launch playbook (``playbooks/launch.yml``, the launch
    role): the run as :func:`run_vars` made it, so the role renders the same files from the same
    templates; the CLI starts the supervisor, follows the run and keeps the record itself."""
    return {"launch_run": run, "launch_supervise": False, "launch_wait": False,
            "launch_record": False}  # fmt: skip
