#!/usr/bin/python
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
  - Writes KEY=VALUE lines for O(vars); lines for other keys are kept byte for byte and in order.
  - The keys it owns are listed in O(state_file), so removed variables are removed on the next run.
options:
  path: {description: The .deepspeed_env file., type: path, required: true}
  vars: {description: Variables to write., type: dict, required: true}
  state_file: {description: Sidecar file listing the keys this module owns., type: path, required: true}
  mode: {description: File mode of O(path) when created., type: str, default: "0644"}
"""

import os

from ansible.module_utils.basic import AnsibleModule


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


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "vars": {"type": "dict", "required": True},
            "state_file": {"type": "path", "required": True},
            "mode": {"type": "str", "default": "0644"},
        },
        supports_check_mode=True,
    )
    path, state_file = module.params["path"], module.params["state_file"]
    ours = {str(k): str(v) for k, v in module.params["vars"].items()}
    for k, v in ours.items():
        if "\n" in v or "\r" in v or v != v.strip():
            module.fail_json(msg=f"{k}: DeepSpeed strips whitespace and reads one line per variable; fix the value")
    before = read(path)
    owned_before = [line.strip() for line in read(state_file).splitlines() if line.strip()]
    after = merge(before, ours, owned_before)
    owned_after = "".join(f"{k}\n" for k in ours)
    changed = after != before or owned_after != read(state_file)
    if changed and not module.check_mode:
        for target, text in ((path, after), (state_file, owned_after)):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            tmp = target + ".nodeops-tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        if not before:
            os.chmod(path, int(module.params["mode"], 8))
    module.exit_json(changed=changed, diff={"before": before, "after": after, "before_header": path, "after_header": path})


if __name__ == "__main__":
    main()
