#!/usr/bin/python
"""Ansible module: write a few small files into one directory in a single call.

Each file is written (atomically: a temp file in the same directory, then rename) only
when its content or mode differs, so a no-op run reads and changes nothing. Secret files
are never shown in diffs or logs.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: nccl_env_files
short_description: Write small files into one directory, each only when it differs
options:
  dir:
    description: The directory; created with I(dir_mode) when missing.
    type: path
    required: true
  dir_mode: {description: Mode of a directory this module creates., type: str, default: "0700"}
  files:
    description: Files whose changes are shown with --diff.
    type: list
    elements: dict
    default: []
    suboptions:
      name: {description: File name in I(dir)., type: str, required: true}
      content: {description: Full content., type: str, required: true}
      mode: {description: Octal mode (default 0644)., type: str}
  secret_files:
    description: Files whose content is never logged or diffed.
    type: list
    elements: dict
    default: []
    suboptions:
      name: {description: File name in I(dir)., type: str, required: true}
      content: {description: Full content., type: str, required: true}
      mode: {description: Octal mode (default 0600)., type: str}
"""

RETURN = r"""
dir: {description: The directory with ~ expanded., type: str, returned: always}
written: {description: Names of the files written (or that would be, in check mode)., type: list, returned: always}
"""

import os
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule


def _file_spec(secret):
    return {"name": {"type": "str", "required": True}, "content": {"type": "str", "required": True, "no_log": secret},
            "mode": {"type": "str"}}


def _state(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data, stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None, None


def _write(path, content, mode):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".nodeops-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main():
    module = AnsibleModule(
        argument_spec={
            "dir": {"type": "path", "required": True},
            "dir_mode": {"type": "str", "default": "0700"},
            "files": {"type": "list", "elements": "dict", "default": [], "options": _file_spec(False)},
            "secret_files": {"type": "list", "elements": "dict", "default": [], "options": _file_spec(True)},
        },
        supports_check_mode=True,
    )
    d = module.params["dir"]
    changed, written, diffs = False, [], []
    if not os.path.isdir(d):
        changed = True
        if not module.check_mode:
            os.makedirs(d, mode=int(module.params["dir_mode"], 8), exist_ok=True)
    entries = [(f, False, "0644") for f in module.params["files"]]
    entries += [(f, True, "0600") for f in module.params["secret_files"]]
    for f, secret, default_mode in entries:
        name = f["name"]
        if os.sep in name or name in ("", ".", ".."):
            module.fail_json(msg="nccl_env_files: %r is not a plain file name" % name)
        path = os.path.join(d, name)
        want = f["content"].encode("utf-8")
        mode = int(f.get("mode") or default_mode, 8)
        have, have_mode = _state(path)
        if have == want and have_mode == mode:
            continue
        changed = True
        written.append(name)
        if not secret:
            diffs.append({"before_header": path, "after_header": path,
                          "before": (have or b"").decode("utf-8", "replace"), "after": f["content"]})  # fmt: skip
        if not module.check_mode:
            _write(path, want, mode)
    module.exit_json(changed=changed, dir=d, written=written, diff=diffs)


if __name__ == "__main__":
    main()
