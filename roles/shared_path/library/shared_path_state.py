#!/usr/bin/python
"""Compare a node's directory with the controller's manifest (read-only)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: shared_path_state
short_description: Compare a directory with a manifest of paths and content hashes
description:
  - Reads only the paths the manifest lists; files that exist only here (outputs a job wrote)
    never make the directory differ and are only counted. Changes nothing.
options:
  path:
    description: The directory on this node.
    type: path
    required: true
  manifest:
    description: What the lookup shared_path_manifest returned on the controller.
    type: dict
    required: true
  owner:
    description: Report whether the directory is owned by this user.
    type: str
    default: ""
"""

RETURN = r"""
exists: {description: whether the directory exists, type: bool, returned: always}
owned: {description: whether it is a directory owned by I(owner) (true when no owner is given), type: bool, returned: always}
same: {description: whether every manifest path is here with the same content, type: bool, returned: always}
missing: {description: how many manifest paths are missing here, type: int, returned: always}
differ: {description: how many differ in content, type: int, returned: always}
extra: {description: how many files are here that the manifest does not list (kept), type: int, returned: always}
summary: {description: one line for humans, type: str, returned: always}
"""

import os
import pwd

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nodeops_manifest import compare, summary


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
