"""The root typer app, the error edge and the exit codes.

Imports here are kept to typer alone so that ``nodeops --help`` starts fast; each command
imports what it needs (pydantic, ansible_runner, ...) when it runs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from nodeops import __version__
from nodeops.cli.reports import print_fabric
from nodeops.errors import EXIT_INTERRUPTED, EXIT_SPEC, ExitWith, NodeopsError, SpecError
from nodeops.node.failures import one_prefix
from nodeops.node.stall import NOTE_MARK


def _plain_metavar(self: typer.core.TyperOption | typer.core.TyperArgument, ctx: object) -> str | None:
    """Help's type column the way click and every Unix tool write it: nothing for a flag, an
    upper-case word for a value (INTEGER, TEXT, PATH), the choices for a choice. typer 0.29's
    own (``<bool>``, ``<int>``, ``<list[str]>``) reads like a Python signature."""
    if self.metavar is not None:
        return self.metavar
    if getattr(self, "is_flag", False) or getattr(self, "count", False):
        return None
    label = self.display_type(ctx).strip("<>")  # type: ignore[arg-type]
    many = label.startswith("list[")
    label = label.removeprefix("list[").removesuffix("]") if many else label
    word = {"int": "INTEGER", "str": "TEXT", "float": "FLOAT", "Path": "PATH", "path": "PATH"}.get(label)
    shown = word or (f"[{label}]" if "|" in label else label.upper())
    return shown + ("..." if self.nargs != 1 else "")  # a list option repeats; each takes one


# Not typer's public API: pyproject.toml pins typer to the minor version this was written for, and
# a typer without these methods fails here, at import, rather than changing the help silently.
for _cls, _name in ((typer.core.TyperOption, "display_type_rich"), (typer.core.TyperArgument, "display_type_rich"),
                    (typer.core.TyperArgument, "_usage_display_name")):  # fmt: skip
    if not callable(getattr(_cls, _name, None)):
        raise ImportError(f"typer {typer.__version__}: {_cls.__name__}.{_name} is gone; see pyproject.toml's typer pin")
typer.core.TyperOption.display_type_rich = _plain_metavar  # type: ignore[method-assign]
typer.core.TyperArgument.display_type_rich = _plain_metavar  # type: ignore[method-assign,assignment]


def _usage_name(self: typer.core.TyperArgument) -> str:
    """The usage line's argument as click and man pages write it (``SPEC``, ``[RUN_ID]``);
    typer 0.29 writes ``{spec}``."""
    name = self.display_name_raw.upper()
    return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")


typer.core.TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]

EPILOG = (
    "Exit codes: 0 ok; 1 a host or check failed; 2 bad spec, hostfile or usage (nothing was run); "
    "3 the run finished its work, then a rank crashed in its teardown (the results are complete); "
    "124 hung (the hang watchdog stopped the run); 130 interrupted."
)
CONTEXT = {"help_option_names": ["-h", "--help"]}

SpecArg = Annotated[
    Path,
    typer.Argument(
        help="Resource spec (AutoDist YAML, extended), or an Ansible inventory source (YAML, INI, TOML, "
        "an executable script or a plugin config), told apart by content.",
        show_default=False,
    ),
]
GroupOpt = Annotated[
    str | None,
    typer.Option(
        "--group",
        help="With an Ansible inventory: the group whose hosts are the cluster (default: all).",
        show_default=False,
    ),
]

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


def write_file(path: Path, text: str) -> None:
    """Write an output file the user named; a path that cannot be written is a usage error
    (one line, exit 2), never a traceback."""
    try:
        path.write_text(text, encoding="utf-8")
    except IsADirectoryError:
        fail(f"error: {path} is a directory; give a file path", EXIT_SPEC)
    except FileNotFoundError:
        fail(f"error: {path}: the directory {path.parent} does not exist; create it first", EXIT_SPEC)
    except NotADirectoryError:
        fail(f"error: {path}: a part of {path.parent} is a file, not a directory", EXIT_SPEC)
    except OSError as e:
        fail(f"error: cannot write {path}: {e.strerror or e}", EXIT_SPEC)


def make_dir(path: Path) -> None:
    """Create an output directory the user named (and its parents), or exit 2 with why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        fail(f"error: {path}: it, or a part of it, exists and is not a directory", EXIT_SPEC)
    except OSError as e:
        fail(f"error: cannot create {path}: {e.strerror or e}", EXIT_SPEC)


def read_text_file(path: Path, what: str) -> str:
    """Read an input file the user named as UTF-8 text, or exit 2 with why not."""
    if path.is_dir():
        fail(f"error: {path} is a directory; give a {what}", EXIT_SPEC)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"error: {path}: no such file", EXIT_SPEC)
    except UnicodeDecodeError as e:
        fail(f"error: {path} is not UTF-8 text (byte {e.start}); is it really a {what}?", EXIT_SPEC)
    except OSError as e:
        fail(f"error: cannot read {path}: {e.strerror or e}", EXIT_SPEC)


@contextmanager
def errors() -> Iterator[None]:
    """The one place domain errors become messages on stderr and documented exit codes."""
    try:
        yield
    except ExitWith as e:  # a run's own outcome: its words as they are, its exit code
        if e.message:
            err(e.message)
        raise typer.Exit(e.exit_code) from None
    except SpecError as e:
        for issue in e.issues:
            err(str(issue))
        n = sum(1 for i in e.issues if i.severity == "error")
        fail(f"{n} error(s); nothing was run.", EXIT_SPEC)
    except NodeopsError as e:
        fail(f"error: {e}", e.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)


_RANK_PREFIX = re.compile(r"\[rank\d+\]:")


def emit_line(host: str, line: str) -> None:
    """One log line as `host [rankN]:...` (torchrun's rank lines) or `host | ...` (anything else);
    the supervisor's notices (a stall) as `==> ...` on stderr."""
    if line.startswith(NOTE_MARK):
        err(f"==> {line.removeprefix(NOTE_MARK)}")
        return
    line = one_prefix(line)
    sys.stdout.write(f"{host} {line}\n" if _RANK_PREFIX.match(line) else f"{host} | {line}\n")
    sys.stdout.flush()


class ConsoleSink:
    """The lifecycle's events on the terminal: progress and verdicts on stderr, results and log
    lines on stdout (the lifecycle itself never prints)."""

    def note(self, text: str) -> None:
        err(text)

    def out(self, text: str) -> None:
        typer.echo(text)

    def line(self, host: str, text: str) -> None:
        emit_line(host, text)

    def report(self, report: Any) -> None:

        print_fabric(report, stderr=True)


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # e.g. `nodeops schema | head`
        sys.stderr.close()
        sys.exit(0)
