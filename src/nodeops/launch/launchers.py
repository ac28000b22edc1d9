"""Pure: spec + the user's argv -> what each host runs to start training.

The plan itself is the collection's ``plugins/module_utils/nodeops_launch.py`` (``nodeops.launch.plan``
links to it), which the launch role's filter uses too; this module maps a resource spec onto it.
Commands are argv lists, never shell strings; the job script template quotes each element, so
user arguments reach the training script literally (quotes, spaces, ``$()``, ``;`` and newlines
included). Environment values are not put on command lines: mpirun gets ``-x NAME`` (export by
name), and the values come from the env files setup wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeops.launch import plan as _launch_plan
from nodeops.node import stacks as S
from nodeops.resources import data_dir
from nodeops.spec.model import Node, ResourceSpec

# Runs on each rank under mpirun: maps Open MPI's rank variables to torch's env:// names.
MPI_SHIM_FILE = S.SHIM


def mpi_shim() -> str:
    return (data_dir("roles") / "launch" / "files" / MPI_SHIM_FILE).read_text()


@dataclass(frozen=True)
class HostLaunch:
    host: str  # inventory alias
    address: str
    node_rank: int
    nproc: int
    argv: list[str]  # empty: this host starts nothing itself (mpirun/deepspeed start ranks from the chief)
    env: dict[str, str] = field(default_factory=dict)


def _nodes(spec: ResourceSpec, nodes: list[Node] | None = None) -> list[dict[str, Any]]:
    """The first attempt's nodes (spares left out), or ``nodes``, as the plan takes them."""
    return [{"host": spec.alias(n), "address": n.address, "nproc": spec.nproc(n)}
            for n in (spec.job_nodes() if nodes is None else nodes)]  # fmt: skip


def rendezvous(spec: ResourceSpec) -> str:
    """torchrun's static rendezvous needs the same nproc on every node; otherwise use c10d."""
    return str(_launch_plan.rendezvous(spec.launch.rendezvous, [spec.nproc(n) for n in spec.nodes]))


def runner_prefix(spec: ResourceSpec, node: Node, run_id: str, python: str = "python3") -> list[str]:
    """The per-host launcher prefix, like madengine's ``multi_node_args`` runner: append a
    training script and its arguments to it."""
    lc = spec.launch
    return list(_launch_plan.torchrun_prefix(
        _nodes(spec), spec.job_nodes().index(node), run_id, rdzv=rendezvous(spec), master_port=lc.master_port,
        rdzv_port=lc.rdzv_port, max_restarts=lc.max_restarts, python=python,
    ))  # fmt: skip


def plan(
    spec: ResourceSpec,
    user_argv: Sequence[str],
    run_id: str,
    *,
    socket_ifname: str | None = None,
    env_names: Sequence[str] = (),
    script: str | None = None,
    shim_path: str = "",
    hostfile_path: str = "",
    python: str = "python3",
) -> list[HostLaunch]:
    """Per-host launch commands, in node-rank order (see ``nodeops_launch.plan``)."""
    lc = spec.launch
    hosts = _launch_plan.plan(
        _nodes(spec), user_argv, run_id, runner=lc.runner, rdzv=rendezvous(spec), master_port=lc.master_port,
        rdzv_port=lc.rdzv_port, max_restarts=lc.max_restarts, socket_ifname=socket_ifname, env_names=env_names,
        script=script, shim_path=shim_path, hostfile_path=hostfile_path, python=python,
        flight_recorder=spec.flight_recorder(), elastic=lc.restarts > 0, spares=_nodes(spec, spec.spares()),
    )  # fmt: skip
    return [HostLaunch(h["host"], h["address"], h["node_rank"], h["nproc"], h["argv"], h["env"]) for h in hosts]


def rank_hosts(spec: ResourceSpec) -> list[str]:
    """Which host each global rank lands on with ``--map-by slot`` (hosts filled in -H order)."""
    return list(_launch_plan.rank_hosts(_nodes(spec)))
