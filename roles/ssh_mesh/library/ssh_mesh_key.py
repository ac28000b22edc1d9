#!/usr/bin/python
"""Ansible module: make sure an ssh keypair exists at a path and return its public key.

An existing private key is never overwritten. With ``private_key`` given (the content of
a controller-side key), it is installed only where no key exists yet; a different key
already in place is an error, not a silent replacement.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: ssh_mesh_key
short_description: Ensure an ssh keypair exists and return the public key
options:
  path: {description: Private key path., type: path, required: true}
  comment: {description: Comment for a generated key., type: str, default: ""}
  private_key: {description: Content of a key to install instead of generating one., type: str, default: "", no_log: true}
  generate: {description: Make sure the key exists; with false only the host facts are read., type: bool, default: true}
  host_keys: {description: Also return this node's hostname and sshd host public keys., type: bool, default: false}
  address: {description: Returned as given (the address other nodes use), for ssh_mesh_blocks., type: str, default: ""}
  port: {description: Returned as given (this node's sshd port), for ssh_mesh_blocks., type: int, default: 22}
"""

RETURN = r"""
public_key: {description: "type base64" of the key, or empty with generate=false, type: str, returned: always}
hostname: {description: uname -n, type: str, returned: with host_keys}
host_keys: {description: '"type base64" of each /etc/ssh/ssh_host_*_key.pub', type: list, returned: with host_keys}
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
