#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: ssh from this host to each target, in parallel, with BatchMode and strict
host key checking; fail naming every target that does not answer and ssh's reason."""

from __future__ import annotations

DOCUMENTATION = r"""
module: ssh_mesh_check
short_description: Check passwordless ssh with pinned host keys to a list of targets
description:
  - Runs C(ssh ... true) from this host to each target of O(targets), with C(BatchMode=yes) (no password or
    passphrase prompt) and C(StrictHostKeyChecking=yes) (the target's host key must already be in known_hosts),
    using the private key O(key).
  - The targets are probed in parallel, up to 8 at a time, starting with the one after O(start_after) in the list.
    When every node checks every other (a full mesh), each then starts at a different target, so no target gets
    more than about 8 new connections at once, below sshd's C(MaxStartups) (10:30:100 by default, so past 10
    connections not yet authenticated sshd drops new ones at random).
  - Fails when any target does not answer, naming every such target with the last line ssh wrote to stderr.
  - Changes nothing on any host.
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  targets:
    description:
      - The hosts to ssh to. Each is a dict with C(name) (the name used in messages) and C(address) (what ssh
        connects to), and optionally C(port) (22 when omitted) and C(user) (when omitted, ssh picks the user, from
        its configuration or the account the module runs as).
    type: list
    elements: dict
    required: true
  key:
    description:
      - Private key to authenticate with (C(ssh -i)), on this host. C(~) is expanded.
    type: path
    required: true
  start_after:
    description:
      - The name of this host in O(targets) (its C(name)); the probes start with the target after it and wrap
        around. When it is not in the list, the probes start with the first target.
    type: str
    default: ""
  timeout:
    description:
      - ssh's C(ConnectTimeout), in seconds.
      - A probe still running O(timeout) + 20 seconds after it started makes the module fail.
    type: int
    default: 10
notes:
  - Supports check mode, in which it runs no ssh and returns C(skipped=true).
  - Needs the C(ssh) client on the host it runs on.
"""

EXAMPLES = r"""
- name: Check ssh from the chief to every node
  nodeops.cluster.ssh_mesh_check:
    key: ~/.ssh/id_ed25519
    targets:
      - name: node0
        address: 10.0.0.11
      - name: node1
        address: 10.0.0.12
        port: 2222
        user: ubuntu
    timeout: 5

- name: Check ssh from the connecting hosts to every node
  nodeops.cluster.ssh_mesh_check:
    key: "{{ ssh_mesh_key_path }}"
    targets: "{{ lookup('ansible.builtin.template', 'targets.j2') | from_json }}"
    start_after: "{{ inventory_hostname }}"
  when: ssh_mesh_verify | bool and _ssh_mesh_connects
"""

RETURN = r"""
checked:
  description: How many targets were probed (also returned when the module fails).
  returned: when not in check mode
  type: int
  sample: 4
skipped:
  description: Always true; no ssh is run in check mode.
  returned: in check mode
  type: bool
  sample: true
msg:
  description: Why nothing was checked.
  returned: in check mode
  type: str
  sample: not run in check mode
"""

import concurrent.futures
import subprocess

from ansible.module_utils.basic import AnsibleModule

# Below sshd's MaxStartups start (10 by default): probes in flight from one host at once.
WIDTH = 8


def rotated(targets, start_after):
    """The targets, from the one after ``start_after`` on, wrapping around: in a full mesh each
    node starts at its own place, so the nodes' probes spread over the targets instead of all
    reaching the first ones at once."""
    names = [t["name"] for t in targets]
    if start_after not in names:
        return list(targets)
    i = names.index(start_after) + 1
    return list(targets[i:]) + list(targets[:i])


def main():
    module = AnsibleModule(
        argument_spec={
            "targets": {"type": "list", "elements": "dict", "required": True},
            "key": {"type": "path", "required": True},
            "timeout": {"type": "int", "default": 10},
            "start_after": {"type": "str", "default": ""},
        },
        supports_check_mode=True,
    )
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="not run in check mode")

    def probe(t):
        dest = f"{t['user']}@{t['address']}" if t.get("user") else t["address"]
        cmd = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"ConnectTimeout={module.params['timeout']}",
            "-i",
            module.params["key"],
            "-p",
            str(t.get("port") or 22),
            dest,
            "true",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=module.params["timeout"] + 20)
        return t["name"], p.returncode, p.stderr.strip().splitlines()[-1:] or [""]

    with concurrent.futures.ThreadPoolExecutor(max_workers=WIDTH) as pool:
        results = list(pool.map(probe, rotated(module.params["targets"], module.params["start_after"])))
    bad = [f"{name}: {err[0]}" for name, rc, err in results if rc != 0]
    if bad:
        module.fail_json(msg="cannot ssh to " + "; ".join(bad), checked=len(results))
    module.exit_json(changed=False, checked=len(results))


if __name__ == "__main__":
    main()
