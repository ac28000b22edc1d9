"""Where the shipped playbooks, roles and templates are at run time.

In a wheel they sit inside the package (``nodeops/playbooks``...); in a source checkout
or an editable install they are the top-level directories beside ``src/``.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def nodeops_home() -> Path:
    """nodeops' own state on this machine: ``$NODEOPS_HOME``, else ``~/.nodeops``."""
    return Path(os.environ.get("NODEOPS_HOME") or Path.home() / ".nodeops")


@cache
def data_dir(name: str) -> Path:
    """Absolute path of a shipped data directory: 'playbooks', 'roles', 'plugins' or 'templates'."""
    for candidate in (_PKG / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"nodeops data directory {name!r} not found beside {_PKG}; reinstall nodeops")


def collection_root() -> Path:
    """The nodeops.cluster collection: galaxy.yml, meta/, plugins/, roles/, playbooks/."""
    return data_dir("roles").parent


def collections_path(base: Path) -> Path:
    """An Ansible collections path under ``base`` that holds nodeops.cluster: a symlink to the
    shipped collection, replaced atomically when it points elsewhere. The CLI's runs, molecule
    and the tests resolve ``nodeops.cluster.*`` through it. Each source tree (or installed
    package) gets its own dir, ``base/<hash of its path>``: two trees used at once under one
    home (a clone beside a checkout) never turn the other's link away mid-play."""
    target = str(collection_root())
    root = base / hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    link = root / "ansible_collections" / "nodeops" / "cluster"
    if not (link.is_symlink() and os.readlink(link) == target):
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".cluster-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    return root
