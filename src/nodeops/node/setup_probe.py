"""The read-only probe behind `setup`'s fast path (stdlib only, Python >= 3.8).

The controller pipes ``{"source": <this file>, "plan": ..., "manifest_code": ...}`` to
``python3 -c BOOT`` on every node over ssh, all at once. For each role the plan names, the
probe reads what that role manages on this node and prints, after ``@@nodeops-setup-state``,
one JSON document: per role a ``state`` digest and, when the node is plainly not what the role
makes it (a package missing, a workdir file that differs from the source, a secret that is not
the spec's), a ``bad`` reason. It changes nothing.

What each role's state covers (the inputs the role reads on the node, and what it writes):

- ``packages``: which of the spec's Debian packages dpkg does not list as installed (``bad``).
- ``ssh_mesh``: this cluster's marked blocks in ``~/.ssh/authorized_keys`` and
  ``~/.ssh/known_hosts``, the mesh key (the private key's mode only, the public key), the modes
  of ``~``, ``~/.ssh`` and ``authorized_keys`` (sshd's StrictModes), the hostname and the
  node's sshd host keys (which the chief pins).
- ``python_env``: whether the env's interpreter exists, its ``.nodeops-installed`` record, its
  Python and package versions (read as the role's ``python_env_state`` module reads them: a
  package changed by hand is ``bad``), and which tools are in its ``bin/`` (one missing is
  ``bad``: the role tries it again).
- ``shared_path``: rsync: every file of the controller's manifest, by size and SHA-256 (what
  the role's ``shared_path_state`` compares; files only on the node are outputs and never
  count); nfs: the mount and the fstab lines naming the path; and the directory's owner.
- ``nccl_env``: ``env.sh`` (bytes and mode), the interfaces and IPv4 addresses the role picks
  the socket interface from, the address as the node resolves it, ``$HOME``; ``secrets.env``
  is compared byte for byte with the role's template rendered with the spec's secret values,
  here, on the node (it comes on stdin): its result is a yes/no, never a digest.
- ``deepspeed_env``: the files the role writes (``.deepspeed_env`` files, the hostfile and the
  lists of the keys it owns in each).

Secret values are never printed or digested; a digest of ``secrets.env`` is never taken.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import socket
import subprocess
import sys
from typing import Any

MARK = "@@nodeops-setup-state "
BOOT = (
    "import json,sys;d=json.load(sys.stdin);g={'__name__':'nodeops_setup_probe'};"
    "exec(compile(d['source'],'nodeops-setup-probe','exec'),g);g['main'](d)"
)
# The python_env role's python_env_state module lists an env's versions with this script (kept
# equal by a unit test), so "a package changed by hand" means the same here and there.
VERSIONS = (
    "import sys, importlib.metadata as m; print(sys.version.split()[0]); "
    "print('\\n'.join(sorted({d.metadata['Name'].lower() + '==' + d.version for d in m.distributions()})))"
)
TIMEOUT = 60


def digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _path(p: str) -> str:
    return os.path.expanduser(os.path.expandvars(p)) if p.startswith(("~", "$")) else p


def file_state(path: str) -> list[object]:
    """A file's mode, owner and content digest (None for each when it is missing)."""
    full = _path(path)
    try:
        st = os.stat(full)
        with open(full, "rb") as f:
            return [path, oct(st.st_mode & 0o7777), st.st_uid, hashlib.sha256(f.read()).hexdigest()]
    except OSError as e:
        return [path, "missing" if not os.path.lexists(full) else f"unreadable: {e.strerror}"]


def mode_of(path: str) -> list[object]:
    try:
        st = os.stat(_path(path))
    except OSError:
        return [path, "missing"]
    return [path, oct(st.st_mode & 0o7777), st.st_uid]


def block(path: str, begin: str, end: str) -> list[str]:
    """The lines between a marked block's markers (the markers included), or [] without one."""
    try:
        with open(_path(path), encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().split("\n")
    except OSError:
        return []
    out: list[str] = []
    inside = False
    for line in lines:
        if line == begin:
            inside = True
        if inside:
            out.append(line)
        if line == end:
            inside = False
    return out


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True,
                           timeout=TIMEOUT, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return p.returncode, p.stdout if p.returncode == 0 else (p.stderr.strip() or p.stdout)


def packages(names: list[str]) -> dict[str, Any]:
    rc, out = _run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *names])
    installed = {ln.split()[0] for ln in out.splitlines() if ln.endswith(" installed")} if rc in (0, 1) else set()
    missing = sorted(set(names) - installed)
    return {"state": digest(missing), "bad": "not installed: " + ", ".join(missing) if missing else ""}


def ssh_mesh(p: dict[str, Any]) -> dict[str, Any]:
    begin, end = "# BEGIN nodeops ssh_mesh " + p["cluster"], "# END nodeops ssh_mesh " + p["cluster"]
    key = p["key"]
    # sshd refuses keys in a file or dir others may write (StrictModes): their modes count too;
    # the private key counts by its mode only (its content never leaves the node, not even hashed)
    parts = [block("~/.ssh/authorized_keys", begin, end), block("~/.ssh/known_hosts", begin, end),
             file_state(key)[:3], file_state(key + ".pub"), mode_of("~"), mode_of("~/.ssh"),
             mode_of("~/.ssh/authorized_keys"), os.uname()[1],
             [file_state(k) for k in sorted(glob.glob("/etc/ssh/ssh_host_*_key.pub"))]]  # fmt: skip
    bad = "" if parts[0] else "no ssh_mesh block in ~/.ssh/authorized_keys"
    return {"state": digest(parts), "bad": bad}


def python_env(p: dict[str, Any]) -> dict[str, Any]:
    prefix = _path(p["prefix"])
    python = os.path.join(prefix, "bin", "python")
    if not os.path.exists(python):
        return {"state": digest("missing"), "bad": f"{p['prefix']}/bin/python does not exist"}
    try:
        with open(os.path.join(prefix, ".nodeops-installed")) as f:
            record = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        record = []
    rc, versions = _run([python, "-c", VERSIONS])
    if rc != 0:
        return {"state": digest("broken"), "bad": f"{python} cannot list its packages: {versions.strip()}"}
    now = hashlib.sha256(versions.strip().encode("utf-8")).hexdigest()
    recorded = record[1].strip() if len(record) > 1 else ""
    tools = [t for t in p.get("tools", []) if os.path.exists(os.path.join(prefix, "bin", t))]
    bad = "its packages changed since setup installed them" if recorded and recorded != now else ""
    if not recorded:
        bad = "setup's install record (.nodeops-installed) is missing"
    elif len(tools) < len(p.get("tools", [])):  # the role tries a tool it could not install again
        bad = "not installed: " + ", ".join(t for t in p["tools"] if t not in tools)
    return {"state": digest(record, now, tools), "bad": bad}


def shared_path(p: dict[str, Any], manifest_code: str | None) -> dict[str, Any]:
    path = p["path"]
    try:
        st = os.stat(path)
        owner: object = [st.st_uid, os.getuid()]
    except OSError:
        return {"state": digest("missing"), "bad": f"{path} does not exist"}
    if p["mode"] == "rsync":
        g: dict[str, Any] = {"__name__": "nodeops_manifest"}
        # the collection's own module_utils, shipped as check ships it
        exec(compile(manifest_code or "", "nodeops_manifest", "exec"), g)
        report = g["compare"](path, p["manifest"])
        bad = "" if report["same"] else g["summary"](report)
        return {"state": digest(owner, p["manifest"].get("digest"), report["same"]), "bad": bad}
    fstab = []
    if p["mode"] == "nfs":
        try:
            with open("/etc/fstab") as f:
                fstab = [ln for ln in f.read().splitlines() if path in ln.split()]
        except OSError:
            pass
    return {"state": digest(owner, fstab, os.path.ismount(path)), "bad": ""}


def _secrets_same(path: str, wanted: str) -> bool:
    """Whether secrets.env holds exactly ``wanted`` (the role's template rendered on the
    controller with the spec's values) with mode 0600. Only a yes or no leaves."""
    full = _path(path)
    try:
        if os.stat(full).st_mode & 0o777 != 0o600:
            return False
        with open(full, "rb") as f:
            return f.read() == wanted.encode("utf-8")
    except OSError:
        return False


def _resolved(address: str) -> list[str]:
    """What the role resolves a node's address to (getent ahostsv4 there; an IP stays itself)."""
    try:
        return sorted({str(a[4][0]) for a in socket.getaddrinfo(address, None, socket.AF_INET)})
    except OSError as e:
        return ["unresolved: " + str(e)]


def nccl_env(p: dict[str, Any], secrets: str) -> dict[str, Any]:
    d = p["dir"]
    rc, out = _run(["ip", "-o", "-4", "addr", "show"])
    addrs = sorted((w[1], w[3]) for w in (ln.split() for ln in out.splitlines()) if len(w) > 3) if rc == 0 else out
    address = p.get("address") or ""
    state = digest(file_state(d + "/env.sh"), addrs, os.path.expanduser("~"), address, _resolved(address))
    bad = ""
    if not os.path.exists(_path(d + "/env.sh")):
        bad = "env.sh is missing"
    elif not _secrets_same(d + "/secrets.env", secrets):
        bad = "secrets.env does not hold the spec's secret values"
    return {"state": state, "bad": bad}


def deepspeed_env(p: dict[str, Any]) -> dict[str, Any]:
    globbed = [g for pattern in p.get("globs", []) for g in sorted(glob.glob(_path(pattern)))]
    states = [file_state(f) for f in p["files"]] + [file_state(g) for g in globbed]
    required = p.get("required", p["files"])
    missing = [s[0] for s in states if s[1] == "missing" and s[0] in required]
    return {"state": digest(states), "bad": "missing: " + ", ".join(str(m) for m in missing) if missing else ""}


def state(plan: dict[str, Any], secrets: str, manifest_code: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, p in plan.items():
        try:
            if role == "packages":
                out[role] = packages(p)
            elif role == "ssh_mesh":
                out[role] = ssh_mesh(p)
            elif role == "python_env":
                out[role] = python_env(p)
            elif role == "shared_path":
                out[role] = shared_path(p, manifest_code)
            elif role == "nccl_env":
                out[role] = nccl_env(p, secrets)
            elif role == "deepspeed_env":
                out[role] = deepspeed_env(p)
            else:
                out[role] = {"state": "", "bad": f"this probe does not know the role {role}"}
        except Exception as e:  # a role this probe cannot read is a role to run, not a crash
            out[role] = {"state": "", "bad": f"could not read it: {type(e).__name__}: {e}"}
    return out


def main(d: dict[str, Any]) -> None:
    doc = state(d["plan"], d.get("secrets") or "", d.get("manifest_code"))
    sys.stdout.write(MARK + json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def document(output: str) -> dict[str, Any] | None:
    """The probe's document in its output (None when it printed none)."""
    for line in output.splitlines():
        if line.startswith(MARK):
            try:
                doc = json.loads(line[len(MARK) :])
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None
