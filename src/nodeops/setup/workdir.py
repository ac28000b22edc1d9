"""The workdir manifest on the controller side (setup's shared_path role, check, launch).

The code is the collection's ``plugins/module_utils/nodeops_manifest.py``, loaded from the
shipped roles, so the role, ``check`` and ``launch`` compare a node with the source in
exactly one way: the files rsync would copy (same excludes), by content. Files that exist
only on a node (what a job wrote) never count as a difference.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from nodeops.errors import NodeopsError
from nodeops.resources import data_dir
from nodeops.spec.model import LoadedSpec, controller_path

# Never copied or compared: .deepspeed_env in the workdir is managed on the chief by deepspeed_env.
ALWAYS_EXCLUDED = [".deepspeed_env"]


def manifest_path() -> Path:
    return data_dir("plugins") / "module_utils" / "nodeops_manifest.py"


@cache
def manifest_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nodeops_manifest", manifest_path())
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def source_path(loaded: LoadedSpec) -> Path:
    """The controller-side source directory as the spec gives it (default: the spec's directory)."""
    wd = loaded.spec.workdir
    return Path(controller_path(wd.source, loaded.spec_dir)) if wd is not None and wd.source else loaded.spec_dir


def source_dir(loaded: LoadedSpec) -> Path | None:
    """The source of an rsync workdir, or None when the workdir is not copied from here."""
    wd = loaded.spec.workdir
    return source_path(loaded) if wd is not None and wd.sync == "rsync" else None


def excludes(loaded: LoadedSpec) -> list[str]:
    """What setup's copy, and every comparison with the source, leave out."""
    wd = loaded.spec.workdir
    return [*(wd.exclude if wd else []), *ALWAYS_EXCLUDED]


def source_manifest(loaded: LoadedSpec) -> dict[str, Any] | None:
    """What the source holds now, or None when the workdir is not rsync-synced."""
    src = source_dir(loaded)
    if src is None:
        return None
    try:
        doc: dict[str, Any] = manifest_module().build(str(src), excludes(loaded))
    except OSError as e:
        raise NodeopsError(f"cannot list the workdir source: {e}") from e
    return doc
