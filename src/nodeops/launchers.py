"""Pure: spec + the user's argv -> what each host runs to start training.

Commands are argv lists, never shell strings; the job script template quotes each element
(``| quote``), so user arguments reach the training script literally (quotes, spaces,
``$()``, ``;`` and newlines included). Environment values are not put on command lines:
mpirun gets ``-x NAME`` (export by name), and the values come from the env files setup wrote.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodeops.spec import Node, ResourceSpec

# Runs on each rank under mpirun: maps Open MPI's variables to the names torch's env://
# rendezvous reads, so an unmodified init_process_group("env://") script works.
MPI_SHIM = """#!/bin/sh
# nodeops: map Open MPI rank variables to torch.distributed's env:// names.
export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE="$OMPI_COMM_WORLD_SIZE"
export LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE"
exec "$@"
"""


@dataclass(frozen=True)
class HostLaunch:
    host: str  # inventory alias
    address: str
    node_rank: int
    nproc: int
    argv: list[str]  # empty: this host starts nothing itself (mpirun/deepspeed start ranks from the chief)
    env: dict[str, str] = field(default_factory=dict)


def rendezvous(spec: ResourceSpec) -> str:
    """torchrun's static rendezvous needs the same nproc on every node; otherwise use c10d."""
    if spec.launch.rendezvous == "c10d" or len({spec.nproc(n) for n in spec.nodes}) > 1:
        return "c10d"
    return "static"


def _entry(user_argv: Sequence[str], script: str | None) -> list[str]:
    """The command each rank runs. ``--script run.sh`` runs a bash script that calls
    ``$NODEOPS_RUNNER train.py ...`` (madengine's MAD_MULTI_NODE_RUNNER style)."""
    return ["bash", script, *user_argv] if script else list(user_argv)


def runner_prefix(spec: ResourceSpec, node: Node, run_id: str, python: str = "python3") -> list[str]:
    """The per-host launcher prefix, like madengine's ``multi_node_args`` runner: append a
    training script and its arguments to it."""
    ranked = spec.ranked_nodes()
    rank = ranked.index(node)
    chief = spec.chief.address
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(len(ranked)), "--nproc-per-node",
            str(spec.nproc(node))]  # fmt: skip
    if rendezvous(spec) == "c10d":
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{chief}:{spec.launch.rdzv_port}", "--rdzv-id", run_id]
    else:
        argv += ["--node-rank", str(rank), "--master-addr", chief, "--master-port", str(spec.launch.master_port)]
    argv += ["--max-restarts", str(spec.launch.max_restarts)]
    return argv


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
    """Per-host launch commands, in node-rank order.

    ``env_names``: variables to forward to remote ranks by name (mpirun ``-x``).
    ``shim_path``: where the MPI shim lies on every node. ``hostfile_path``: the DeepSpeed
    hostfile on the chief. Both may hold ``@@HOME@@``, which the launch playbook replaces with
    the host's home directory (job scripts quote every argument, so ``~`` would stay literal).
    """
    ranked = spec.ranked_nodes()
    chief = spec.chief.address
    base_env = {
        "MASTER_ADDR": chief,
        "MASTER_PORT": str(spec.launch.master_port),
        "NNODES": str(len(ranked)),
        "NODEOPS_RUN_ID": run_id,
        "WORLD_SIZE": str(sum(spec.nproc(n) for n in ranked)),
        # Logs go to files; without this, Python (torchrun's tee included) block-buffers them
        # and nothing reaches `nodeops launch`/`logs -f` until the job exits.
        "PYTHONUNBUFFERED": "1",
    }
    out: list[HostLaunch] = []
    runner = spec.launch.runner
    for rank, node in enumerate(ranked):
        env = {**base_env, "NODE_RANK": str(rank)}
        argv: list[str] = []
        if runner == "torchrun":
            prefix = runner_prefix(spec, node, run_id, python)
            env["NODEOPS_RUNNER"] = shlex.join(prefix)
            argv = _entry(user_argv, script) if script else [*prefix, *user_argv]
        elif rank == 0 and runner == "mpirun":
            hosts = ",".join(f"{n.address}:{spec.nproc(n)}" for n in ranked)
            mpi = ["mpirun", "-np", env["WORLD_SIZE"], "-H", hosts, "--bind-to", "none", "--map-by", "slot",
                   "--tag-output"]  # fmt: skip
            if socket_ifname:
                mpi += ["--mca", "btl_tcp_if_include", socket_ifname, "--mca", "oob_tcp_if_include", socket_ifname]
            # PATH carries the activated env (the same venv path on every node); NODE_RANK is
            # the chief's and would be wrong elsewhere.
            for name in sorted({*env, *env_names, "PATH"} - {"NODE_RANK"}):
                mpi += ["-x", name]
            prefix = [*mpi, shim_path, python]
            env["NODEOPS_RUNNER"] = shlex.join(prefix)
            argv = _entry(user_argv, script) if script else [*prefix, *user_argv]
        elif rank == 0 and runner == "deepspeed":
            prefix = ["deepspeed", "--hostfile", hostfile_path, "--master_addr", chief,
                      "--master_port", str(spec.launch.master_port)]  # fmt: skip
            env["NODEOPS_RUNNER"] = shlex.join(prefix)
            argv = _entry(user_argv, script) if script else [*prefix, *user_argv]
        out.append(HostLaunch(spec.alias(node), node.address, rank, spec.nproc(node), argv, env))
    return out


def rank_hosts(spec: ResourceSpec) -> list[str]:
    """Which host each global rank lands on with ``--map-by slot`` (hosts filled in -H order)."""
    return [spec.alias(n) for n in spec.ranked_nodes() for _ in range(spec.nproc(n))]
