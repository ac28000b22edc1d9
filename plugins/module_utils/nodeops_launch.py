# SPDX-License-Identifier: Apache-2.0
"""What each host runs to start training: the launch plan, stdlib only.

One implementation for both ways of launching: the nodeops CLI (``nodeops.launch.launchers`` maps a
resource spec onto :func:`plan`) and the collection's ``launch`` role (its
``nodeops_launch_run`` filter maps an inventory onto it). Commands are argv lists, never shell
strings: the job script template quotes each element, so user arguments reach the training
script literally. Environment values are not put on command lines: mpirun gets ``-x NAME``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

RUNNERS = ("torchrun", "mpirun", "deepspeed")


def rendezvous(requested: str, nprocs: Sequence[int]) -> str:
    """torchrun's static rendezvous needs the same nproc on every node; otherwise use c10d."""
    return "c10d" if requested == "c10d" or len(set(nprocs)) > 1 else "static"


def torchrun_prefix(
    nodes: Sequence[Mapping[str, Any]], rank: int, run_id: str, *, rdzv: str, master_port: int, rdzv_port: int,
    max_restarts: int, python: str = "python3", elastic: bool = False,
) -> list[str]:  # fmt: skip
    """torchrun's command for the node of ``rank`` (append the training script and its args).
    ``nodes``: ``{"address", "nproc"}`` in node-rank order; the first is the chief.
    ``elastic`` (nodeops' automatic restarts): the node count and node rank are left to
    torchrun's PET_NNODES / PET_NODE_RANK, which each attempt's ``attempt.env`` sets."""
    chief = str(nodes[0]["address"])
    argv = [python, "-m", "torch.distributed.run"]
    argv += [] if elastic else ["--nnodes", str(len(nodes))]
    argv += ["--nproc-per-node", str(nodes[rank]["nproc"])]
    if rdzv == "c10d":
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{chief}:{rdzv_port}", "--rdzv-id", run_id]
    else:
        argv += [] if elastic else ["--node-rank", str(rank)]
        argv += ["--master-addr", chief, "--master-port", str(master_port)]
    return [*argv, "--max-restarts", str(max_restarts)]


def plan(
    nodes: Sequence[Mapping[str, Any]],
    user_argv: Sequence[str],
    run_id: str,
    *,
    runner: str = "torchrun",
    rdzv: str = "static",
    master_port: int = 29500,
    rdzv_port: int = 29400,
    max_restarts: int = 0,
    socket_ifname: str | None = None,
    env_names: Sequence[str] = (),
    script: str | None = None,
    shim_path: str = "",
    hostfile_path: str = "",
    python: str = "python3",
    flight_recorder: bool = False,
    elastic: bool = False,
    spares: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Per-host launches, in node-rank order: ``{host, address, node_rank, nproc, argv, env}``.

    ``nodes``: ``{"host", "address", "nproc"}`` in node-rank order (the first is the chief).
    ``rdzv``: ``static`` or ``c10d``, already resolved with :func:`rendezvous`.
    ``argv`` is empty where the host starts nothing itself (mpirun/deepspeed start every rank
    from the chief). ``env_names``: variables mpirun forwards by name (``-x``).
    ``script``: a bash script that calls ``$NODEOPS_RUNNER train.py ...`` (madengine's style).
    ``shim_path`` (the MPI shim on every node) and ``hostfile_path`` (DeepSpeed's, on the
    chief) may hold ``@@HOME@@``: the job script turns it into the host's ``"$HOME"``.
    ``flight_recorder``: every rank gets ``NODEOPS_FLIGHT_RECORDER=1`` (mpirun forwards it), and
    the ranks' hook sets PyTorch's NCCL flight-recorder variables the env does not already set.
    ``elastic`` (nodeops' automatic restarts, torchrun only): the node count, node rank and world
    size come from each attempt's ``attempt.env`` (NNODES, NODE_RANK, WORLD_SIZE and torchrun's
    PET_NNODES, PET_NODE_RANK), so the same job.sh serves every attempt; ``spares`` are nodes
    that run nothing until an attempt gives them a node rank (their entries have node rank -1).
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r}: use one of {', '.join(RUNNERS)}")
    if (elastic or spares) and runner != "torchrun":
        raise ValueError("automatic restarts (and spare nodes) need runner torchrun")
    elastic = elastic or bool(spares)
    chief = str(nodes[0]["address"])
    base_env = {
        "MASTER_ADDR": chief,
        "MASTER_PORT": str(master_port),
        "NNODES": str(len(nodes)),
        "NODEOPS_RUN_ID": run_id,
        "WORLD_SIZE": str(sum(int(n["nproc"]) for n in nodes)),
        # Logs go to files; without this, Python (torchrun's tee included) block-buffers them
        # and nothing reaches `nodeops launch`/`logs -f` until the job exits.
        "PYTHONUNBUFFERED": "1",
    }
    if flight_recorder:  # the ranks' hook turns on PyTorch's NCCL flight recorder (stacks.HOOK)
        base_env["NODEOPS_FLIGHT_RECORDER"] = "1"

    def entry(prefix: list[str]) -> list[str]:
        return ["bash", script, *user_argv] if script else [*prefix, *user_argv]

    every = [*nodes, *spares]
    out: list[dict[str, Any]] = []
    for rank, node in enumerate(every):
        env = {**base_env, "NODE_RANK": str(rank)}
        if elastic and rank < len(nodes):  # the first attempt's; a later attempt.env overrides them
            env.update({"PET_NNODES": str(len(nodes)), "PET_NODE_RANK": str(rank), "NODEOPS_RESTART_COUNT": "0",
                        "NODEOPS_ATTEMPT": "1"})  # fmt: skip
        elif elastic:  # a spare: only an attempt.env gives it these
            for name in ("NNODES", "WORLD_SIZE", "NODE_RANK"):
                del env[name]
        prefix: list[str] = []
        if runner == "torchrun":
            prefix = torchrun_prefix(every, rank, run_id, rdzv=rdzv, master_port=master_port, rdzv_port=rdzv_port,
                                     max_restarts=max_restarts, python=python, elastic=elastic)  # fmt: skip
        elif rank == 0 and runner == "mpirun":
            hosts = ",".join(f"{n['address']}:{n['nproc']}" for n in nodes)
            prefix = ["mpirun", "-np", env["WORLD_SIZE"], "-H", hosts, "--bind-to", "none", "--map-by", "slot",
                      "--tag-output"]  # fmt: skip
            if socket_ifname:
                prefix += ["--mca", "btl_tcp_if_include", socket_ifname, "--mca", "oob_tcp_if_include", socket_ifname]
            # PATH carries the activated env (the same venv path on every node); NODE_RANK is
            # the chief's and would be wrong elsewhere.
            for name in sorted({*env, *env_names, "PATH"} - {"NODE_RANK"}):
                prefix += ["-x", name]
            prefix += [shim_path, python]
        elif rank == 0 and runner == "deepspeed":
            prefix = ["deepspeed", "--hostfile", hostfile_path, "--master_addr", chief, "--master_port",
                      str(master_port)]  # fmt: skip
        argv: list[str] = []
        if prefix:
            env["NODEOPS_RUNNER"] = shlex.join(prefix)
            argv = entry(prefix)
        out.append({"host": str(node["host"]), "address": str(node["address"]),
                    "node_rank": rank if rank < len(nodes) else -1,
                    "nproc": int(node["nproc"]), "argv": argv, "env": env})  # fmt: skip
    return out


def rank_hosts(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which host each global rank lands on with mpirun's ``--map-by slot`` (hosts filled in -H order)."""
    return [str(n["host"]) for n in nodes for _slot in range(int(n["nproc"]))]


def run_dir(run_id: str) -> str:
    """A run's dir on every host (``@@HOME@@``: the host's home, expanded by its shell)."""
    return f"@@HOME@@/.nodeops/runs/{run_id}"


# torchrun's prefix of each rank's echoed lines. It starts with an ASCII record separator, which
# no one prints: torchrun's tee can cut a rank's line in two (it echoes the start of a line the
# rank is still writing), and only this mark tells its cuts from a rank's own "[rank3]:" text.
# Readers make the lines whole and show them as "[rankN]:" (nodeops.node.mpi_split.RankLines).
RANK_PREFIX = "\x1e[rank${rank}]:"
# torchrun echoes every rank's stdout and stderr into its own, each line with RANK_PREFIX
# (the ssh path's job.sh and the Slurm batch script alike)
TEE_ENV = {"PET_TEE": "3", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX}


def job_env(runner: str, env: Mapping[str, str], rdir: str) -> dict[str, str]:
    """What job.sh exports on a host beyond the env files setup wrote: the plan's env, the run
    dir, and for torchrun its per-rank log files (the guard reads failures from them)."""
    out = {**env, "NODEOPS_RUN_DIR": rdir}
    if runner == "torchrun":
        out.update({"PET_LOG_DIR": f"{rdir}/ranks", **TEE_ENV})
    return out


def run_config(run_id: str, hosts: Sequence[Mapping[str, Any]], runner: str, max_restarts: int,
               hang_timeout: float | None = None,
               recovery: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The supervisor's run.json. ``hosts``: ``{name, address, port, user, local, job}`` for every
    host in node-rank order (``local``: the chief itself; ``job``: it runs a job.sh; ``spare`` and
    ``nproc`` with restarts). ``hang_timeout``: seconds without progress before the hang watchdog
    fires (None: off). ``recovery``: ``{restarts, restart_on, min_nodes, backoff}`` (None: off)."""
    out = {"run_id": run_id, "hosts": [dict(h) for h in hosts], "pdsh": runner == "deepspeed",
           "agent_final": runner == "torchrun" and max_restarts == 0, "hang_timeout": hang_timeout}  # fmt: skip
    if recovery:
        out["recovery"] = dict(recovery)
    return out
