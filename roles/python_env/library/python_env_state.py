#!/usr/bin/python
"""Ansible module: what a Python env holds, in one call (read-only).

Answers "is everything already as wanted?" for the python_env role: whether the env's
interpreter exists, the fingerprint of its last successful install, and its Python and
package versions (for the cross-node comparison).
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: python_env_state
short_description: Report a Python env's interpreter, install fingerprint and package versions
options:
  prefix: {description: The env's prefix (venv dir or conda env dir)., type: path, required: true}
  fingerprint_file: {description: File in I(prefix) holding the last install's fingerprint., type: str, default: .nodeops-installed}
"""

RETURN = r"""
exists: {description: whether PREFIX/bin/python exists, type: bool, returned: always}
fingerprint: {description: the recorded fingerprint (first line of the file), or an empty string, type: str, returned: always}
versions_recorded: {description: the versions hash recorded after the last install (second line), type: str, returned: always}
versions_hash: {description: sha256 of I(versions), type: str, returned: always}
drift: {description: whether the versions differ from those the last install left, type: bool, returned: always}
versions: {description: the Python version, then sorted name==version lines (empty without an env), type: str, returned: always}
"""

import hashlib
import os

from ansible.module_utils.basic import AnsibleModule

SCRIPT = ("import sys, importlib.metadata as m; print(sys.version.split()[0]); "
          "print('\\n'.join(sorted({d.metadata['Name'].lower() + '==' + d.version for d in m.distributions()})))")


def main():
    module = AnsibleModule(
        argument_spec={"prefix": {"type": "path", "required": True},
                       "fingerprint_file": {"type": "str", "default": ".nodeops-installed"}},
        supports_check_mode=True,
    )
    prefix = module.params["prefix"]
    python = os.path.join(prefix, "bin", "python")
    result = {"changed": False, "prefix": prefix, "exists": os.path.exists(python), "fingerprint": "", "versions": "",
              "versions_recorded": ""}
    try:
        with open(os.path.join(prefix, module.params["fingerprint_file"])) as f:
            lines = f.read().split("\n")
        result["fingerprint"] = lines[0].strip()
        result["versions_recorded"] = lines[1].strip() if len(lines) > 1 else ""
    except (OSError, UnicodeDecodeError):
        pass
    if result["exists"]:
        rc, out, err = module.run_command([python, "-c", SCRIPT])
        if rc != 0:
            module.fail_json(msg="%s cannot list its packages: %s" % (python, err.strip()), **result)
        result["versions"] = out.strip()
    result["versions_hash"] = hashlib.sha256(result["versions"].encode("utf-8")).hexdigest()
    # A package changed by hand on this node since the last install (repaired by reinstalling).
    result["drift"] = bool(result["versions_recorded"]) and result["versions_recorded"] != result["versions_hash"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
