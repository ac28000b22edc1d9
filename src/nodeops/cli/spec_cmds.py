"""Spec commands: validate, render, schema, import-hostfile, import-inventory. None of them touches a host."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nodeops import backends
from nodeops.backends import render_files as do_render
from nodeops.cli.app import GroupOpt, SpecArg, app, err, errors, fail, make_dir, read_text_file, write_file
from nodeops.errors import EXIT_SPEC, SpecError
from nodeops.setup import gpus
from nodeops.setup.render import controller_issues
from nodeops.spec import inventory as inventory_source
from nodeops.spec.hostfile import spec_from_hostfile
from nodeops.spec.loading import load_spec
from nodeops.spec.model import json_schema

if TYPE_CHECKING:
    from nodeops.spec.model import LoadedSpec


def _print_warnings(loaded: LoadedSpec) -> None:
    for w in loaded.warnings:
        err(str(w))


@app.command(
    epilog="Example:\n\n    nodeops validate cluster.yaml\n\n    nodeops validate cluster.yaml --json | jq .errors",
)
def validate(
    spec: SpecArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print problems as JSON on stdout.")] = False,
    group: GroupOpt = None,
) -> None:
    """Check a spec and report every problem at once as `file:line:col: field: problem (fix: ...)`.

    Exit 0 when valid (warnings may still be printed), 2 when not. Nothing is run anywhere.
    """

    if as_json:
        try:
            loaded = load_spec(spec, group)
            issues, ok = [*loaded.warnings, *controller_issues(loaded, os.environ, "warning")], True
        except SpecError as e:
            issues, ok = e.issues, False
        rows = [i.__dict__ for i in issues]
        typer.echo(
            json.dumps(
                {
                    "file": str(spec),
                    "valid": ok,
                    "errors": [r for r in rows if r["severity"] == "error"],
                    "warnings": [r for r in rows if r["severity"] == "warning"],
                },
                indent=2,
            )
        )
        raise typer.Exit(0 if ok else EXIT_SPEC)
    with errors():
        loaded = load_spec(spec, group)
        _print_warnings(loaded)
        # valid, but this machine lacks something setup/launch will need: said now, with its line
        for issue in controller_issues(loaded, os.environ, "warning"):
            err(str(issue))
        typer.echo(f"{spec}: valid: {backends.for_spec(loaded.spec).summary(loaded)}")


@app.command(
    epilog="Example:\n\n    nodeops render cluster.yaml -o out/\n\n    ssh -F out/ssh_config node-1 hostname",
)
def render(
    spec: SpecArg,
    out: Annotated[Path, typer.Option("-o", "--out", help="Directory to write into (created if missing).")],
    group: GroupOpt = None,
) -> None:
    """Write the Ansible inventory, ssh_config, DeepSpeed hostfile and .deepspeed_env for a spec.

    Output is deterministic. Only these files in OUT are written; nothing else is touched,
    and no host is contacted. Secret env values are never written.
    """

    with errors():
        loaded = gpus.resolved(load_spec(spec, group), required=False)  # gpus: auto, as the last setup found them
        _print_warnings(loaded)
        rendered = do_render(loaded, os.environ)
        if out.exists() and not out.is_dir():
            fail(f"error: {out} exists and is not a directory", EXIT_SPEC)
        make_dir(out)
        for name, content in rendered.files.items():
            write_file(out / name, content)
        for w in rendered.warnings:
            err(f"warning: {w}")
        typer.echo(f"wrote {', '.join(rendered.files)} to {out}/")


@app.command(epilog="Example:\n\n    nodeops schema -o nodeops.schema.json")
def schema(
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Write to a file instead of stdout.")] = None,
) -> None:
    """Print the resource spec's JSON Schema, for editor completion and validation.

    With the YAML language server, add `# yaml-language-server: $schema=nodeops.schema.json`
    at the top of a spec.
    """

    text = json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        write_file(out, text)
        typer.echo(f"wrote {out}", err=True)


@app.command(
    "import-hostfile",
    epilog=(
        "Example:\n\n    nodeops import-hostfile /job/hostfile --user ubuntu"
        " --key-file ~/.ssh/id_ed25519 -o cluster.yaml"
    ),
)
def import_hostfile(
    hostfile: Annotated[Path, typer.Argument(help="DeepSpeed hostfile (`host slots=N` lines).", show_default=False)],
    user: Annotated[str | None, typer.Option(help="ssh user on every node.")] = None,
    key_file: Annotated[str | None, typer.Option(help="Private key for the nodes.")] = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="sshd port on the nodes.")] = 22,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Spec file to write (default: stdout).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Turn a DeepSpeed hostfile into a resource spec. The first host becomes the chief.

    Parsing follows DeepSpeed's own rules (comments, CRLF, `slots=` after the host); GPUs are
    numbered 0..slots-1 on each host. Hosts with `slots=0` run nothing and are left out.
    """

    with errors():
        if out is not None and out.exists() and not force:
            fail(f"error: {out} exists; pass --force to overwrite it", EXIT_SPEC)
        text, warnings = spec_from_hostfile(
            read_text_file(hostfile, "hostfile"), str(hostfile), user=user, key_file=key_file, port=port
        )
        for w in warnings:
            err(f"warning: {w}")
        if out is None:
            sys.stdout.write(text)
        else:
            write_file(out, text)
            typer.echo(f"wrote {out}", err=True)


@app.command(
    "import-inventory",
    epilog=(
        "Examples:\n\n    nodeops import-inventory inventory.yml -o cluster.yaml\n\n"
        "    nodeops import-inventory aws_ec2.yml --group gpu_nodes -o cluster.yaml"
    ),
)
def import_inventory(
    source: Annotated[
        Path,
        typer.Argument(help="Ansible inventory: YAML, INI, TOML, a script or a plugin config.", show_default=False),
    ],
    group: GroupOpt = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Spec file to write (default: stdout).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Write the resource spec equivalent to an Ansible inventory (every command also takes the
    inventory itself; this gives a spec to edit and keep).

    Read by Ansible's own inventory code (group_vars/ and host_vars/ beside it included); the
    mapping is the table in docs/spec.md ("Ansible inventories as input"). Nothing is contacted
    except what a dynamic inventory queries.
    """

    with errors():
        if out is not None and out.exists() and not force:
            fail(f"error: {out} exists; pass --force to overwrite it", EXIT_SPEC)
        if not source.is_file():
            fail(f"error: {source}: no such file", EXIT_SPEC)
        text = inventory_source.spec_text(source, group)
        if out is None:
            sys.stdout.write(text)
        else:
            write_file(out, text)
            typer.echo(f"wrote {out}", err=True)
