"""What a command takes as its cluster: a resource spec file, or an Ansible inventory source,
told apart by content. Above both readers (``spec`` and ``inventory_source``), so neither
imports the other's caller."""

from __future__ import annotations

from pathlib import Path

from nodeops.errors import SpecError, SpecIssue
from nodeops.spec import inventory as inventory_source
from nodeops.spec.load import load_spec_file
from nodeops.spec.model import LoadedSpec


def load_spec(path: str | Path, group: str | None = None) -> LoadedSpec:
    """Load and validate a spec file, or an Ansible inventory source (detected by content; its
    hosts of ``group``, default all). Raises :class:`SpecError` (exit 2) on any problem."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a spec file" if p.is_dir() else "no such file"
        raise SpecError([SpecIssue(str(p), 1, 1, "<file>", what, "give the path of a spec YAML file")])
    if inventory_source.looks_like_inventory(p):
        loaded: LoadedSpec = inventory_source.load_inventory(p, group)
        return loaded
    if group is not None:
        raise SpecError([SpecIssue("--group", 0, 0, "--group", f"{p} is a resource spec, not an Ansible inventory",
                                   "use --group only with an inventory source")])  # fmt: skip
    return load_spec_file(p)
