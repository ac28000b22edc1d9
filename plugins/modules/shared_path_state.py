#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Compare a node's directory with the controller's manifest (read-only)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: shared_path_state
short_description: Compare a directory with a manifest of paths and content hashes
description:
  - Compares the directory O(path) on the managed node with O(manifest), what the lookup
    P(nodeops.cluster.shared_path_manifest#lookup) built from the source on the controller. Changes nothing.
  - Reads only the paths the manifest lists. A file is the same when it is a regular file with the size and SHA-256
    the manifest gives; a symlink is the same when it points to the same target.
  - Files that exist only here (checkpoints, logs, caches a job wrote) never make the directory differ; they are only
    counted in RV(extra). Names that the manifest's exclude list gives as plain names are not counted.
  - Also reports whether the directory is owned by O(owner), so the caller can fix ownership only where needed.
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  path:
    description:
      - The directory on this node. C(~) and environment variables are expanded.
    type: path
    required: true
  manifest:
    description:
      - The manifest returned by the lookup P(nodeops.cluster.shared_path_manifest#lookup) on the controller.
      - A dict with C(files) (relative path to C([size, sha256]), or to C([link, target]) for a symlink), and
        C(source), C(exclude) and C(digest).
    type: dict
    required: true
  owner:
    description:
      - A user name. When given, RV(owned) tells whether O(path) is owned by this user.
      - When empty, RV(owned) only tells whether O(path) is a directory.
    type: str
    default: ""
notes:
  - Read-only. It always reports C(changed=false), supports check mode and runs the same in check mode.
  - The sample lists hold at most 10 relative paths each, in sorted order.
  - As the result holds RV(path), Ansible adds the usual file attributes of an existing O(path) to it (C(uid),
    C(gid), C(owner), C(group), C(mode), C(state) and C(size)).
"""

EXAMPLES = r"""
- name: List and hash what the source holds, once, on the controller
  ansible.builtin.set_fact:
    workdir_manifest: "{{ lookup('nodeops.cluster.shared_path_manifest', '/src/train', exclude=['.git', 'outputs']) }}"
  run_once: true
  check_mode: false

- name: Compare each node's directory with the source
  nodeops.cluster.shared_path_state:
    path: /shared/train
    manifest: "{{ workdir_manifest }}"
    owner: ubuntu
  register: workdir_state
  check_mode: false

- name: Fail unless the node holds the source
  ansible.builtin.assert:
    that: workdir_state.same
    fail_msg: "/shared/train on {{ inventory_hostname }} does not hold the source: {{ workdir_state.summary }}"
    quiet: true
"""

RETURN = r"""
path:
  description: O(path), with C(~) and environment variables expanded.
  returned: always
  type: str
  sample: /shared/train
source:
  description: The controller-side source directory named in the manifest.
  returned: always
  type: str
  sample: /home/me/src/train
digest:
  description: The manifest's digest (a short hash of all its entries).
  returned: always
  type: str
  sample: 3c9d2f0a41b7e6d5
exists:
  description: Whether O(path) exists and is a directory.
  returned: always
  type: bool
  sample: true
owned:
  description:
    - Whether O(path) is a directory owned by O(owner); without O(owner), whether O(path) is a directory.
      False when O(owner) is not a known user.
  returned: always
  type: bool
  sample: true
same:
  description:
    - Whether every path of the manifest is here with the same content (false when the directory does not exist).
  returned: always
  type: bool
  sample: false
files:
  description: How many paths the manifest lists.
  returned: always
  type: int
  sample: 42
missing:
  description: How many of the manifest's paths are missing here (all of them when the directory does not exist).
  returned: always
  type: int
  sample: 1
differ:
  description: How many of the manifest's paths are here with other content, another kind, or another link target.
  returned: always
  type: int
  sample: 2
extra:
  description: How many files are here that the manifest does not list (outputs; they are kept).
  returned: always
  type: int
  sample: 3
missing_sample:
  description: Up to 10 of the missing paths, relative to O(path).
  returned: always
  type: list
  elements: str
  sample: [train.py]
differ_sample:
  description: Up to 10 of the paths that differ, relative to O(path).
  returned: always
  type: list
  elements: str
  sample: [configs/ds.json, model.py]
extra_sample:
  description: Up to 10 of the files only here, relative to O(path).
  returned: always
  type: list
  elements: str
  sample: [outputs/log.txt]
summary:
  description: One line for humans, what differs, or that the directory holds the source.
  returned: always
  type: str
  sample: >-
    1 file(s) missing (train.py); 2 file(s) differ from the source (configs/ds.json, model.py);
    3 file(s) only here (outputs, kept)
"""

import os
import pwd

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.nodeops.cluster.plugins.module_utils.nodeops_manifest import compare, summary


def main():
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True}, "manifest": {"type": "dict", "required": True},
                       "owner": {"type": "str", "default": ""}},
        supports_check_mode=True,
    )
    path, owner = module.params["path"], module.params["owner"]
    report = compare(path, module.params["manifest"])
    owned = report["exists"]
    if owned and owner:
        try:
            owned = os.stat(path).st_uid == pwd.getpwnam(owner).pw_uid
        except KeyError:
            owned = False
    report.update(changed=False, owned=owned, summary=summary(report))
    module.exit_json(**report)


if __name__ == "__main__":
    main()
