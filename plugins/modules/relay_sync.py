#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: rsync a directory from this host (the relay, usually the chief) to many target
nodes at once over the cluster's own network, with the mesh key and the pinned host keys. Run
once on the relay for the whole play: the relay's own ssh opens one connection per target, a
bounded number at a time, where a task per target delegated to the relay would run them all as
sessions of the controller's one connection to it, past sshd's MaxSessions (10 by default). A
transfer that fails is a warning and ``relayed: false`` for that target, so the play can send
there from the controller instead."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: relay_sync
short_description: Pass a directory on from this host to other nodes with rsync over ssh
description:
  - Runs C(rsync) on the host it runs on (the relay, usually the chief) and copies the directory O(src) there to
    O(dest) on every node of O(targets), over ssh with the private key O(key), C(BatchMode=yes) and
    C(StrictHostKeyChecking=yes) (a target's host key must already be pinned in known_hosts, as the ssh_mesh role
    does).
  - This is how nodeops keeps the controller's traffic from growing with the cluster, the controller sends a
    wheelhouse or a working dir to the relay once, and the relay passes it on to every other node.
  - Run it once for the whole play, on the relay host itself, with every target in O(targets). The relay then
    opens one ssh connection of its own to each target, O(forks) at a time. A task per target delegated to the
    relay would instead run every transfer as a session of the controller's one ssh connection to the relay, and
    sshd refuses sessions past its C(MaxSessions) (10 by default) on one connection.
  - A transfer that fails does not fail the task, that target gets C(relayed=false) in RV(by_target) with a
    warning that names it and rsync's reason, so that the play can send there from the controller instead.
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
      - Directory on each target. An absolute path, or one under the target user's home written C(~/...).
    type: str
    required: true
  targets:
    description:
      - The nodes to copy to. Each is a dict with C(name) (used in messages and as the key of RV(by_target)),
        C(address) (what ssh connects to), and optionally C(port) (22 when omitted) and C(user) (when omitted, ssh
        picks the user).
      - Exactly one of O(targets) and O(target) is required.
    type: list
    elements: dict
  target:
    description:
      - One node to copy to, a dict as in O(targets). The same as O(targets) with one element.
    type: dict
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
  forks:
    description:
      - How many targets are copied to at once (one rsync and one ssh connection each, from this host).
    type: int
    default: 16
notes:
  - Supports check mode, in which rsync runs with C(--dry-run).
  - Needs C(rsync) on this host and on the targets, and the C(ssh) client on this host.
"""

EXAMPLES = r"""
- name: Pass the wheelhouse on from the chief to the other nodes
  nodeops.cluster.relay_sync:
    src: ~/.nodeops/python_env/wheelhouse
    dest: ~/.nodeops/python_env/wheelhouse
    targets:
      - name: node2
        address: 10.0.0.12
      - name: node3
        address: 10.0.0.13
        port: 2222
        user: ubuntu
    key: ~/.ssh/id_ed25519
    delete: true
  when: inventory_hostname == groups['chief'][0]
  register: relayed

- name: Send from the controller where the chief could not
  ansible.posix.synchronize:
    src: wheelhouse/
    dest: ~/.nodeops/python_env/wheelhouse/
  when: not (hostvars[groups['chief'][0]].relayed.by_target[inventory_hostname].relayed | default(false))
"""

RETURN = r"""
relayed:
  description: Whether every target now holds what O(src) holds (false when rsync failed for any; a warning says why).
  returned: always
  type: bool
  sample: true
transferred:
  description: How many files rsync created, updated or deleted, on all targets together.
  returned: always
  type: int
  sample: 12
by_target:
  description:
    - Per target (by its C(name)), C(relayed) (bool), C(transferred) (int), C(rsync_rc) (rsync's exit status, null
      when rsync did not run) and C(msg) (why it was not relayed, empty when it was).
  returned: always
  type: dict
  sample: {"node2": {"relayed": true, "transferred": 12, "rsync_rc": 0, "msg": ""}}
rsync_rc:
  description: rsync's exit status, with O(target) (one target).
  returned: with O(target), when rsync ran
  type: int
  sample: 0
"""

import concurrent.futures
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


def target_name(target):
    return str(target.get("name") or target.get("address"))


def bad_target(target):
    """Why a target's address or user cannot be put on rsync's command line, or None."""
    for field in ("address", "user"):
        value = str(target.get(field) or "")
        if (field == "address" and not value) or value.startswith("-") or any(c.isspace() or c in "@/" for c in value):
            return f"target {target_name(target)}: {field} {value!r} is not a host address or user name"
    return None


def relay_one(p, target, check):
    """rsync to one target: its entry of by_target."""
    name = target_name(target)
    argv = rsync_argv(p["src"], p["dest"], target, p["key"], p["files"], p["delete"], p["checksum"], p["timeout"],
                      check)  # fmt: skip
    stdin = "\0".join(p["files"]) + "\0" if p["files"] else ""
    try:
        proc = subprocess.run(argv, input=stdin.encode(), capture_output=True, check=False)
    except OSError as e:  # no rsync here
        return {"relayed": False, "transferred": 0, "rsync_rc": None,
                "msg": f"relay_sync: could not pass {p['src']} on to {name}: {e}"}  # fmt: skip
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        # ssh's own reason (refused, host key, permission) comes before rsync's closing lines (and,
        # where ssh gave up at once, rsync's broken pipe); else rsync's own, less its closing lines
        why = [line for line in err if not line.startswith("rsync")] or [
            line for line in err if not line.startswith(("rsync error:", "rsync: connection unexpectedly"))]
        return {"relayed": False, "transferred": 0, "rsync_rc": proc.returncode,
                "msg": f"relay_sync: could not pass {p['src']} on to {name} (rsync exit {proc.returncode}): "
                       f"{(why or err or ['no message'])[-1]}"}  # fmt: skip
    lines = proc.stdout.decode(errors="replace").splitlines()
    moved = sum(1 for line in lines if line[:1] in _CHANGED)
    return {"relayed": True, "transferred": moved, "rsync_rc": 0, "msg": ""}


def main():
    module = AnsibleModule(
        argument_spec={
            "src": {"type": "path", "required": True},
            "dest": {"type": "str", "required": True},
            "targets": {"type": "list", "elements": "dict"},
            "target": {"type": "dict"},
            "key": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "str"},
            "delete": {"type": "bool", "default": False},
            "checksum": {"type": "bool", "default": False},
            "timeout": {"type": "int", "default": 30},
            "forks": {"type": "int", "default": 16},
        },
        mutually_exclusive=[("files", "delete"), ("targets", "target")],
        required_one_of=[("targets", "target")],
        supports_check_mode=True,
    )
    p = module.params
    one = p["target"] is not None
    targets = [p["target"]] if one else p["targets"]
    names = [target_name(t) for t in targets]
    bad = [why for why in map(bad_target, targets) if why]
    twice = sorted(n for n in set(names) if names.count(n) > 1)
    if twice:
        bad.append(f"target names must be unique ({', '.join(twice)} more than once)")
    if p["forks"] < 1:
        bad.append(f"forks must be at least 1 (got {p['forks']})")
    try:
        remote_path(p["dest"])
    except ValueError as e:
        bad.append(str(e))
    if bad:
        module.fail_json(msg="relay_sync: " + "; ".join(bad))
    if not os.path.isdir(p["src"]):
        why = f"relay_sync: {p['src']} is not a directory here, so it was not passed on to {', '.join(names)}"
        module.warn(why)
        by_target = {n: {"relayed": False, "transferred": 0, "rsync_rc": None, "msg": why} for n in names}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(p["forks"], max(1, len(targets)))) as pool:
            done = list(pool.map(lambda t: relay_one(p, t, module.check_mode), targets))
        by_target = dict(zip(names, done))
        for r in done:
            if not r["relayed"]:
                module.warn(r["msg"])
    relayed = all(r["relayed"] for r in by_target.values())
    transferred = sum(r["transferred"] for r in by_target.values())
    out = {"changed": transferred > 0, "relayed": relayed, "transferred": transferred, "by_target": by_target}
    if one and by_target[names[0]]["rsync_rc"] is not None:
        out["rsync_rc"] = by_target[names[0]]["rsync_rc"]
    module.exit_json(**out)


if __name__ == "__main__":
    main()
