#!/usr/bin/python
# SPDX-License-Identifier: Apache-2.0
"""Ansible module: manage our keys in a .deepspeed_env file, keeping every other line as it is.

DeepSpeed's launcher crashes on comments and blank lines in .deepspeed_env, so our lines
cannot carry a marker. Instead the keys we own are recorded in a sidecar file; a later run
replaces exactly those keys (and drops ones no longer wanted), and leaves other lines alone.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: deepspeed_env_file
short_description: Manage nodeops' variables in a DeepSpeed .deepspeed_env file
description:
  - Writes one C(KEY=VALUE) line for each variable of O(vars) into the DeepSpeed C(.deepspeed_env) file O(path),
    after all other lines and in the order O(vars) gives them.
  - Lines of keys this module does not own (and lines without C(=)) are kept as they are and in their order; only a
    missing final newline is added, so that the next line starts on a line of its own.
  - DeepSpeed's launcher cannot parse comments or blank lines in C(.deepspeed_env), so the file cannot carry a
    marker. Instead the keys this module owns are listed, one per line, in the sidecar file O(state_file).
  - A run drops the lines of every key listed in O(state_file) and of every key of O(vars), then appends the lines
    of O(vars). A variable removed from O(vars) is therefore removed from O(path) on the next run.
  - The module is idempotent. O(path) and O(state_file) are written only when their content changes, each through a
    temporary file in the same directory and a rename. Missing parent directories are created.
version_added: "0.1.0"
author:
  - nodeops contributors (!UNKNOWN)
options:
  path:
    description:
      - The C(.deepspeed_env) file, for example C(~/.deepspeed_env) or one in the launcher's working directory.
      - Created when missing.
      - Give either O(path) and O(state_file), or O(dirs) and O(state_dir).
    type: path
  dirs:
    description:
      - Several directories at once, each getting its C(.deepspeed_env), with its owned-keys list in O(state_dir)
        named C(deepspeed_env.<dir>.keys), where C(<dir>) is the directory with a leading C(~) as C(home) and every
        run of other characters than letters and digits as C(_) (the names the deepspeed_env role has always used).
      - One call instead of one per directory. A leading C(~) is the remote user's home.
    type: list
    elements: path
  state_dir:
    description:
      - With O(dirs), where the owned-keys lists live. Created with mode C(0700) when missing.
    type: path
  hostfile:
    description:
      - Also write DeepSpeed's hostfile here with O(hostfile_content) (only when it differs), mode O(mode) when created.
    type: path
  hostfile_content:
    description:
      - The hostfile's text, for example C(lookup('template', 'hostfile.j2')). Required with O(hostfile).
    type: str
  vars:
    description:
      - The variables to write, name to value. Names and values are written as strings.
      - A value must be a single line without leading or trailing whitespace (DeepSpeed strips it and reads one line
        per variable); any other value makes the module fail before anything is written.
      - DeepSpeed puts these values on the pdsh command line, so they must not be secrets.
      - An empty dict removes every line this module wrote before.
    type: dict
    required: true
  state_file:
    description:
      - Sidecar file that lists the keys this module owns in O(path), one per line.
      - Use one state file per O(path). It is created when missing and rewritten whenever the owned keys change.
    type: path
  mode:
    description:
      - Octal mode given to O(path) and O(state_file) when the module creates them.
      - An existing file keeps its own mode when it is rewritten.
    type: str
    default: "0644"
notes:
  - Supports check mode and diff mode. In check mode nothing is written, and the diff shows what would be written.
  - Only the first C(=) of a line separates its key from its value, and the key is compared with surrounding
    whitespace stripped.
  - Both files are written through a temporary file in the same directory and a rename; an existing file keeps
    its mode.
"""

EXAMPLES = r"""
- name: Write our variables into ~/.deepspeed_env, keeping every other line
  nodeops.cluster.deepspeed_env_file:
    path: ~/.deepspeed_env
    state_file: ~/.nodeops/cluster/deepspeed_env.home.keys
    vars:
      NCCL_SOCKET_IFNAME: eth0
      NCCL_IB_DISABLE: "1"

- name: Write our variables into each .deepspeed_env, keeping other lines
  nodeops.cluster.deepspeed_env_file:
    path: "{{ item }}/.deepspeed_env"
    state_file: >-
      ~/.nodeops/{{ deepspeed_env_cluster }}/deepspeed_env.{{ item | regex_replace('^~', 'home')
      | regex_replace('[^A-Za-z0-9]+', '_') }}.keys
    vars: "{{ deepspeed_env_vars }}"
  loop: "{{ deepspeed_env_dirs }}"

- name: The hostfile and a .deepspeed_env in the home and in the workdir, in one call
  nodeops.cluster.deepspeed_env_file:
    dirs: ["~", /srv/train]
    state_dir: ~/.nodeops/cluster
    vars: {NCCL_SOCKET_IFNAME: eth0}
    hostfile: ~/.nodeops/cluster/hostfile
    hostfile_content: "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"

- name: Remove every variable we wrote before, keeping the other lines
  nodeops.cluster.deepspeed_env_file:
    path: ~/.deepspeed_env
    state_file: ~/.nodeops/cluster/deepspeed_env.home.keys
    vars: {}
"""

RETURN = r"""
diff:
  description:
    - The content of each file written (O(path), or each O(dirs) entry's C(.deepspeed_env), and O(hostfile)) before
      and after the run, shown with C(--diff); a list of such dicts when several files are managed. Also computed in
      check mode.
  returned: always
  type: raw
  contains:
    before:
      description: The content of O(path) before the run (empty when it was missing).
      returned: always
      type: str
      sample: "MY_VAR=1\nNCCL_SOCKET_IFNAME=eth1\n"
    after:
      description: The content of O(path) after the run.
      returned: always
      type: str
      sample: "MY_VAR=1\nNCCL_SOCKET_IFNAME=eth0\nNCCL_IB_DISABLE=1\n"
    before_header:
      description: O(path), with C(~) expanded.
      returned: always
      type: str
      sample: /home/ubuntu/.deepspeed_env
    after_header:
      description: O(path), with C(~) expanded.
      returned: always
      type: str
      sample: /home/ubuntu/.deepspeed_env
"""

import os
import pwd
import re
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.nodeops.cluster.plugins.module_utils.nodeops_files import atomic_write


def merge(existing, ours, owned_before):
    """Return the new file text: foreign lines kept verbatim, then ours in the given order."""
    drop = set(ours) | set(owned_before)
    kept = []
    for line in existing.splitlines(keepends=True):
        key = line.split("=", 1)[0].strip() if "=" in line else None
        if key is not None and key in drop:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    return "".join(kept) + "".join(f"{k}={v}\n" for k, v in ours.items())


def read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def state_name(directory):
    """The owned-keys file's name for a directory: the home dir and what is under it named from
    ``~`` ("home", "home_train"), as when the module took the dirs unexpanded; others with ``_``."""
    home = os.environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir  # what type=path expanded ~ to
    if directory == home or directory.startswith(home.rstrip("/") + "/"):
        directory = "~" + directory[len(home.rstrip("/")):]
    return "deepspeed_env.%s.keys" % re.sub(r"[^A-Za-z0-9]+", "_", re.sub(r"^~", "home", directory))


def write_if_changed(module, target, text, mode):
    """Write text to target when it differs; returns (changed, before). An existing file keeps
    its mode (the user's, or an earlier run's); a new one gets ``mode``."""
    before = read(target)
    if before == text and os.path.exists(target):
        return False, before
    if not module.check_mode:
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        keep = stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else mode
        atomic_write(target, text.encode("utf-8"), keep)
    return True, before


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path"},
            "dirs": {"type": "list", "elements": "path"},
            "vars": {"type": "dict", "required": True},
            "state_file": {"type": "path"},
            "state_dir": {"type": "path"},
            "hostfile": {"type": "path"},
            "hostfile_content": {"type": "str"},
            "mode": {"type": "str", "default": "0644"},
        },
        required_one_of=[("path", "dirs")],
        mutually_exclusive=[("path", "dirs"), ("state_file", "state_dir")],
        required_together=[("path", "state_file"), ("dirs", "state_dir"), ("hostfile", "hostfile_content")],
        supports_check_mode=True,
    )
    p = module.params
    mode = int(p["mode"], 8)
    ours = {str(k): str(v) for k, v in p["vars"].items()}
    for k, v in ours.items():
        if "\n" in v or "\r" in v or v != v.strip():
            module.fail_json(msg=f"{k}: DeepSpeed strips whitespace and reads one line per variable; fix the value")
    if p["dirs"] is not None:
        if not module.check_mode and not os.path.isdir(p["state_dir"]):
            os.makedirs(p["state_dir"], mode=0o700, exist_ok=True)
        pairs = [(os.path.join(d, ".deepspeed_env"), os.path.join(p["state_dir"], state_name(d)))
                 for d in p["dirs"]]  # fmt: skip
    else:
        pairs = [(p["path"], p["state_file"])]
    changed, diffs = False, []
    for path, state_file in pairs:
        before = read(path)
        owned_before = [line.strip() for line in read(state_file).splitlines() if line.strip()]
        after = merge(before, ours, owned_before)
        owned_after = "".join(f"{k}\n" for k in ours)
        if after != before or owned_after != read(state_file):
            changed = True
            write_if_changed(module, path, after, mode)
            write_if_changed(module, state_file, owned_after, mode)
        diffs.append({"before": before, "after": after, "before_header": path, "after_header": path})
    if p["hostfile"] is not None:
        wrote, before = write_if_changed(module, p["hostfile"], p["hostfile_content"], mode)
        changed = changed or wrote
        diffs.append({"before": before, "after": p["hostfile_content"], "before_header": p["hostfile"],
                      "after_header": p["hostfile"]})  # fmt: skip
    module.exit_json(changed=changed, diff=diffs[0] if len(diffs) == 1 else diffs)


if __name__ == "__main__":
    main()
