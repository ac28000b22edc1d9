#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: write a few small files into one directory in a single call.

Each file is written (atomically: a temp file in the same directory, then rename) only
when its content or mode differs, so a no-op run reads and changes nothing. Secret files
are never shown in diffs or logs.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: nccl_env_files
short_description: Write small files into one directory, each only when it differs
description:
  - Writes the files of O(files) and O(secret_files) into the directory O(dir) in a single call, creating O(dir)
    when it is missing.
  - A file is written only when its content (compared byte for byte, as UTF-8) or its mode differs from the wanted
    one. It is written atomically, through a temporary file in O(dir) and a rename, so a reader never sees half a
    file. A run that finds every file in place only reads them and reports no change.
  - The content of O(secret_files) is never logged and never shown in a diff.
  - Files in O(dir) that are not listed are left alone.
  - The nccl_env role uses it to write C(env.sh), which the launch sources, and C(secrets.env).
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  dir:
    description:
      - The directory that holds the files. C(~) and environment variables are expanded on the managed node.
      - Created, with its parents, when missing. The mode of an existing directory is not changed.
    type: path
    required: true
  dir_mode:
    description:
      - Octal mode of O(dir) when this module creates it (the umask applies).
    type: str
    default: "0700"
  files:
    description:
      - Files whose content is not secret. A change to one of them is shown with C(--diff).
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description:
          - File name in O(dir). It must be a plain name, not a path (no C(/), not C(.) or C(..)); otherwise the
            module fails.
        type: str
        required: true
      content:
        description:
          - The full content of the file.
        type: str
        required: true
      mode:
        description:
          - Octal mode of the file. C(0644) when omitted.
          - A file whose mode differs is rewritten with this mode.
        type: str
  secret_files:
    description:
      - Files whose content is secret (tokens, passwords). Their content is never logged or diffed; a change only
        names the file in RV(written).
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description:
          - File name in O(dir). It must be a plain name, not a path (no C(/), not C(.) or C(..)); otherwise the
            module fails.
        type: str
        required: true
      content:
        description:
          - The full content of the file. Secret, never logged.
        type: str
        required: true
      mode:
        description:
          - Octal mode of the file. C(0600) when omitted.
          - A file whose mode differs is rewritten with this mode.
        type: str
notes:
  - Supports check mode. Nothing is created or written, and RV(written) names the files that would be written.
  - Supports diff mode, for the files of O(files) only.
  - Creating O(dir) alone also reports a change, with an empty RV(written).
"""

EXAMPLES = r"""
- name: Write the env file that launch sources, and the secrets file (mode 0600)
  nodeops.cluster.nccl_env_files:
    dir: "~/.nodeops/{{ nccl_env_cluster }}"
    files:
      - name: env.sh
        mode: "0644"
        content: "{{ lookup('ansible.builtin.template', 'env.sh.j2') }}"
    secret_files:
      - name: secrets.env
        mode: "0600"
        content: "{{ lookup('ansible.builtin.template', 'secrets.env.j2') }}"

- name: Write one plain file into a shared directory
  nodeops.cluster.nccl_env_files:
    dir: /opt/train/env
    dir_mode: "0755"
    files:
      - name: nccl.sh
        content: |
          export NCCL_SOCKET_IFNAME=eth0
          export NCCL_DEBUG=WARN
"""

RETURN = r"""
dir:
  description: O(dir) as the module used it, with C(~) and environment variables expanded.
  returned: always
  type: str
  sample: /home/ubuntu/.nodeops/cluster
written:
  description:
    - Names of the files written, or that would be written in check mode, those of O(files) first, then those of
      O(secret_files). Empty when every file was already in place.
  returned: always
  type: list
  elements: str
  sample: [env.sh, secrets.env]
diff:
  description:
    - One entry per file of O(files) that was written (or would be, in check mode), shown with C(--diff).
      Files of O(secret_files) never appear.
  returned: always
  type: list
  elements: dict
  contains:
    before:
      description: The file's content before the run (empty when it was missing).
      returned: always
      type: str
      sample: "export NCCL_SOCKET_IFNAME=eth1\n"
    after:
      description: The file's wanted content.
      returned: always
      type: str
      sample: "export NCCL_SOCKET_IFNAME=eth0\n"
    before_header:
      description: The file's path.
      returned: always
      type: str
      sample: /home/ubuntu/.nodeops/cluster/env.sh
    after_header:
      description: The file's path.
      returned: always
      type: str
      sample: /home/ubuntu/.nodeops/cluster/env.sh
"""

import os
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.nodeops.cluster.plugins.module_utils.nodeops_files import atomic_write


def _file_spec(secret):
    return {"name": {"type": "str", "required": True}, "content": {"type": "str", "required": True, "no_log": secret},
            "mode": {"type": "str"}}


def _state(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data, stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None, None


def main():
    module = AnsibleModule(
        argument_spec={
            "dir": {"type": "path", "required": True},
            "dir_mode": {"type": "str", "default": "0700"},
            "files": {"type": "list", "elements": "dict", "default": [], "options": _file_spec(False)},
            # The secret is each file's content, whose sub-option is no_log. The names and modes are
            # not: no_log on the whole list would mask every output string equal to one of them
            # (each "0600" and "env.sh" in the result), so the list says no_log=False on purpose.
            "secret_files": {"type": "list", "elements": "dict", "default": [], "options": _file_spec(True),
                             "no_log": False},
        },
        supports_check_mode=True,
    )
    d = module.params["dir"]
    changed, written, diffs = False, [], []
    if not os.path.isdir(d):
        changed = True
        if not module.check_mode:
            os.makedirs(d, mode=int(module.params["dir_mode"], 8), exist_ok=True)
    entries = [(f, False, "0644") for f in module.params["files"]]
    entries += [(f, True, "0600") for f in module.params["secret_files"]]
    for f, secret, default_mode in entries:
        name = f["name"]
        if os.sep in name or name in ("", ".", ".."):
            module.fail_json(msg="nccl_env_files: %r is not a plain file name" % name)
        path = os.path.join(d, name)
        want = f["content"].encode("utf-8")
        mode = int(f.get("mode") or default_mode, 8)
        have, have_mode = _state(path)
        if have == want and have_mode == mode:
            continue
        changed = True
        written.append(name)
        if not secret:
            diffs.append({"before_header": path, "after_header": path,
                          "before": (have or b"").decode("utf-8", "replace"), "after": f["content"]})  # fmt: skip
        if not module.check_mode:
            atomic_write(path, want, mode)
    module.exit_json(changed=changed, dir=d, written=written, diff=diffs)


if __name__ == "__main__":
    main()
