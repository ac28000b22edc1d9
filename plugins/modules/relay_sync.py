#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: rsync a directory from this host (the relay, usually the chief) to one
target node over the cluster's own network, with the mesh key and the pinned host keys. A
transfer that fails is a warning and ``relayed: false``, so the play can send from the
controller instead."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: relay_sync
short_description: Pass a directory on from this host to another node with rsync over ssh
description:
  - Runs C(rsync) on the host it runs on (use C(delegate_to) to make that the relay, usually the chief) and copies
    the directory O(src) there to O(dest) on O(target), over ssh with the private key O(key), C(BatchMode=yes) and
    C(StrictHostKeyChecking=yes) (the target's host key must already be pinned in known_hosts, as the ssh_mesh role
    does).
  - This is how nodeops keeps the controller's traffic from growing with the cluster, the controller sends a
    wheelhouse or a working dir to the relay once, and the relay passes it on to every other node.
  - A transfer that fails does not fail the task, it returns C(relayed=false) with a warning that names the target
    and rsync's reason, so that the play can fall back to sending from the controller.
version_added: "0.4.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  src:
    description: Directory on this host to copy (its contents, not the directory itself). C(~) is expanded.
    type: path
    required: true
  dest:
    description:
      - Directory on the target. An absolute path, or one under the target user's home written C(~/...).
    type: str
    required: true
  target:
    description:
      - The node to copy to, a dict with C(name) (used in messages), C(address) (what ssh connects to), and
        optionally C(port) (22 when omitted) and C(user) (when omitted, ssh picks the user).
    type: dict
    required: true
  key:
    description: Private key on this host to authenticate with (C(ssh -i)). C(~) is expanded.
    type: path
    required: true
  files:
    description:
      - Copy only these paths, relative to O(src) (rsync C(--files-from)). Files that exist only on this host, such
        as outputs a job wrote into a working dir, are then never passed on.
      - When omitted, the whole directory is copied.
    type: list
    elements: str
  delete:
    description: Delete files in O(dest) that are not in O(src). Not allowed with O(files).
    type: bool
    default: false
  checksum:
    description: Compare files by content (C(--checksum)), not by size and modification time.
    type: bool
    default: false
  timeout:
    description: ssh's C(ConnectTimeout) and rsync's I/O C(--timeout), in seconds.
    type: int
    default: 30
notes:
  - Supports check mode, in which rsync runs with C(--dry-run).
  - Needs C(rsync) on this host and on the target, and the C(ssh) client on this host.
"""

EXAMPLES = r"""
- name: Pass the wheelhouse on from the chief
  nodeops.cluster.relay_sync:
    src: ~/.nodeops/python_env/wheelhouse
    dest: ~/.nodeops/python_env/wheelhouse
    target:
      name: "{{ inventory_hostname }}"
      address: "{{ ansible_host }}"
      port: "{{ ansible_port | default(22) }}"
    key: ~/.ssh/id_ed25519
    delete: true
  delegate_to: "{{ groups['chief'][0] }}"
  register: relayed
"""

RETURN = r"""
relayed:
  description: Whether the target now holds what O(src) holds (false when rsync failed; a warning says why).
  returned: always
  type: bool
  sample: true
transferred:
  description: How many files rsync created, updated or deleted on the target.
  returned: always
  type: int
  sample: 12
rsync_rc:
  description: rsync's exit status.
  returned: when rsync ran
  type: int
  sample: 0
"""

import os
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.nodeops.cluster.plugins.module_utils.nodeops_shell import rsync_rsh_word

_CHANGED = ("<", ">", "c", "h", "*")  # rsync --itemize-changes: sent, created, hard-linked, deleted


def remote_path(dest):
    """rsync's path on the target: one under ``~/`` relative to the login dir, where rsync starts."""
    if dest == "~":
        return "."
    if dest.startswith("~/"):
        return dest[2:] or "."
    if not dest.startswith("/"):
        raise ValueError(f"dest {dest!r} must be absolute or start with ~/")
    return dest


def rsync_argv(src, dest, target, key, files, delete, checksum, timeout, check):
    rsh = " ".join(rsync_rsh_word(w) for w in [
        "ssh", "-i", key, "-p", str(target.get("port") or 22), "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes", "-o", f"ConnectTimeout={timeout}", "-o", "ServerAliveInterval=15",
    ])  # fmt: skip
    address = str(target["address"])
    host = f"[{address}]" if ":" in address else address
    if target.get("user"):
        host = f"{target['user']}@{host}"
    argv = ["rsync", "-rlpt", "--protect-args", "--omit-dir-times", "--itemize-changes", f"--timeout={timeout}",
            "-e", rsh]  # fmt: skip
    if files is not None:
        argv += ["--from0", "--files-from=-"]
    if delete:
        argv.append("--delete")
    if checksum:
        argv.append("--checksum")
    if check:
        argv.append("--dry-run")
    return argv + [src.rstrip("/") + "/", f"{host}:{remote_path(dest).rstrip('/') or '/'}/"]


def main():
    module = AnsibleModule(
        argument_spec={
            "src": {"type": "path", "required": True},
            "dest": {"type": "str", "required": True},
            "target": {"type": "dict", "required": True},
            "key": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "str"},
            "delete": {"type": "bool", "default": False},
            "checksum": {"type": "bool", "default": False},
            "timeout": {"type": "int", "default": 30},
        },
        mutually_exclusive=[("files", "delete")],
        supports_check_mode=True,
    )
    p = module.params
    target = p["target"]
    name = target.get("name") or target.get("address")
    for field in ("address", "user"):
        value = str(target.get(field) or "")
        if (field == "address" and not value) or value.startswith("-") or any(c.isspace() or c in "@/" for c in value):
            module.fail_json(msg=f"relay_sync: target {name}: {field} {value!r} is not a host address or user name")
    if not os.path.isdir(p["src"]):
        module.warn(f"relay_sync: {p['src']} is not a directory here, so it was not passed on to {name}")
        module.exit_json(changed=False, relayed=False, transferred=0)
    try:
        argv = rsync_argv(p["src"], p["dest"], target, p["key"], p["files"], p["delete"], p["checksum"],
                          p["timeout"], module.check_mode)  # fmt: skip
    except ValueError as e:
        module.fail_json(msg=f"relay_sync: {e}")
    stdin = "\0".join(p["files"]) + "\0" if p["files"] else ""
    try:
        proc = subprocess.run(argv, input=stdin.encode(), capture_output=True, check=False)
    except OSError as e:  # no rsync here
        module.warn(f"relay_sync: could not pass {p['src']} on to {name}: {e}")
        module.exit_json(changed=False, relayed=False, transferred=0)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        # ssh's own reason (refused, host key, permission) comes before rsync's closing lines
        why = [line for line in err if not line.startswith(("rsync error:", "rsync: connection unexpectedly"))]
        module.warn(f"relay_sync: could not pass {p['src']} on to {name} (rsync exit {proc.returncode}): "
                    f"{(why or err or ['no message'])[-1]}")  # fmt: skip
        module.exit_json(changed=False, relayed=False, transferred=0, rsync_rc=proc.returncode)
    lines = proc.stdout.decode(errors="replace").splitlines()
    moved = sum(1 for line in lines if line[:1] in _CHANGED)
    module.exit_json(changed=moved > 0, relayed=True, transferred=moved, rsync_rc=0)


if __name__ == "__main__":
    main()
