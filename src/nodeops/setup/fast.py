"""`setup`'s fast path: one read-only probe per node instead of a play that finds nothing to do.

After every successful `setup`, each host's state is probed (:mod:`nodeops.node.setup_probe`) and
recorded per role in the cluster's setup record, beside the role's *input*: a digest of the
inventory variables the role reads (:data:`ROLE_VARS`), the host's connection, the controller
files it copies (requirements, wheelhouse, mesh key) and the collection's own code (so a
nodeops upgrade runs every role once). The next `setup` probes every node at once (one ssh
each, in parallel, the way `check` reaches them) and runs Ansible only for the roles, on only
the hosts, whose input or node state is not what was recorded, or that the probe finds plainly
wrong (a missing package, a workdir file that is not the source's, a secret that is not the
spec's). With nothing to do, no play runs.

The probe reads what each role manages, so what a role would repair is seen: a changed env
file, a key line gone from authorized_keys, a package changed by hand in the env, a workdir
file that differs from the source, a changed host key. What a role reads only on the
controller at run time and that is not listed here would not be; ``test_setup_fast`` keeps
:data:`ROLE_VARS` equal to what ``setup.yml`` passes each role.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from nodeops import __version__
from nodeops.node import setup_probe
from nodeops.quoting import sh_word
from nodeops.resources import collection_root
from nodeops.setup import state as setup_state
from nodeops.setup import workdir
from nodeops.setup.render import ssh_config
from nodeops.spec.model import LoadedSpec
from nodeops.transport import fan_out, last_line, ssh_argv

# The inventory variables each role of setup.yml reads (group or host vars).
ROLE_VARS: dict[str, tuple[str, ...]] = {
    "packages": ("nodeops_system_packages",),
    "ssh_mesh": ("nodeops_mesh_mode", "nodeops_cluster", "nodeops_mesh_key_file"),
    "python_env": ("nodeops_python", "nodeops_relay"),
    "shared_path": ("nodeops_workdir", "nodeops_relay"),
    "nccl_env": ("nodeops_cluster", "nodeops_socket_ifname", "nodeops_network_ib", "nodeops_nccl_env", "nodeops_env",
                 "nodeops_shared_envs", "nodeops_secret_env_names"),
    "deepspeed_env": ("nodeops_cluster", "nodeops_deepspeed_env", "nodeops_hostfile_hosts", "nodeops_workdir"),
}  # fmt: skip
# How Ansible reaches a host: part of every role's input.
CONNECTION = ("ansible_host", "ansible_port", "ansible_user", "ansible_ssh_private_key_file",
              "ansible_ssh_common_args", "ansible_python_interpreter")  # fmt: skip
MESH_KEY = "~/.ssh/id_ed25519"  # ssh_mesh_key_path's default, which setup.yml keeps
PROBE_TIMEOUT = 90.0


@cache
def collection_digest() -> str:
    """The collection's code (roles, plugins, playbooks) and nodeops' version."""
    h = hashlib.sha256(__version__.encode())
    root = collection_root()
    for part in ("roles", "plugins", "playbooks"):
        for path in sorted((root / part).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and "molecule" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _file_digest(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e.strerror}"


def _stat(path: str | None) -> list[object] | None:
    """A file by size and mtime (a private key: never hashed, not even into the record)."""
    if not path:
        return None
    try:
        st = Path(path).expanduser().stat()
    except OSError as e:
        return [f"unreadable: {e.strerror}"]
    return [st.st_size, st.st_mtime_ns]


def _listing(path: str | None) -> list[list[object]] | None:
    """A wheelhouse by name, size and mtime (what the role's sync would copy)."""
    if not path:
        return None
    d = Path(path).expanduser()
    try:
        return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(d.iterdir()) if p.is_file()]
    except OSError as e:
        return [[f"unreadable: {e.strerror}"]]


def _hosts(inv: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    children = inv["all"]["children"]
    return {**children["chief"]["hosts"], **children["workers"]["hosts"]}


def roles_of(inv: Mapping[str, Any], skip: Sequence[str] = ()) -> dict[str, list[str]]:
    """The roles setup.yml runs on each host (those in ``skip`` left out)."""
    gv = inv["all"]["vars"]
    hosts = _hosts(inv)
    chief = next(iter(inv["all"]["children"]["chief"]["hosts"]))
    out: dict[str, list[str]] = {}
    for host in hosts:
        roles = ["packages"] if gv.get("nodeops_system_packages") else []
        roles.append("ssh_mesh")
        roles += ["python_env"] if "nodeops_python" in gv else []
        roles += ["shared_path"] if "nodeops_workdir" in gv else []
        roles.append("nccl_env")
        roles += ["deepspeed_env"] if host == chief else []
        out[host] = [r for r in roles if r not in skip]
    return out


def inputs(inv: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Per host, per role: the digest of everything the role is given."""
    gv = inv["all"]["vars"]
    hosts = _hosts(inv)
    extra: dict[str, Any] = {"ssh_mesh": [[h, [hv.get(k) for k in CONNECTION]] for h, hv in hosts.items()]}
    extra["ssh_mesh"].append(_stat(gv.get("nodeops_mesh_key_file")))
    py = gv.get("nodeops_python") or {}
    extra["python_env"] = [_file_digest(py.get("requirements")), _listing(py.get("wheelhouse"))]
    # shared_path_owner defaults to the controller's $USER when the inventory names no ansible_user
    extra["shared_path"] = os.environ.get("USER")
    base = collection_digest()
    # the cluster-wide part once per role (the mesh's host list and the hostfile grow with N),
    # then each host's own variables and connection on top of it
    shared = {role: setup_probe.digest(base, role, {k: gv.get(k) for k in names}, extra.get(role))
              for role, names in ROLE_VARS.items()}  # fmt: skip
    out: dict[str, dict[str, str]] = {}
    for host, hv in hosts.items():
        conn = [hv.get(k) for k in CONNECTION]
        out[host] = {role: setup_probe.digest(shared[role], conn, {k: hv[k] for k in names if k in hv})
                     for role, names in ROLE_VARS.items()}  # fmt: skip
    return out


def source_manifest(loaded: LoadedSpec, inv: Mapping[str, Any]) -> dict[str, Any] | None:
    """The workdir source's manifest when setup copies it (an rsync dry run: built once per setup)."""
    wd = inv["all"]["vars"].get("nodeops_workdir")
    return workdir.source_manifest(loaded) if wd and wd["sync"] == "rsync" else None


def plans(inv: Mapping[str, Any], roles: Mapping[str, Sequence[str]],
          manifest: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """What the probe reads on each host, per role (``manifest``: :func:`source_manifest`)."""
    gv = inv["all"]["vars"]
    cluster = gv["nodeops_cluster"]
    state_dir = f"~/.nodeops/{cluster}"
    py = gv.get("nodeops_python")
    wd = gv.get("nodeops_workdir")
    hosts = _hosts(inv)
    ds_files = [f"{d}/.deepspeed_env" for d in ["~", *([wd["path"]] if wd else [])]]
    every: dict[str, Any] = {
        "packages": gv.get("nodeops_system_packages"),
        "ssh_mesh": {"cluster": cluster, "key": MESH_KEY},
        "python_env": py and {"prefix": (py["venv"] or "~/.nodeops/venv") if py["kind"] == "venv"
                              else f"{py['conda_base']}/envs/{py['conda']}", "tools": py.get("tools", [])},
        "shared_path": wd and {"path": wd["path"], "mode": wd["sync"], "manifest": manifest},
        "deepspeed_env": {"files": [*ds_files, f"{state_dir}/hostfile"],
                          "globs": [f"{state_dir}/deepspeed_env.*.keys"],
                          # the role writes no .deepspeed_env where it has no variables to put in one
                          "required": [*(ds_files if gv.get("nodeops_deepspeed_env") else []),
                                       f"{state_dir}/hostfile"]},
    }  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for host, names in roles.items():
        nccl = {"dir": state_dir, "address": hosts[host].get("ansible_host")}
        out[host] = {r: nccl if r == "nccl_env" else every[r] for r in names}
    return out


# roles/nccl_env/templates/secrets.env.j2, rendered here without jinja2 (kept off the CLI's
# start-up); test_setup_fast renders the real template with jinja2 and compares.
SECRETS_HEADER = "# Managed by nodeops (nccl_env role). Secret variables; mode 0600. Do not copy to logs.\n"


def secrets_env(values: Mapping[str, str]) -> str:
    """secrets.env as the nccl_env role writes it, with the collection's quoting."""
    by_name = sorted(values.items(), key=lambda kv: kv[0].lower())  # jinja2's dictsort ignores case
    return SECRETS_HEADER + "".join(f"export {k}={sh_word(str(v))}\n" for k, v in by_name)


@dataclass
class Probe:
    """What the probe found on each host: per role {"state", "bad"}, or why it could not look."""

    states: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def probe(loaded: LoadedSpec, inv: Mapping[str, Any], host_plans: Mapping[str, dict[str, Any]],
          secrets: Mapping[str, str], timeout: float = PROBE_TIMEOUT) -> Probe:  # fmt: skip
    """Run the probe on every host of ``host_plans`` at once, over the controller's ssh."""
    hosts = _hosts(inv)
    code = workdir.manifest_path().read_text() if any("shared_path" in p for p in host_plans.values()) else None
    source = Path(setup_probe.__file__).read_text()
    secrets_file = secrets_env(secrets)
    result = Probe()
    with tempfile.TemporaryDirectory(prefix="nodeops-setup-probe-") as tmp:
        cfg = Path(tmp) / "ssh_config"
        cfg.write_text(ssh_config(loaded))
        os.chmod(cfg, 0o600)

        def one(host: str) -> dict[str, Any] | str:
            interpreter = hosts[host].get("ansible_python_interpreter") or "python3"
            if interpreter.startswith("auto"):
                interpreter = "python3"
            # secrets travel on stdin only, as Ansible's own module arguments do
            payload = {"source": source, "plan": host_plans[host], "manifest_code": code,
                       "secrets": secrets_file if "nccl_env" in host_plans[host] else ""}  # fmt: skip
            # bounded on the node too: killing this ssh would not stop a probe stuck on, say, a hung mount
            remote = f"timeout -k 5 {timeout - 10:.0f} {sh_word(interpreter)} -c {sh_word(setup_probe.BOOT)}"
            argv = ssh_argv(cfg, host, remote)
            try:
                p = subprocess.run(argv, input=json.dumps(payload), capture_output=True, text=True,
                                   timeout=timeout, errors="replace", check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                return f"the probe did not answer within {timeout:.0f}s"
            doc = setup_probe.document(p.stdout)
            if doc is not None:
                return doc
            return last_line(p.stderr, f"ssh exited {p.returncode}")

        for host, got in fan_out(list(host_plans), one).items():
            if isinstance(got, str):
                result.failed[host] = got
            else:
                result.states[host] = got
    return result


def decide(roles: Mapping[str, Sequence[str]], wanted: Mapping[str, Mapping[str, str]],
           record: Mapping[str, Any] | None, found: Probe,
           addresses: Mapping[str, str]) -> dict[str, dict[str, str]]:  # fmt: skip
    """Per host, the roles whose input or node state differs from the record (with why)."""
    out: dict[str, dict[str, str]] = {}
    for host, names in roles.items():
        had = (record or {}).get(host) or {}
        digests = had.get("digests") if had.get("address") == addresses[host] else None
        digests = digests if isinstance(digests, dict) else {}  # a record edited by hand: as if none
        why: dict[str, str] = {}
        for role in names:
            now = found.states.get(host, {}).get(role)
            rec = digests.get(role) if isinstance(digests.get(role), dict) else {}
            if host in found.failed:
                why[role] = f"the probe could not read the node ({found.failed[host]})"
            elif not rec:
                why[role] = "no record of setting it up from this machine"
            elif now is None or now.get("bad"):
                why[role] = (now or {}).get("bad") or "the probe did not report it"
            elif rec.get("input") != wanted[host][role]:
                why[role] = "its input changed (the spec, a file it copies, or nodeops itself)"
            elif rec.get("state") != now.get("state"):
                why[role] = "the node changed since setup left it"
        out[host] = why
    return out


def reasons(why: Mapping[str, str]) -> str:
    """Why roles run on a host, each reason once with the roles it applies to (an unreachable
    node gives every role the same one)."""
    roles: dict[str, list[str]] = {}
    for role, reason in why.items():
        roles.setdefault(reason, []).append(role)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in roles.items())


def add_gate(run: dict[str, dict[str, str]], roles: Mapping[str, Sequence[str]],
             diffs: Sequence[setup_state.Difference], chief: str) -> None:  # fmt: skip
    """Add what `launch` and `check` would refuse (setup_state.differences: what the spec needs
    that the setup record lacks) to ``run``, so a plain setup always provides it. A role that
    runs on the chief only (deepspeed_env) is run there for every host that lacks it."""
    for d in diffs:
        for host in d.hosts:
            for role in roles[host] if d.role == "all roles" else [d.role]:
                target = host if role in roles[host] else chief
                if role in roles.get(target, ()):
                    run[target].setdefault(role, f"{d.what}: {d.detail}")


def joins(run: Mapping[str, Mapping[str, str]], chief: str, mesh_mode: str, relay: bool = False) -> list[str]:
    """Hosts that must take part besides those with differences, for roles that span hosts:

    - ssh_mesh writes the connecting hosts' keys (the chief's, or every node's in a full mesh)
      into every node's authorized_keys and pins every node in theirs: a node that needs it
      brings the connecting hosts; a connecting host that needs it (a new key) brings all;
    - python_env ends by comparing every node's Python and package versions with the others
      in the play: all take part, or a node reinstalled alone would only be compared with itself;
    - with ``relay`` (the workdir is rsynced), shared_path passes the workdir on from the chief,
      which must be in the play (else the controller sends to each node).
    """
    mesh = [h for h, roles in run.items() if "ssh_mesh" in roles]
    connecting = list(run) if mesh_mode == "full" else [chief]
    if any("python_env" in roles for roles in run.values()) or set(mesh) & set(connecting):
        return list(run)
    if mesh:
        return connecting
    return [chief] if relay and any("shared_path" in roles for roles in run.values()) else []


def recordable(wanted: Mapping[str, Mapping[str, str]], found: Probe) -> dict[str, dict[str, dict[str, str]]]:
    """Per host, per role the probe read cleanly: the input and the state to record."""
    return {
        host: {role: {"input": wanted[host][role], "state": s["state"]} for role, s in states.items() if not s["bad"]}
        for host, states in found.states.items()
    }
