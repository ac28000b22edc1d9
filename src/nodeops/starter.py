"""Start a launch plan on the hosts: render every host's run-dir files, ship them, start the job.

The files (``job.sh``, ``follow.sh``, ``kill.sh``, ``status.sh``, ``start.sh``, the MPI shim, the
agent and the protocol it shares, and on the chief the supervisor with its ``run.json``) are
rendered here from ``templates/launch/`` and ``nodeops/launch/`` and then
carried by one of two transports that end the same way, by running ``start.sh`` on the host:

- ``ssh`` (default): one ssh per host, in parallel, piping a small bash bundle (pdsh's cost);
- ``ansible``: ``playbooks/launch.yml`` through ansible-runner (copies the same files).

Paths under the remote user's home are written ``@@HOME@@/...`` and become ``"$HOME"/...`` in the
scripts (the controller does not know the remote home). The token is reserved: an argument that
contains ``@@HOME@@`` literally would be expanded too.
"""

from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeops import launchers
from nodeops.jobs import fan_out, last_line, ssh_argv
from nodeops.launch import protocol as P
from nodeops.quoting import sh_expand, sh_word
from nodeops.resources import data_dir
from nodeops.spec import LoadedSpec

HOME = "@@HOME@@"
LAUNCH_SRC = Path(P.__file__).parent  # agent.py, protocol.py, supervisor.py: shipped as they are


@dataclass(frozen=True)
class RunFile:
    name: str
    content: str
    mode: str  # octal, as text: "0700"


def shell_quote(value: object) -> str:
    """nodeops.quoting.sh_word, with @@HOME@@ turned into "$HOME" (expanded by the remote shell)."""
    parts = str(value).split(HOME)
    return '"$HOME"'.join(sh_word(p) if p else "" for p in parts) or "''"


def _jinja() -> Any:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, autoescape=False,
                             keep_trailing_newline=True)  # fmt: skip
    env.filters["quote"] = shell_quote
    env.filters["expand"] = sh_expand
    return env


def render_job(**kw: Any) -> str:
    """job.sh from its template with the production filters (what both transports ship)."""
    kw = {"run_id": "", "host": "", "node_rank": 0, "runner": "torchrun", "env_file": "", "activate": "",
          "env": {}, "shared_envs": {}, "secret_names": [], **kw}  # fmt: skip
    tpl = (data_dir("templates") / "launch" / "job.sh.j2").read_text()
    return str(_jinja().from_string(tpl).render(**kw))


def run_dir(run_id: str) -> str:
    return f"{HOME}/.nodeops/runs/{run_id}"


def job_env(runner: str, h: launchers.HostLaunch, rdir: str) -> dict[str, str]:
    """What job.sh exports on a host, beyond env.sh and secrets.env (which setup wrote)."""
    env = {**h.env, "NODEOPS_RUN_DIR": rdir}
    if runner == "torchrun":
        env.update({"PET_LOG_DIR": f"{rdir}/ranks", "PET_TEE": "3",
                    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"})  # fmt: skip
    return env


def job_workdir(loaded: LoadedSpec, run_id: str) -> str:
    """Where job.sh runs: the spec's workdir, else the run dir."""
    wd = loaded.spec.workdir
    return wd.path if wd is not None else run_dir(run_id)


def host_files(
    loaded: LoadedSpec, plan: list[launchers.HostLaunch], run_id: str, run_config: dict[str, Any]
) -> dict[str, list[RunFile]]:
    """Every host's run-dir files, by host alias."""
    from nodeops.render import activation

    spec = loaded.spec
    j = _jinja()
    tdir = data_dir("templates") / "launch"

    def tpl(name: str, **kw: Any) -> str:
        markers = {"started_marker": P.STARTED, "stopped_marker": P.STOPPED, "left_marker": P.LEFT,
                   "exit_marker": P.EXIT_MARK}  # fmt: skip
        return str(j.from_string((tdir / name).read_text()).render(run_id=run_id, **markers, **kw))

    rdir = run_dir(run_id)
    nodes = {spec.alias(n): n for n in spec.nodes}
    chief = spec.alias(spec.chief)
    runner = spec.launch.runner
    out: dict[str, list[RunFile]] = {}
    for h in plan:
        node = nodes[h.host]
        files = [RunFile(f"{s}.sh", tpl(f"{s}.sh.j2"), "0700") for s in ("follow", "kill", "status")]
        files += [RunFile(f, (LAUNCH_SRC / f).read_text(), "0600") for f in ("agent.py", "protocol.py")]
        if runner == "mpirun":
            files.append(RunFile("mpi_shim.sh", launchers.MPI_SHIM, "0755"))
        if h.argv:
            env = job_env(runner, h, rdir)
            workdir = job_workdir(loaded, run_id)
            files.append(RunFile("job.sh", tpl(
                "job.sh.j2", host=h.host, node_rank=h.node_rank, runner=runner, workdir=workdir,
                env_file=f"{HOME}/.nodeops/{loaded.cluster_name}/env.sh", activate=activation(spec, node),
                env=env, shared_envs=dict(spec.group(node).shared_envs), argv=h.argv,
                secret_names=[k for k, v in spec.env.items() if v.secret],
            ), "0700"))  # fmt: skip
        if h.host == chief:  # the run's one authority, for every runner and any number of hosts
            files.append(RunFile("supervisor.py", (LAUNCH_SRC / "supervisor.py").read_text(), "0600"))
            files.append(RunFile(P.RUN_CONFIG, json.dumps(run_config, indent=2), "0600"))
        files.append(RunFile("start.sh", tpl("start.sh.j2", host=h.host), "0700"))
        out[h.host] = files
    return out


def bundle(run_id: str, files: list[RunFile]) -> str:
    """A bash script that writes the files into the run dir and runs start.sh (stdin of ssh)."""
    lines = ["set -eu", "umask 077", f'd="$HOME/.nodeops/runs/{run_id}"', 'mkdir -p "$d"', 'chmod 700 "$d"',
             'cd "$d"']  # fmt: skip
    for f in files:
        b64 = base64.b64encode(f.content.encode()).decode()
        lines.append(f"printf '%s' '{b64}' | base64 -d > {sh_word(f.name)}")
        lines.append(f"chmod {f.mode} {sh_word(f.name)}")
    lines.append("exec bash start.sh")
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


def ansible_vars(run_id: str, files: dict[str, list[RunFile]]) -> dict[str, Any]:
    """Extra vars for playbooks/launch.yml: each host's bundle, the same script the ssh transport
    pipes (so both transports write and start exactly the same)."""
    return {"nodeops_launch_bundle": {h: bundle(run_id, fs) for h, fs in files.items()},
            "nodeops_started_marker": P.STARTED}  # fmt: skip
