"""The typer CLI. The only layer that prints and exits; everything below raises NodeopsError.

Command modules register themselves on ``app`` when imported. They import only typer at
module level, so ``nodeops --help`` stays fast.
"""

from nodeops.cli import check_cmds, jobs_cmds, launch_cmds, sandbox_cmds, setup_cmds, spec_cmds  # noqa: F401  (register commands)
from nodeops.cli.app import app, main

__all__ = ["app", "main"]
