"""The root typer app, the error edge and the exit codes.

Imports here are kept to typer alone so that ``nodeops --help`` starts fast; each command
imports what it needs (pydantic, ansible_runner, ...) when it runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, NoReturn

import typer

from nodeops import __version__
from nodeops.errors import EXIT_INTERRUPTED, EXIT_SPEC, NodeopsError, SpecError

EPILOG = "Exit codes: 0 ok; 1 a host or check failed; 2 bad spec, hostfile or usage (nothing was run); 130 interrupted."
CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="nodeops",
    help="Prepare GPU machines and launch multi-node PyTorch training on them, from one resource spec.",
    no_args_is_help=True,
    context_settings=CONTEXT,
    epilog=EPILOG,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nodeops {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Prepare GPU machines and launch multi-node PyTorch training on them, from one resource spec."""


def err(message: str) -> None:
    typer.echo(message, err=True)


def fail(message: str, code: int) -> NoReturn:
    err(message)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    """The one place domain errors become messages on stderr and documented exit codes."""
    try:
        yield
    except SpecError as e:
        for issue in e.issues:
            err(str(issue))
        n = sum(1 for i in e.issues if i.severity == "error")
        fail(f"{n} error(s); nothing was run.", EXIT_SPEC)
    except NodeopsError as e:
        fail(f"error: {e}", e.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # e.g. `nodeops schema | head`
        sys.stderr.close()
        sys.exit(0)
