"""`nodeops sandbox up/status/down`: a local cluster of sshd containers."""

from __future__ import annotations

import enum
import time
from typing import Annotated

import typer

from nodeops.cli.app import CONTEXT, app, err, errors
from nodeops.sandbox import cluster as sandbox

sandbox_app = typer.Typer(
    name="sandbox",
    help="A local cluster of real sshd containers (Docker), to rehearse setup and launch on.",
    no_args_is_help=True,
    context_settings=CONTEXT,
)
app.add_typer(sandbox_app)


class Build(enum.StrEnum):
    auto = "auto"
    dockerfile = "dockerfile"
    debootstrap = "debootstrap"


NameOpt = Annotated[str, typer.Option("--name", help="Sandbox name; several can coexist.")]


def _say(message: str) -> None:
    err(f"==> {message}")


@sandbox_app.command(
    epilog=(
        "Example:\n\n    nodeops sandbox up -n 3\n\n"
        "    nodeops sandbox up --slurm --name slurm   # a Slurm cluster: sbatch through node1\n\n"
        "    ssh -F ~/.nodeops/sandbox/nodeops/ssh_config node1 sudo true\n\n"
        "    nodeops validate ~/.nodeops/sandbox/nodeops/cluster.yaml"
    )
)
def up(
    n: Annotated[int, typer.Option("-n", "--nodes", min=1, max=64, help="Number of nodes.")] = 3,
    name: NameOpt = "nodeops",
    subnet: Annotated[
        str | None,
        typer.Option(
            help="IPv4 subnet of the sandbox's Docker network (default: the first free /24 from 10.213.0.0/24)."
        ),
    ] = None,
    image: Annotated[str | None, typer.Option(help="Use your own node image (needs sshd, python3, sudo).")] = None,
    build: Annotated[Build, typer.Option(help="How to build the default image.")] = Build.auto,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Make it a Slurm cluster: Debian's slurmctld/slurmd/munge (22.05), node1 the controller and "
            "login node, a shared home, fake GPUs (2 on node1, 1 elsewhere). The spec uses `slurm:`.",
        ),
    ] = False,
) -> None:
    """Start N sshd containers, each with its own IP, a sudo user and pinned host keys.

    Writes a keypair, known_hosts, ssh_config and a ready resource spec (first node is the
    chief) to the sandbox's state dir and prints the spec's path. Running it again
    re-verifies the same sandbox. If it fails half-way, what it created is removed.
    The node image is built once (from Debian's packages when no registry answers) and cached.
    """

    with errors():
        t = time.monotonic()
        sb = sandbox.up(name=name, n=n, subnet=subnet, image=image, build=build.value, say=_say, slurm=slurm)
        for node in sb.nodes:
            err(f"    {node.name:8} {node.address:15} {node.container}")
        err(f"==> sandbox {name!r} is up: {len(sb.nodes)} node(s), ssh checked, in {time.monotonic() - t:.1f}s")
        err(f"    ssh:  ssh -F {sb.ssh_config} node1")
        err(f"    spec: nodeops validate {sb.spec_path}")
        typer.echo(str(sb.spec_path))


@sandbox_app.command(epilog="Example:\n\n    nodeops sandbox status\n\n    nodeops sandbox status --name ci")
def status(name: NameOpt = "nodeops") -> None:
    """Show the sandbox's nodes, their addresses and state. Exit 1 if it does not exist."""
    from rich.console import Console
    from rich.table import Table

    with errors():
        sb = sandbox.get(name)
        if not sb.nodes:
            others = [s for s in sandbox.all_sandboxes() if s != name]
            hint = f" (existing: {', '.join(others)})" if others else ""
            err(f"no sandbox named {name!r}{hint}; create one with `nodeops sandbox up`")
            raise typer.Exit(1)
        table = Table(title=f"sandbox {name}", title_justify="left")
        for col in ("node", "address", "state", "container"):
            table.add_column(col)
        for node in sb.nodes:
            style = "green" if node.state == "running" else "red"
            table.add_row(node.name, node.address, f"[{style}]{node.state}[/]", node.container)
        console = Console()
        console.print(table)
        console.print(f"spec: {sb.spec_path}\nssh:  ssh -F {sb.ssh_config} node1", highlight=False)


@sandbox_app.command(epilog="Example:\n\n    nodeops sandbox down\n\n    nodeops sandbox down --name ci")
def down(name: NameOpt = "nodeops") -> None:
    """Remove the sandbox's containers, network and state dir, found by their label.

    Nothing else is touched: other containers, networks and images stay. The cached node
    image is kept, so the next `up` is fast.
    """

    with errors():
        removed = sandbox.down(name)
        for r in removed:
            err(f"removed {r}")
        err(f"sandbox {name!r} is gone" if removed else f"no sandbox named {name!r}; nothing to do")
