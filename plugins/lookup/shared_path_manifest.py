# SPDX-License-Identifier: Apache-2.0
"""Lookup ``shared_path_manifest``: the manifest of a controller-side source directory.

    lookup('shared_path_manifest', '/path/to/source', exclude=['.git', '__pycache__'])

Returns ``{version, source, exclude, files: {relpath: [size, sha256] | ['link', target]}, digest}``.
The file list comes from an rsync dry run with the same excludes as the role's copy. The code
is the role's ``module_utils/nodeops_manifest.py``, the same file the nodes compare with.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: shared_path_manifest
short_description: The manifest (paths and content hashes) of a controller-side directory
description:
  - Lists what rsync would copy from the directory (honouring I(exclude)) and hashes each file.
options:
  _terms:
    description: The source directory on the controller.
    required: true
  exclude:
    description: rsync --exclude patterns.
    type: list
    elements: str
    default: []
"""

import importlib.util
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase


def _manifest_module() -> Any:
    path = Path(__file__).resolve().parent.parent / "module_utils" / "nodeops_manifest.py"
    spec = importlib.util.spec_from_file_location("nodeops_manifest", path)
    if spec is None or spec.loader is None:
        raise AnsibleLookupError(f"shared_path_manifest: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[Any]:
        self.set_options(var_options=variables, direct=kwargs)
        exclude = [str(e) for e in self.get_option("exclude") or []]
        manifest = _manifest_module()
        out = []
        for term in terms:
            source = str(term)
            if not Path(source).is_dir():
                raise AnsibleLookupError(f"shared_path_manifest: {source} is not a directory on the controller")
            try:
                out.append(manifest.build(source, exclude))
            except OSError as e:
                raise AnsibleLookupError(f"shared_path_manifest: {e}") from e
        return out
