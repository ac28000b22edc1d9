"""Where the shipped playbooks, roles and templates are at run time.

In a wheel they sit inside the package (``nodeops/playbooks``...); in a source checkout
or an editable install they are the top-level directories beside ``src/``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


@cache
def data_dir(name: str) -> Path:
    """Absolute path of a shipped data directory: 'playbooks', 'roles' or 'templates'."""
    for candidate in (_PKG / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"nodeops data directory {name!r} not found beside {_PKG}; reinstall nodeops")
