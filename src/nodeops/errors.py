"""Error types shared by every layer. Only the CLI turns them into output and exit codes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Documented exit codes (docs/launch.md, "Exit codes"); the CLI is the only place that uses them.
EXIT_OK = 0
EXIT_FAILURE = 1  # a runtime failure on a host, or a check that failed
EXIT_SPEC = 2  # bad spec, bad hostfile or bad command-line usage; nothing was run
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec: where it is, which field, what is wrong and how to fix it."""

    file: str
    line: int
    col: int
    field: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}: " if self.line else ""  # line 0: a command-line option
        text = f"{where}{self.severity}: {self.field}: {self.message}"
        return f"{text} (fix: {self.fix})" if self.fix else text


class NodeopsError(Exception):
    """A failure the user can act on. ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_FAILURE


class ControllerLimitError(NodeopsError):
    """This machine's own limit (open files, processes) is too low for the fan-out a command needs."""


class SandboxError(NodeopsError):
    """The local sandbox cluster (Docker) could not be built, started or reached."""


class SpecError(NodeopsError):
    """The spec (or a hostfile) is invalid. Raised before anything touches a host."""

    exit_code = EXIT_SPEC

    def __init__(self, issues: list[SpecIssue]) -> None:
        self.issues = issues
        errors = [i for i in issues if i.severity == "error"]
        super().__init__(f"{len(errors)} problem(s) in the spec:\n" + "\n".join(str(i) for i in errors))


class ExitWith(NodeopsError):
    """A run's outcome that ends the command with ``code``: the message (if any) is printed as it
    is, with no ``error:`` prefix. Raised by the lifecycle and backends instead of exiting."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.exit_code = code
        self.message = message


class UsageError(NodeopsError):
    """The command line asks for something this spec or backend cannot do; nothing was run."""

    exit_code = EXIT_SPEC
