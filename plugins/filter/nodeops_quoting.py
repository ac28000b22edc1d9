# SPDX-License-Identifier: Apache-2.0
"""Bash quoting filters: the collection's one quoting function per bash target
(``plugins/module_utils/nodeops_shell.py``, the same code the nodeops CLI quotes with).

- ``nodeops_sh_word``: one bash word, nothing expands.
- ``nodeops_sh_path``: a path, a leading ``~/`` as the remote ``$HOME``.
- ``nodeops_sh_expand``: an AutoDist shared_envs value: ``$NAME``/``${NAME}`` expand, the rest is literal.
- ``nodeops_sh_run_word``: ``nodeops_sh_word``, with ``@@HOME@@`` as the remote ``"$HOME"`` (launch's run files).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: nodeops_sh_word
short_description: Quote a value as one bash word (the nodeops quoting functions)
description:
  - C(nodeops_sh_word) quotes a value as one bash word that is exactly the value.
  - C(nodeops_sh_path) does the same, with a leading C(~/) meaning the remote C($HOME).
  - C(nodeops_sh_expand) quotes an AutoDist shared_envs value; only C($NAME) and C(${NAME}) expand.
  - C(nodeops_sh_run_word) is C(nodeops_sh_word) with C(@@HOME@@) as the remote C("$HOME").
options:
  _input:
    description: The value.
    type: raw
    required: true
"""

import importlib.util
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError


def load_module_util(name: str) -> Any:
    """A stdlib-only file of this collection's plugins/module_utils, by path (it works from a
    collections path and from the nodeops package's copy alike)."""
    path = Path(__file__).resolve().parent.parent / "module_utils" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_nodeops_{name}", path)
    if spec is None or spec.loader is None:
        raise AnsibleFilterError(f"nodeops quoting filters: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_shell = load_module_util("nodeops_shell")


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"nodeops_sh_word": _shell.sh_word, "nodeops_sh_path": _shell.sh_path,
                "nodeops_sh_expand": _shell.sh_expand, "nodeops_sh_run_word": _shell.sh_run_word}  # fmt: skip
