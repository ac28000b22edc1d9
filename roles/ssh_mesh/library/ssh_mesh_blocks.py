#!/usr/bin/python
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
options:
  cluster: {description: Cluster name; it names the markers and tags each line., type: str, required: true}
  inventory_hosts:
    description: Every host of the inventory, in order. Lines of hosts not listed here are dropped.
    type: list
    elements: str
    required: true
  files:
    description: The files to maintain.
    type: list
    elements: dict
    required: true
    suboptions:
      path: {description: The file (~ expands)., type: path, required: true}
      mode: {description: Mode of a file this module creates., type: str, default: "0600"}
      lines:
        description: Host to its lines (a list, or one string; without the tag), for the hosts this run reached.
        type: dict
      known_hosts:
        description: >-
          Host to what ssh_mesh_key returned for it (address, port, hostname, host_keys); each becomes
          known_hosts lines naming the host by address, inventory name and hostname.
        type: dict
"""

RETURN = r"""
written: {description: Paths written (or that would be, in check mode)., type: list, returned: always}
"""

import os
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule


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
        mode = stat.S_IMODE(os.stat(path).st_mode)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".nodeops-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
