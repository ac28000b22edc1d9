#!/usr/bin/python
"""Ansible module: ssh from this host to each target, in parallel, with BatchMode and strict
host key checking; fail naming every target that does not answer and ssh's reason."""

from __future__ import annotations

DOCUMENTATION = r"""
module: ssh_mesh_check
short_description: Check passwordless ssh with pinned host keys to a list of targets
options:
  targets:
    description: List of {name, address, port, user}.
    type: list
    elements: dict
    required: true
  key: {description: Private key to use., type: path, required: true}
  timeout: {description: ConnectTimeout in seconds., type: int, default: 10}
"""

import concurrent.futures
import subprocess

from ansible.module_utils.basic import AnsibleModule


def main():
    module = AnsibleModule(
        argument_spec={
            "targets": {"type": "list", "elements": "dict", "required": True},
            "key": {"type": "path", "required": True},
            "timeout": {"type": "int", "default": 10},
        },
        supports_check_mode=True,
    )
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="not run in check mode")

    def probe(t):
        dest = f"{t['user']}@{t['address']}" if t.get("user") else t["address"]
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
               "-o", f"ConnectTimeout={module.params['timeout']}", "-i", module.params["key"],
               "-p", str(t.get("port") or 22), dest, "true"]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=module.params["timeout"] + 20)
        return t["name"], p.returncode, p.stderr.strip().splitlines()[-1:] or [""]

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(probe, module.params["targets"]))
    bad = [f"{name}: {err[0]}" for name, rc, err in results if rc != 0]
    if bad:
        module.fail_json(msg="cannot ssh to " + "; ".join(bad), checked=len(results))
    module.exit_json(changed=False, checked=len(results))


if __name__ == "__main__":
    main()
