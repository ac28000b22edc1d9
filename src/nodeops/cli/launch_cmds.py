"""`nodeops launch` and `nodeops runner-prefix`."""

from __future__ import annotations

import enum
import shlex
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from nodeops.backends.base import LaunchRequest
from nodeops.cli.app import CONTEXT, ConsoleSink, GroupOpt, SpecArg, app, errors, fail
from nodeops.errors import EXIT_SPEC
from nodeops.launch.launchers import runner_prefix as prefix
from nodeops.lifecycle.launch import launch as do_launch
from nodeops.setup import gpus
from nodeops.spec.loading import load_spec
from nodeops.spec.model import duration_seconds, hang_timeout_problem


class Via(enum.StrEnum):
    ssh = "ssh"
    ansible = "ansible"


class ScriptCommand(TyperCommand):
    """torchrun's and deepspeed's convention: options before the training script are nodeops',
    the script and everything after it are the script's; `--` before the script is optional.
    An unknown option before the script is an error (exit 2), never passed on silently."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # typer vendors its own click: look at the params' kind, not at a click class
        takes_value = {o for p in self.params if p.param_type_name == "option" and not getattr(p, "is_flag", False)
                       for o in p.opts}  # fmt: skip
        head, tail = list(args), []
        positionals, i = 0, 0
        while i < len(args):
            a = args[i]
            if a == "--":
                head, tail = args[:i], args[i + 1 :]
                break
            if a.startswith("-") and a != "-":
                i += 2 if a in takes_value else 1
                continue
            positionals += 1
            if positionals == 2:  # SPEC, then the script
                head, tail = args[:i], args[i:]
                break
            i += 1
        rest = super().parse_args(ctx, head)
        ctx.args = [*rest, *tail]
        return list(ctx.args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[--] SCRIPT [ARGS]..."]


@app.command(
    cls=ScriptCommand,
    context_settings={**CONTEXT, "allow_extra_args": True},
    epilog=(
        "Examples:\n\n    nodeops launch cluster.yaml train.py --lr 1e-3\n\n"
        "    nodeops launch --detach cluster.yaml -- train.py --lr 1e-3   # `--` is optional\n\n"
        "    nodeops launch cluster.yaml --script run.sh -- --epochs 2   # run.sh calls $NODEOPS_RUNNER train.py\n\n"
        "    nodeops launch --dry-run cluster.yaml train.py   # each host's command, env and files; starts nothing\n\n"
        "    nodeops launch --fabric-check cluster.yaml train.py   # measure the links first; a slow node stops it\n\n"
        "    nodeops launch aws_ec2.yml --group gpu -- train.py   # an Ansible inventory (here a plugin config)\n\n"
        "    nodeops launch slurm.yaml -- train.py   # backend: slurm: sbatch, then follow the job (as on ssh)\n\n"
        "    nodeops launch --hang-timeout 10m cluster.yaml train.py   # a silent hang names the stuck rank"
    ),
)
def launch(
    ctx: typer.Context,
    spec: SpecArg,
    script: Annotated[
        str | None, typer.Option(help="A bash script (in the workdir) that calls $NODEOPS_RUNNER train.py ...")
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Return once the job runs (ssh: every host started; Slurm: sbatch took it) and print "
            "the run id; see `nodeops status/logs/stop`.",
        ),
    ] = False,
    via: Annotated[
        Via, typer.Option(help="How to start the jobs: one ssh per host (like pdsh), or the launch.yml playbook.")
    ] = Via.ssh,
    no_check: Annotated[
        bool,
        typer.Option(
            "--no-check",
            help="Skip the preflight (ssh: from the chief, ports, versions, workdir; "
            "Slurm: the job's first step, the same probe in the allocation).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print each host's command line, environment (secrets masked), working dir and the "
            "files that would be shipped; start nothing, reach no host.",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="On a failure, also print torchrun's failure report.")
    ] = False,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync",
            help="First copy the workdir source to the nodes that differ (setup's "
            "shared_path role; outputs on the nodes are kept).",
        ),
    ] = False,
    fabric_check: Annotated[
        bool,
        typer.Option(
            "--fabric-check",
            help="Before starting, run `check --fabric`'s measurement (30 s budget); start nothing if a "
            "node is slow or a network.fabric threshold fails. On Slurm it is a step of the job, before "
            "training, on the nodes of its allocation.",
        ),
    ] = False,
    hang_timeout: Annotated[
        str | None,
        typer.Option(
            "--hang-timeout",
            metavar="DURATION",
            help="The hard hang timeout: when no rank prints anything (or touches $NODEOPS_PROGRESS_FILE) for "
            "this long (90, 90s, 10m, 1h), take every rank's stack, name the stuck ranks and stop the run (exit "
            "124). It counts from every node's first progress (start-up gets at least 5 min); at least 5s. "
            "Overrides launch.hang_timeout; 0 turns it off. Default: half the collective timeout (5m with NCCL, "
            "15m with gloo; --dry-run prints every timeout in order). Stalls are reported live within seconds "
            "whatever it is: the stall watch learns the run's pace and stops nothing.",
        ),
    ] = None,
    attach: Annotated[
        bool,
        typer.Option(
            "--attach",
            help="Follow the run until it ends: the default on every backend (ssh and Slurm); "
            "accepted for scripts that say so. Conflicts with --detach.",
        ),
    ] = False,
    group: GroupOpt = None,
) -> None:
    """Start training on every host: torchrun per host, or mpirun/deepspeed from the chief.

    Every line of every rank is streamed live as `host [rankN]: ...`. If any rank fails, every
    rank on every host is stopped (SIGTERM to the job's process group, then SIGKILL to whatever
    still carries the run's id) and the exit code is the failing rank's; the first failing
    host is named with its last lines. Ctrl-C stops everything and exits 130. Options before
    the script are nodeops'; the script and every argument after it reach the script literally.
    """

    hang = None if hang_timeout is None else duration_seconds(hang_timeout)
    if hang_timeout is not None and hang is None:
        fail(f"--hang-timeout {hang_timeout!r}: give seconds or a number with a unit, like 90, 90s, 10m or 1h", 2)
    if hang is not None and hang_timeout_problem(hang):
        fail(f"--hang-timeout {hang_timeout!r} is too short to mean a hang: {hang_timeout_problem(hang)}", 2)
    user_argv = list(ctx.args)
    if user_argv[:1] == ["--"]:
        user_argv = user_argv[1:]
    request = LaunchRequest(spec_path=spec, argv=user_argv, script=script, detach=detach, attach=attach,
                            via=via.value, check=not no_check, dry_run=dry_run, verbose=verbose, sync=sync,
                            fabric_check=fabric_check, hang_timeout=hang)  # fmt: skip
    with errors():
        do_launch(request, ConsoleSink(), group)


@app.command("runner-prefix", epilog="Example:\n\n    nodeops runner-prefix cluster.yaml --host node2")
def runner_prefix(
    spec: SpecArg,
    host: Annotated[str, typer.Option(help="Host name or address from the spec.")],
    run_id: Annotated[str, typer.Option(help="Rendezvous id for c10d.")] = "nodeops",
    group: GroupOpt = None,
) -> None:
    """Print the torchrun launcher prefix for one host (madengine's MAD_MULTI_NODE_RUNNER style).

    Append your script: `$(nodeops runner-prefix c.yaml --host node2) train.py --lr 1e-3`.
    """

    with errors():
        s = gpus.resolved(load_spec(spec, group)).spec
        node = next((n for n in s.nodes if host in (n.address, n.name)), None)
        if node is None:
            names = ", ".join(s.alias(n) for n in s.nodes)
            fail(f"error: --host {host} is not in the spec (hosts: {names})", EXIT_SPEC)
        if node.spare:
            fail(f"error: --host {host} is a spare: it has no node rank until a restart gives it one", EXIT_SPEC)
        typer.echo(shlex.join(prefix(s, node, run_id)))
