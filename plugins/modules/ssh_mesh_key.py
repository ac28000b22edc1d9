#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: make sure an ssh keypair exists at a path and return its public key.

An existing private key is never overwritten. With ``private_key`` given (the content of
a controller-side key), it is installed only where no key exists yet; a different key
already in place is an error, not a silent replacement.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: ssh_mesh_key
short_description: Ensure an ssh keypair exists and return the public key
description:
  - Makes sure an ssh private key exists at O(path) and returns its public key, for
    P(nodeops.cluster.ssh_mesh_blocks#module) to authorize on the other nodes.
  - When no key exists at O(path), one is generated (ed25519, no passphrase, with C(ssh-keygen)), or the key given in
    O(private_key) is installed (mode C(0600), with its public key in C(PATH.pub)). A missing parent directory is
    created with mode C(0700).
  - An existing private key is never overwritten. When O(private_key) is given and a different key already exists at
    O(path), the module fails and leaves the key alone.
  - With O(host_keys), it also returns this node's hostname and sshd host public keys, and it always returns
    O(address) and O(port) as given, so that its result can be passed as it is to the
    O(nodeops.cluster.ssh_mesh_blocks#module:files[].known_hosts) option of P(nodeops.cluster.ssh_mesh_blocks#module).
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  path:
    description:
      - Path of the private key. C(~) is expanded on the managed node.
    type: path
    required: true
  comment:
    description:
      - Comment of a generated key, also written into C(PATH.pub) when O(private_key) is installed.
    type: str
    default: ""
  private_key:
    description:
      - Content of a private key to install at O(path) instead of generating one, for example read from a file on
        the controller.
      - This value is secret; it is never logged.
      - Installed only where no key exists yet; a different key already at O(path) is an error.
      - When empty, a key is generated.
    type: str
    default: ""
  generate:
    description:
      - Make sure the key exists.
      - With V(false), no key is read or written; only the host facts (O(host_keys), O(address), O(port)) are
        returned, with an empty RV(public_key).
    type: bool
    default: true
  host_keys:
    description:
      - Also return this node's hostname and its sshd host public keys (C(/etc/ssh/ssh_host_*_key.pub)).
    type: bool
    default: false
  address:
    description:
      - The address other nodes use for this node. Returned as given, for P(nodeops.cluster.ssh_mesh_blocks#module).
    type: str
    default: ""
  port:
    description:
      - This node's sshd port. Returned as given, for P(nodeops.cluster.ssh_mesh_blocks#module).
    type: int
    default: 22
notes:
  - Supports check mode. A missing key is reported as a change and nothing is written; RV(public_key) is then empty.
  - Needs C(ssh-keygen) on the managed node, also to read an existing key (which must not have a passphrase).
"""

EXAMPLES = r"""
- name: Make sure the mesh key exists and read this node's host keys
  nodeops.cluster.ssh_mesh_key:
    path: ~/.ssh/id_ed25519
    comment: "nodeops-{{ ssh_mesh_cluster }}@{{ inventory_hostname }}"
    generate: "{{ inventory_hostname == ssh_mesh_chief }}"
    host_keys: true
    address: "{{ ansible_host | default(inventory_hostname) }}"
    port: "{{ ansible_port | default(22) | int }}"
  register: mesh_key

- name: Install a key kept on the controller instead of generating one
  nodeops.cluster.ssh_mesh_key:
    path: ~/.ssh/id_ed25519
    comment: "nodeops-cluster@{{ inventory_hostname }}"
    private_key: "{{ lookup('ansible.builtin.file', 'files/mesh_ed25519') }}"
  register: mesh_key
  no_log: true
"""

RETURN = r"""
public_key:
  description:
    - The public key as C(type base64), without a comment. Empty with O(generate=false), and in check mode when the
      key does not exist yet.
  returned: always
  type: str
  sample: ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHx8oU0m5nq7kYg3o1yQ2m4p7iGxJ7s0d5i9a8mE1fQw
address:
  description: O(address), as given.
  returned: always
  type: str
  sample: 10.0.0.11
port:
  description: O(port), as given.
  returned: always
  type: int
  sample: 22
hostname:
  description: This node's hostname (C(uname -n)).
  returned: when O(host_keys=true)
  type: str
  sample: gpu-node-0
host_keys:
  description: Each sshd host public key of this node as C(type base64), sorted by file name.
  returned: when O(host_keys=true)
  type: list
  elements: str
  sample:
    - ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEx
    - ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGm3hH1Vd5c0N6sPz0zv8qRj1C4nX2yT7kA3bQ9eL0sF
"""

import glob
import os
import subprocess
import tempfile

from ansible.module_utils.basic import AnsibleModule


def public_of(module, path):
    rc, out, err = module.run_command(["ssh-keygen", "-y", "-f", path])
    if rc != 0:
        module.fail_json(msg=f"cannot read the key at {path}: {err.strip()}")
    return " ".join(out.split()[:2])


def host_facts():
    keys = []
    for pub in sorted(glob.glob("/etc/ssh/ssh_host_*_key.pub")):
        with open(pub) as f:
            parts = f.read().split()
        if len(parts) >= 2:
            keys.append(" ".join(parts[:2]))
    return {"hostname": os.uname()[1], "host_keys": keys}


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "comment": {"type": "str", "default": ""},
            "private_key": {"type": "str", "default": "", "no_log": True},
            "generate": {"type": "bool", "default": True},
            "host_keys": {"type": "bool", "default": False},
            "address": {"type": "str", "default": ""},
            "port": {"type": "int", "default": 22},
        },
        supports_check_mode=True,
    )
    facts = host_facts() if module.params["host_keys"] else {}
    facts.update(address=module.params["address"], port=module.params["port"])
    if not module.params["generate"]:
        module.exit_json(changed=False, public_key="", **facts)
    path, given = module.params["path"], module.params["private_key"]
    exists = os.path.exists(path)
    if exists:
        pub = public_of(module, path)
        if given:
            with tempfile.NamedTemporaryFile("w", delete=False) as f:
                f.write(given if given.endswith("\n") else given + "\n")
            os.chmod(f.name, 0o600)
            try:
                wanted = public_of(module, f.name)
            finally:
                os.unlink(f.name)
            if wanted != pub:
                module.fail_json(msg=f"a different key already exists at {path}; it was left alone. Remove it or "
                                     "choose another ssh_mesh_key_path.")
        module.exit_json(changed=False, public_key=pub, **facts)
    if module.check_mode:
        module.exit_json(changed=True, public_key="", **facts)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if given:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(given if given.endswith("\n") else given + "\n")
        pub = public_of(module, path)
        with open(path + ".pub", "w") as f:
            f.write(f"{pub} {module.params['comment']}\n")
    else:
        rc = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", module.params["comment"], "-f", path],
                            capture_output=True, text=True, check=False)
        if rc.returncode != 0:
            module.fail_json(msg=f"ssh-keygen failed: {rc.stderr.strip()}")
        pub = public_of(module, path)
    module.exit_json(changed=True, public_key=pub, **facts)


if __name__ == "__main__":
    main()
