#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: what a Python env holds, in one call (read-only).

Answers "is everything already as wanted?" for the python_env role: whether the env's
interpreter exists, the fingerprint of its last successful install, and its Python and
package versions (for the cross-node comparison).
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: python_env_state
short_description: Report a Python env's interpreter, install fingerprint and package versions
description:
  - Reads, in one call, what the python_env role needs to tell whether a Python env is already as wanted. It never
    changes anything.
  - Reports whether the env's interpreter C(PREFIX/bin/python) exists, and the fingerprint and versions hash that the
    last successful install recorded in O(fingerprint_file).
  - When the interpreter exists, it is run to list the env's Python version and installed packages (with
    C(importlib.metadata)), for the comparison of the nodes and for RV(drift). The node's system Python needs no
    extra package for this.
  - RV(drift) tells whether the packages changed since the last install, for example through a manual
    C(pip install).
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  prefix:
    description:
      - The env's prefix, the directory that holds C(bin/python) (a venv directory or a conda env directory).
    type: path
    required: true
  fingerprint_file:
    description:
      - File, relative to O(prefix), in which the last successful install was recorded.
      - Its first line is the install's fingerprint and its second line the RV(versions_hash) the install left.
      - A missing or unreadable file reads as empty.
    type: str
    default: .nodeops-installed
notes:
  - Read-only. It always reports C(changed=false), supports check mode and runs the same in check mode.
  - Fails when the interpreter exists but cannot list its packages (C(importlib.metadata) needs Python 3.8 or later).
"""

EXAMPLES = r"""
- name: Read the env's state (interpreter, last install, package versions)
  nodeops.cluster.python_env_state:
    prefix: ~/venvs/train
  register: env_state
  check_mode: false

- name: Install only when the env is missing, its inputs changed or its packages drifted
  ansible.builtin.include_tasks: install.yml
  when: >-
    not env_state.exists or env_state.fingerprint != wanted_fingerprint
    or env_state.drift

- name: Read the versions the install left
  nodeops.cluster.python_env_state:
    prefix: ~/venvs/train
  register: env_after
  check_mode: false
  when: not ansible_check_mode

- name: Record the fingerprint and the versions, after a successful install only
  ansible.builtin.copy:
    content: "{{ wanted_fingerprint }}\n{{ env_after.versions_hash | default('') }}\n"
    dest: ~/venvs/train/.nodeops-installed
    mode: "0644"
"""

RETURN = r"""
prefix:
  description: O(prefix), with C(~) and environment variables expanded.
  returned: always
  type: str
  sample: /home/ubuntu/venvs/train
exists:
  description: Whether C(PREFIX/bin/python) exists.
  returned: always
  type: bool
  sample: true
fingerprint:
  description: The recorded fingerprint (the first line of O(fingerprint_file)), or an empty string.
  returned: always
  type: str
  sample: "5f0c6a1e9d8b7c2a4e3f1d0b9a8c7e6f5d4c3b2a1f0e9d8c7b6a5f4e3d2c1b0a"
versions_recorded:
  description:
    - The versions hash recorded after the last install (the second line of O(fingerprint_file)), or an empty
      string.
  returned: always
  type: str
  sample: "9e1d7c3b5a2f4e6d8c0b1a3f5e7d9c2b4a6f8e0d1c3b5a7f9e2d4c6b8a0f1e3d"
versions:
  description:
    - The env's Python version on the first line, then one sorted C(name==version) line per installed package
      (names in lower case). Empty when the interpreter does not exist.
  returned: always
  type: str
  sample: "3.11.7\nnumpy==1.26.4\npip==24.0\ntorch==2.3.1"
versions_hash:
  description: The SHA-256 hex digest of RV(versions).
  returned: always
  type: str
  sample: "9e1d7c3b5a2f4e6d8c0b1a3f5e7d9c2b4a6f8e0d1c3b5a7f9e2d4c6b8a0f1e3d"
drift:
  description:
    - Whether the packages differ from those the last install left, that is a versions hash was recorded and
      RV(versions_hash) differs from it.
  returned: always
  type: bool
  sample: false
"""

import hashlib
import os

from ansible.module_utils.basic import AnsibleModule

SCRIPT = ("import sys, importlib.metadata as m; print(sys.version.split()[0]); "
          "print('\\n'.join(sorted({d.metadata['Name'].lower() + '==' + d.version for d in m.distributions()})))")


def main():
    module = AnsibleModule(
        argument_spec={"prefix": {"type": "path", "required": True},
                       "fingerprint_file": {"type": "str", "default": ".nodeops-installed"}},
        supports_check_mode=True,
    )
    prefix = module.params["prefix"]
    python = os.path.join(prefix, "bin", "python")
    result = {"changed": False, "prefix": prefix, "exists": os.path.exists(python), "fingerprint": "", "versions": "",
              "versions_recorded": ""}
    try:
        with open(os.path.join(prefix, module.params["fingerprint_file"])) as f:
            lines = f.read().split("\n")
        result["fingerprint"] = lines[0].strip()
        result["versions_recorded"] = lines[1].strip() if len(lines) > 1 else ""
    except (OSError, UnicodeDecodeError):
        pass
    if result["exists"]:
        rc, out, err = module.run_command([python, "-c", SCRIPT])
        if rc != 0:
            module.fail_json(msg="%s cannot list its packages: %s" % (python, err.strip()), **result)
        result["versions"] = out.strip()
    result["versions_hash"] = hashlib.sha256(result["versions"].encode("utf-8")).hexdigest()
    # A package changed by hand on this node since the last install (repaired by reinstalling).
    result["drift"] = bool(result["versions_recorded"]) and result["versions_recorded"] != result["versions_hash"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
