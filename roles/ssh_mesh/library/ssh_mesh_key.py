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
"""

import os
import subprocess
import tempfile

from ansible.module_utils.basic import AnsibleModule


def public_of(module, path):
    rc, out, err = module.run_command(["ssh-keygen", "-y", "-f", path])
    if rc != 0:
        module.fail_json(msg=f"cannot read the key at {path}: {err.strip()}")
    return " ".join(out.split()[:2])


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "comment": {"type": "str", "default": ""},
            "private_key": {"type": "str", "default": "", "no_log": True},
        },
        supports_check_mode=True,
    )
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
        module.exit_json(changed=False, public_key=pub)
    if module.check_mode:
        module.exit_json(changed=True, public_key="")
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
    module.exit_json(changed=True, public_key=pub)


if __name__ == "__main__":
    main()
