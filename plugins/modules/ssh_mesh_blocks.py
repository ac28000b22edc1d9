#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: nodeops' marked blocks in authorized_keys / known_hosts, in one call.

Every line of a block belongs to one inventory host (its trailing ``nodeops-CLUSTER@HOST``
comment says which). A run replaces the lines of the hosts it has entries for and keeps
the lines of every other host still in the inventory, so a ``--limit`` run never drops what
it did not touch; hosts that left the inventory are dropped. Everything outside the block
is kept byte for byte. A file is written (atomically) only when it changes.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: ssh_mesh_blocks
short_description: Maintain per-host lines in marked blocks of ssh files, keeping other hosts' lines
description:
  - Maintains one marked block, between C(# BEGIN nodeops ssh_mesh CLUSTER) and C(# END nodeops ssh_mesh CLUSTER),
    in each file of O(files), typically C(~/.ssh/authorized_keys) and C(~/.ssh/known_hosts).
  - Every line of the block belongs to one inventory host; its trailing C(nodeops-CLUSTER@HOST) comment says which.
  - A run replaces the lines of the hosts it has entries for (in O(files[].lines) or O(files[].known_hosts)) and keeps
    the lines of every other host of O(inventory_hosts), so a C(--limit) run never drops what it did not touch.
    Lines of hosts that are no longer in O(inventory_hosts) are dropped.
  - The block's lines are ordered as O(inventory_hosts). A block left without lines is removed; a missing block is
    appended at the end of the file.
  - Everything outside the block is kept byte for byte. A file is written, atomically (a temporary file in the same
    directory, then a rename), only when its content changes, so a repeated run changes nothing.
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  cluster:
    description:
      - Cluster name. It names the block's markers and tags each line, so several clusters can share a user account.
    type: str
    required: true
  inventory_hosts:
    description:
      - Every host of the inventory, in order, for example C(groups['all']).
      - Lines of hosts not listed here are dropped.
    type: list
    elements: str
    required: true
  files:
    description:
      - The files to maintain.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description:
          - The file. C(~) is expanded on the managed node. A missing file, and a missing parent directory
            (mode C(0700)), are created.
        type: path
        required: true
      mode:
        description:
          - Octal mode of a file this module creates. An existing file keeps its mode.
        type: str
        default: "0600"
      lines:
        description:
          - Inventory host to its lines, for the hosts this run reached; each value is a list of lines, or one
            string for a single line (for example a public key). The tag is added by the module.
          - An empty value removes the host's lines.
        type: dict
      known_hosts:
        description:
          - Inventory host to what P(nodeops.cluster.ssh_mesh_key#module) returned for it (C(address), C(port),
            C(hostname), C(host_keys)).
          - Each host key becomes one known_hosts line naming the host by address, inventory name and hostname,
            as C([name]:port) when the port is not 22.
          - For a host given in both O(files[].lines) and O(files[].known_hosts), the latter wins.
        type: dict
notes:
  - Supports check mode and diff mode. In check mode nothing is written, and RV(written) names the files that would
    be written.
  - Untagged lines in the block (written by older versions) belong to the inventory host that their known_hosts
    pattern names; other untagged lines are dropped.
"""

EXAMPLES = r"""
- name: Authorize the chief's key and pin node1's host keys, in the blocks of cluster "train"
  nodeops.cluster.ssh_mesh_blocks:
    cluster: train
    inventory_hosts: [node0, node1]
    files:
      - path: ~/.ssh/authorized_keys
        lines:
          node0: ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIChiefPublicKeyBase64
      - path: ~/.ssh/known_hosts
        mode: "0644"
        known_hosts:
          node1:
            address: 10.0.0.12
            port: 22
            hostname: gpu-node-1
            host_keys:
              - ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINode1HostKeyBase64

- name: Authorize the connecting hosts' keys and pin every node's host keys, in marked blocks
  nodeops.cluster.ssh_mesh_blocks:
    cluster: "{{ ssh_mesh_cluster }}"
    inventory_hosts: "{{ groups['all'] }}"
    files: "{{ [_ssh_mesh_ak] + ([_ssh_mesh_kh] if _ssh_mesh_connects | bool else []) }}"
  vars:
    _ssh_mesh_reached: >-
      {{ ansible_play_hosts | map('extract', hostvars) | selectattr('_ssh_mesh_key', 'defined')
         | map(attribute='inventory_hostname') | list }}
    _ssh_mesh_ak:
      path: ~/.ssh/authorized_keys
      mode: "0600"
      lines: >-
        {{ dict(_ssh_mesh_reached | zip(_ssh_mesh_reached
           | map('extract', hostvars, ['_ssh_mesh_key', 'public_key']))) }}
    _ssh_mesh_kh:
      path: ~/.ssh/known_hosts
      mode: "0644"
      known_hosts: "{{ dict(_ssh_mesh_reached | zip(_ssh_mesh_reached | map('extract', hostvars, '_ssh_mesh_key'))) }}"
"""

RETURN = r"""
written:
  description: Paths of the files written, or that would be written in check mode, with C(~) expanded.
  returned: always
  type: list
  elements: str
  sample: [/home/ubuntu/.ssh/authorized_keys, /home/ubuntu/.ssh/known_hosts]
diff:
  description: One entry per file in RV(written), its content before and after, shown with C(--diff).
  returned: always
  type: list
  elements: dict
  contains:
    before:
      description: The file's content before the run (empty when it was missing).
      returned: always
      type: str
      sample: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOther user@laptop\n"
    after:
      description: The file's content after the run.
      returned: always
      type: str
      sample: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOther user@laptop\n# BEGIN nodeops ssh_mesh train\n\
        ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIChiefPublicKeyBase64 nodeops-train@node0\n# END nodeops ssh_mesh train\n"
    before_header:
      description: The file's path.
      returned: always
      type: str
      sample: /home/ubuntu/.ssh/authorized_keys
    after_header:
      description: The file's path.
      returned: always
      type: str
      sample: /home/ubuntu/.ssh/authorized_keys
"""

import os
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.nodeops.cluster.plugins.module_utils.nodeops_files import atomic_write


def markers(cluster):
    return "# BEGIN nodeops ssh_mesh %s" % cluster, "# END nodeops ssh_mesh %s" % cluster


def split_block(text, begin, end):
    """(before, block lines, after, found) of a text holding at most one marked block."""
    lines = text.split("\n")
    try:
        i = lines.index(begin)
        j = lines.index(end, i + 1)
    except ValueError:
        return text, [], "", False
    before = "\n".join(lines[:i]) + ("\n" if i else "")
    after = "\n".join(lines[j + 1 :])
    return before, lines[i + 1 : j], after, True


def owner_of(line, cluster, hosts):
    tag = "nodeops-%s@" % cluster
    last = line.rsplit(None, 1)[-1] if line.strip() else ""
    if last.startswith(tag):
        return last[len(tag) :]
    # Lines written before lines were tagged: known_hosts patterns name the inventory host.
    names = line.split(None, 1)[0].split(",") if line.strip() else []
    names = [n[1:].rsplit("]:", 1)[0] if n.startswith("[") else n for n in names]
    return next((h for h in hosts if h in names), None)


def render(cluster, hosts, old_lines, new_lines):
    by_host = {}
    for line in old_lines:
        h = owner_of(line, cluster, hosts)
        if h is not None:
            by_host.setdefault(h, []).append(line)
    out = []
    for h in hosts:
        if h in new_lines:
            out += ["%s nodeops-%s@%s" % (ln, cluster, h) for ln in new_lines[h]]
        else:
            out += by_host.get(h, [])
    return out


def updated(text, cluster, hosts, new_lines):
    begin, end = markers(cluster)
    before, old, after, found = split_block(text, begin, end)
    block = render(cluster, hosts, old, new_lines)
    if not block:
        return (before + after) if found else text
    body = begin + "\n" + "\n".join(block) + "\n" + end
    if found:
        return before + body + ("\n" + after if after else "\n")
    if text and not text.endswith("\n"):
        text += "\n"
    return text + body + "\n"


def known_hosts_lines(host, facts):
    names = []
    for n in (facts.get("address") or host, host, facts.get("hostname") or host):
        if n not in names:
            names.append(n)
    port = int(facts.get("port") or 22)
    pattern = ",".join(names if port == 22 else ["[%s]:%d" % (n, port) for n in names])
    return ["%s %s" % (pattern, key) for key in facts.get("host_keys") or []]


def wanted_lines(f):
    out = {}
    for h, v in (f.get("lines") or {}).items():
        if isinstance(v, str) or v is None:  # one line (a public key), or none
            v = [v] if v else []
        out[str(h)] = [str(x) for x in v]
    for h, facts in (f.get("known_hosts") or {}).items():
        out[str(h)] = known_hosts_lines(str(h), facts or {})
    return out


def write(path, data, mode):
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d, 0o700)
    if os.path.exists(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)  # the user's file keeps its mode
    atomic_write(path, data, mode)


def main():
    module = AnsibleModule(
        argument_spec={
            "cluster": {"type": "str", "required": True},
            "inventory_hosts": {"type": "list", "elements": "str", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True,
                      "options": {"path": {"type": "path", "required": True},
                                  "mode": {"type": "str", "default": "0600"},
                                  "lines": {"type": "dict"}, "known_hosts": {"type": "dict"}}},
        },
        supports_check_mode=True,
    )
    p = module.params
    written, diffs = [], []
    for f in p["files"]:
        path = f["path"]
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            raw = b""
        text = raw.decode("utf-8", "surrogateescape")
        lines = wanted_lines(f)
        new = updated(text, p["cluster"], [str(h) for h in p["inventory_hosts"]], lines)
        if new == text:
            continue
        written.append(path)
        diffs.append({"before_header": path, "after_header": path, "before": text, "after": new})
        if not module.check_mode:
            write(path, new.encode("utf-8", "surrogateescape"), int(f["mode"], 8))
    module.exit_json(changed=bool(written), written=written, diff=diffs)


if __name__ == "__main__":
    main()
