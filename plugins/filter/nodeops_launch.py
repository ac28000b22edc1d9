# SPDX-License-Identifier: Apache-2.0
"""``nodeops_launch_run``: the launch role's run, worked out from a plain inventory.

    {{ launch_argv | nodeops.cluster.nodeops_launch_run(ansible_play_hosts_all, hostvars, ...) }}

Returns the same structure the nodeops CLI passes to the role as ``launch_run``
(``nodeops.backends.starter.run_vars``): run id, chief, runner, the launch protocol's markers, the
supervisor's run.json, each host's job.sh inputs, and the controller record that
``nodeops status/logs/stop`` read. The commands come from ``module_utils/nodeops_launch.py``, the
code the CLI plans with.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: nodeops_launch_run
short_description: Plan a nodeops launch from the play's hosts (used by the nodeops.cluster.launch role)
description:
  - Works out the run id, the chief, every host's torchrun/mpirun/deepspeed command and the
    supervisor's configuration, from the hosts' C(ansible_host), C(ansible_port), C(ansible_user)
    and C(launch_nproc_per_node) variables.
  - The options are the launch role's variables without the C(launch_) prefix; see
    C(ansible-doc -t role nodeops.cluster.launch).
options:
  _input:
    description: The training script and its arguments.
    type: list
    elements: str
    required: true
"""

import importlib.util
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError


_ROOT = Path(__file__).resolve().parent.parent.parent  # the collection


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AnsibleFilterError(f"nodeops_launch_run: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_plan = _load(_ROOT / "plugins" / "module_utils" / "nodeops_launch.py", "_launch_plan")
_shell = _load(_ROOT / "plugins" / "module_utils" / "nodeops_shell.py", "_nodeops_shell")
_protocol = _load(_ROOT / "roles" / "launch" / "files" / "protocol.py", "_launch_protocol")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}\Z")


def _home(path: str) -> str:
    """``~`` and ``~/x`` as the run files' @@HOME@@ token (job.sh quotes every path)."""
    if path == "~":
        return _shell.HOME_TOKEN
    return _shell.HOME_TOKEN + path[1:] if path.startswith("~/") else path


def _var(hv: Mapping[str, Any], name: str, default: Any) -> Any:
    value = hv.get(name)
    return default if value is None or value == "" else value


def nodeops_launch_run(
    argv: Sequence[Any],
    hosts: Sequence[str],
    hostvars: Mapping[str, Any],
    run_id: str = "",
    chief: str = "",
    runner: str = "torchrun",
    rendezvous: str = "static",
    master_port: int = 29500,
    rdzv_port: int = 29400,
    max_restarts: int = 0,
    nproc_per_node: int = 1,
    workdir: str = "",
    env_file: str = "~/.nodeops/cluster/env.sh",
    venv: str = "",
    conda_env: str = "",
    conda_base: str = "~/miniconda3",
    script: str = "",
    socket_ifname: str = "",
    hostfile: str = "~/.nodeops/cluster/hostfile",
    python: str = "python3",
    env: Mapping[str, Any] | None = None,
    forward_env: Sequence[str] = (),
    flight_recorder: bool = False,
) -> dict[str, Any]:
    problems: list[str] = []
    hosts = list(hosts)
    if not hosts:
        raise AnsibleFilterError("nodeops.cluster.launch: the play has no hosts")
    if chief and chief not in hosts:
        problems.append(f"launch_chief: {chief!r} is not a host of the play ({', '.join(hosts)})")
    if runner not in _plan.RUNNERS:
        problems.append(f"launch_runner: {runner!r}; use one of {', '.join(_plan.RUNNERS)}")
    if rendezvous not in ("static", "c10d"):
        problems.append(f"launch_rendezvous: {rendezvous!r}; use static or c10d")
    if not argv and not script:
        problems.append("launch_argv: empty; give the training script and its arguments, e.g. [train.py, --lr, '1e-3']")
    if isinstance(argv, str) or any(isinstance(a, (Mapping, list)) for a in argv):
        problems.append("launch_argv: must be a list of the script's words, e.g. [train.py, --lr, '1e-3'] "
                        "(with -e, pass JSON: -e '{\"launch_argv\": [\"train.py\"]}')")  # fmt: skip
    if any(_shell.HOME_TOKEN in str(a) for a in argv):
        problems.append(f"launch_argv: {_shell.HOME_TOKEN} is reserved (it becomes the host's $HOME in run files)")
    if isinstance(forward_env, str):
        problems.append("launch_forward_env: must be a list of variable names")
        forward_env = ()
    if env is not None and not isinstance(env, Mapping):
        problems.append("launch_env: must be a mapping of NAME: value")
        env = None
    if run_id and not _RUN_ID.match(run_id):
        problems.append(f"launch_run_id: {run_id!r} is not like 20261122-101500-ab12 (leave it empty)")
    user_env = {str(k): str(v) for k, v in (env or {}).items()}
    problems += [f"launch_env: {k!r} is not a variable name" for k in user_env if not _NAME.match(k)]
    problems += [f"launch_forward_env: {k!r} is not a variable name" for k in forward_env if not _NAME.match(str(k))]
    order = [chief, *(h for h in hosts if h != chief)] if chief in hosts else hosts
    nodes, conn = [], {}
    for h in order:
        hv = hostvars[h]
        try:
            nproc = int(_var(hv, "launch_nproc_per_node", nproc_per_node))
            port = int(_var(hv, "ansible_port", _var(hv, "ansible_ssh_port", 0)))  # 0: ssh's own (ssh args, 22)
        except (TypeError, ValueError) as e:
            problems.append(f"{h}: launch_nproc_per_node / ansible_port: not an integer ({e})")
            continue
        if nproc < 1:
            problems.append(f"{h}: launch_nproc_per_node: {nproc}; at least 1")
        address = str(_var(hv, "ansible_host", _var(hv, "ansible_ssh_host", h)))
        if address.startswith("-") or h.startswith("-"):
            problems.append(f"{h}: ansible_host {address!r}: a host name or address may not start with '-'")
        nodes.append({"host": h, "address": address, "nproc": nproc})
        conn[h] = {"address": address, "port": port, "user": str(_var(hv, "ansible_user", _var(hv, "ansible_ssh_user", ""))),
                   "key_file": str(_var(hv, "ansible_ssh_private_key_file", _var(hv, "ansible_private_key_file", ""))),
                   "ssh_args": " ".join(str(_var(hv, k, "")) for k in ("ansible_ssh_common_args", "ansible_ssh_extra_args")).strip()}  # fmt: skip
    if problems:
        raise AnsibleFilterError("nodeops.cluster.launch: " + "; ".join(problems))
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    rdir = _plan.run_dir(run_id)
    rdzv = _plan.rendezvous(rendezvous, [n["nproc"] for n in nodes])
    names = sorted({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", *map(str, forward_env), *user_env})
    plan = _plan.plan(nodes, [str(a) for a in argv], run_id, runner=runner, rdzv=rdzv, master_port=int(master_port),
                      rdzv_port=int(rdzv_port), max_restarts=int(max_restarts), socket_ifname=socket_ifname or None,
                      env_names=names, script=script or None, shim_path=f"{rdir}/mpi_shim.sh",
                      hostfile_path=_home(hostfile), python=python,
                      flight_recorder=bool(flight_recorder))  # fmt: skip
    if conda_env:
        activate = f"source {_shell.sh_path(conda_base)}/etc/profile.d/conda.sh && conda activate {_shell.sh_word(conda_env)}"
    else:
        activate = f"source {_shell.sh_path(venv)}/bin/activate" if venv else ""
    chief = order[0]
    run_hosts: dict[str, Any] = {}
    for p in plan:
        job = None
        if p["argv"]:
            job = {"host": p["host"], "node_rank": p["node_rank"], "runner": runner, "workdir": _home(workdir) or rdir,
                   "env_file": _home(env_file), "activate": activate,
                   "env": _plan.job_env(runner, {**p["env"], **user_env}, rdir), "shared_envs": {},
                   "argv": p["argv"], "secret_names": []}  # fmt: skip
        run_hosts[p["host"]] = {"node_rank": p["node_rank"], "job": job}
    started = [p["host"] for p in plan if p["argv"]]
    supervised = [{"name": p["host"], "address": p["address"], "port": conn[p["host"]]["port"] or 22,
                   "user": conn[p["host"]]["user"], "local": p["host"] == chief, "job": p["host"] in started}
                  for p in plan]  # fmt: skip
    markers = {"started_marker": _protocol.STARTED, "stopped_marker": _protocol.STOPPED,
               "left_marker": _protocol.LEFT, "exit_marker": _protocol.EXIT_MARK}  # fmt: skip
    record = {"run_id": run_id, "hosts": started, "argv": [str(a) for a in argv], "runner": runner, "chief": chief,
              "spec": "", "started": time.time(), "all_hosts": order,
              "rank_hosts": _plan.rank_hosts(nodes) if runner == "mpirun" else [],
              "pdsh_hosts": {n["address"]: n["host"] for n in nodes} if runner == "deepspeed" else {},
              "connection": conn, "launched_by": "nodeops.cluster.launch"}  # fmt: skip
    return {"run_id": run_id, "chief": chief, "runner": runner, "markers": markers,
            "run_config": _plan.run_config(run_id, supervised, runner, int(max_restarts)),
            "hosts": run_hosts, "record": record}  # fmt: skip


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"nodeops_launch_run": nodeops_launch_run}
