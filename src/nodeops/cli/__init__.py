"""The typer CLI. The only layer that prints and exits; everything below raises NodeopsError.

Command modules register themselves on ``app`` when imported. They import only typer at
module level, so ``nodeops --help`` stays fast.
"""

from typer.models import CommandInfo, TyperInfo

from nodeops.cli import check_cmds, jobs_cmds, launch_cmds, sandbox_cmds, setup_cmds, spec_cmds  # noqa: F401  (register commands)
from nodeops.cli.app import app, main

# `nodeops --help` in the order a user works: panels, and the commands in each, as listed here.
PANELS = {
    "Cluster": ["validate", "setup", "check"],
    "Runs": ["launch", "status", "logs", "stacks", "stop", "runs", "clean", "runner-prefix"],
    "Specs": ["render", "schema", "import-inventory", "import-hostfile"],
    "Sandbox": ["sandbox"],
}
_ORDER = [name for names in PANELS.values() for name in names]
_PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}


def _name(info: CommandInfo | TyperInfo) -> str:
    name = getattr(info, "name", None)
    if name:
        return str(name)
    group = getattr(info, "typer_instance", None)  # a sub-app added with app.add_typer
    if group is not None and group.info.name:
        return str(group.info.name)
    callback = getattr(info, "callback", None)
    return getattr(callback, "__name__", "").replace("_", "-")


_infos: list[CommandInfo | TyperInfo] = [*app.registered_commands, *app.registered_groups]
for _info in _infos:
    _info.rich_help_panel = _PANEL_OF[_name(_info)]  # a command missing from PANELS fails here, at import
app.registered_commands.sort(key=lambda info: _ORDER.index(_name(info)))

__all__ = ["PANELS", "app", "main"]
