"""What `setup` gave each host, kept on the controller, and what a spec needs that it did not.

After a successful `setup`, each host that ran is recorded in
``$NODEOPS_HOME/clusters/<cluster>/setup.json`` (by default under ``~/.nodeops``): the system packages,
each Python env's requirements, the env and NCCL settings written to ``env.sh``, the workdirs,
``.deepspeed_env``, and the hosts in the chief's ssh mesh, per role that ran. `launch` and
`check` compare the spec with it before they start anything (:func:`differences`): a spec edited
since (a new runner, package, env value, workdir, node) is refused with what changed and the
`setup --tags` that provides it, instead of failing later on the nodes.

What is compared is what the spec *needs*: packages and requirements setup installed stay
installed, so a record only grows for them (a spec that drops a package still runs); env.sh,
the NCCL settings and ``.deepspeed_env`` must hold what the spec sets, as it sets it (a variable
setup wrote that the spec no longer sets is not a difference), and every node must be in the
mesh. Each host is recorded with its address: a host of
the same name at another address counts as never set up. Secret env values are never recorded,
not even as digests; a changed ``from_env``
source value is not seen either (its name is). Without a record for the cluster (set up from
another machine, or by an older nodeops) nothing is compared.

Each host's entry also keeps, under ``digests``, what setup's fast path compares next time
(per role, the input and node-state digests: :mod:`nodeops.setup.fast`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeops.quoting import sh_word
from nodeops.resources import nodeops_home
from nodeops.setup import render
from nodeops.spec.model import LoadedSpec, controller_path

VERSION = 1
ROLES = ("ssh_mesh", "python_env", "shared_path", "nccl_env", "deepspeed_env", "packages")


def record_path(cluster: str) -> Path:
    return nodeops_home() / "clusters" / cluster / "setup.json"  # beside gpus.json (gpus: auto)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def needs(loaded: LoadedSpec) -> dict[str, dict[str, Any]]:
    """Per host alias, what the spec needs from setup, by role (JSON values)."""
    spec = loaded.spec
    packages = render.system_packages(spec)
    python: dict[str, list[str]] = {}
    if spec.python is not None:
        py = spec.python
        prefix = py.venv_path or f"{py.conda_base}/envs/{py.conda}"
        reqs = list(py.packages)
        if py.requirements:
            path = Path(controller_path(py.requirements, loaded.spec_dir)).expanduser()
            # gone since setup: its packages are not compared (nor can setup run without it)
            with contextlib.suppress(OSError):
                reqs.append("-r " + _digest(path.read_text()))
        python[prefix] = reqs
    env = {name: "secret" if v.secret else f"from_env {v.from_env}" if v.from_env is not None
           else _digest(v.value or "") for name, v in spec.env.items()}  # fmt: skip
    ds = None
    if spec.launch.runner == "deepspeed":
        ds_env, _ = render.deepspeed_env_vars(spec, None)
        # the hostfile too, unless a node's slots come from GPUs setup discovers (gpus: auto)
        auto = any(n.gpus == "auto" for n in spec.nodes)
        hostfile = None if auto else [[n.address, spec.nproc(n)] for n in spec.ranked_nodes()]
        ds = _digest(json.dumps([ds_env, hostfile], sort_keys=True))
    mesh = sorted(spec.alias(n) for n in spec.nodes)
    out: dict[str, dict[str, Any]] = {}
    for n in spec.ranked_nodes():
        nccl = {k: _digest(v) for k, v in spec.network.nccl.items()}
        if spec.network.ib == "off":
            nccl["NCCL_IB_DISABLE"] = _digest("1")
        ifname = n.socket_ifname or spec.network.socket_ifname
        if ifname != "auto":
            nccl["NCCL_SOCKET_IFNAME"] = _digest(ifname)
        out[spec.alias(n)] = {
            "address": n.address,
            "packages": packages,
            "python_env": python,
            "shared_path": [spec.workdir.path] if spec.workdir is not None else [],
            "nccl_env": {"env": env, "network": nccl},
            "deepspeed_env": ds,
            "ssh_mesh": mesh,
        }
    return out


def load(cluster: str) -> dict[str, dict[str, Any]] | None:
    """The record's hosts, or None without a (readable) record."""
    try:
        doc = json.loads(record_path(cluster).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("hosts"), dict):
        return None
    if not all(isinstance(v, dict) for v in doc["hosts"].values()):
        return None  # damaged (edited by hand): as if there were none
    hosts: dict[str, dict[str, Any]] = doc["hosts"]
    for entry in hosts.values():
        digests = entry.get("digests", {})
        if not (isinstance(digests, dict) and all(isinstance(d, dict) for d in digests.values())):
            del entry["digests"]  # damaged: the fast path runs those hosts' roles, and records them anew
    return hosts


def _grow(old: Any, new: Any, role: str) -> Any:
    """A role's new entry: installs accumulate (packages, requirements, workdirs); what the role
    rewrites whole (env.sh, .deepspeed_env, the mesh) is replaced."""
    if role == "packages" or role == "shared_path":
        return sorted({*(old or []), *new})
    if role == "python_env":
        merged = {k: list(v) for k, v in (old or {}).items()}
        for prefix, reqs in new.items():
            merged[prefix] = sorted({*merged.get(prefix, []), *reqs})
        return merged
    return new


def record(loaded: LoadedSpec, hosts: Iterable[str], roles: Sequence[str]) -> Path:
    """After a successful setup: what these hosts now have, for the roles that ran."""
    want = needs(loaded)
    doc = load(loaded.cluster_name) or {}
    for host in hosts:
        entry = dict(doc.get(host) or {})
        if entry.get("address") != want[host]["address"]:
            entry = {"address": want[host]["address"]}  # another machine under this name: start over
        for role in roles:
            if role == "deepspeed_env" and want[host][role] is None:
                continue  # not a deepspeed spec: the role wrote nothing this record compares
            entry[role] = _grow(entry.get(role), want[host][role], role)
        doc[host] = entry
    return _write(loaded.cluster_name, doc)


def record_digests(cluster: str, addresses: Mapping[str, str], digests: Mapping[str, Mapping[str, Any]],
                   dropped: Mapping[str, Iterable[str]] | None = None) -> Path:  # fmt: skip
    """After a successful setup: per host, the input and node-state digests of each role the
    fast path's probe read cleanly (nodeops.setup.fast); the roles in ``dropped`` lose theirs."""
    doc = load(cluster) or {}
    dropped = dropped or {}
    for host in {*digests, *dropped}:
        entry = dict(doc.get(host) or {})
        if entry.get("address") != addresses[host]:
            entry = {"address": addresses[host]}
        merged = {**(entry.get("digests") or {}), **digests.get(host, {})}
        for role in dropped.get(host, ()):
            merged.pop(role, None)
        entry["digests"] = merged
        doc[host] = entry
    return _write(cluster, doc)


def _write(cluster: str, doc: Mapping[str, Any]) -> Path:
    path = record_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": VERSION, "hosts": doc}, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Difference:
    """Something the spec needs that the last setup did not give ``hosts``."""

    what: str  # the spec's part, e.g. "python.packages" or "launch.runner"
    detail: str
    role: str  # the setup --tags that provides it
    hosts: tuple[str, ...]

    def line(self) -> str:
        return f"{self.what}: {self.detail} (on {', '.join(self.hosts)})"


def _host_differences(spec_needs: Mapping[str, Any], had: Mapping[str, Any], runner: str,
                      new_nodes: Sequence[str] = ()) -> list[tuple[str, str, str]]:  # fmt: skip
    out: list[tuple[str, str, str]] = []
    missing = [p for p in spec_needs["packages"] if p not in (had.get("packages") or [])]
    if "packages" in had and missing:
        by_runner = set(render.RUNNER_PACKAGES.get(runner, []))
        what = f"launch.runner: {runner}" if set(missing) & by_runner else "system packages"
        out.append((what, f"needs {', '.join(missing)}, which setup has not installed", "packages"))
    if "python_env" in had:
        for prefix, reqs in spec_needs["python_env"].items():
            have = set((had["python_env"] or {}).get(prefix, []))
            new = [r for r in reqs if r not in have]
            if prefix not in (had["python_env"] or {}):
                out.append(("python", f"the env {prefix} was never set up", "python_env"))
            elif new:
                shown = ["requirements file (changed)" if r.startswith("-r ") else r for r in new]
                out.append(("python.packages", f"{', '.join(shown)} not installed in {prefix}", "python_env"))
    if "shared_path" in had:
        for path in spec_needs["shared_path"]:
            if path not in (had["shared_path"] or []):
                out.append(("workdir.path", f"{path} was never set up", "shared_path"))
    if "nccl_env" in had:
        # what the spec sets must be in env.sh as it says; what env.sh has beyond that is left alone
        for part in ("env", "network"):
            old, new = (had["nccl_env"] or {}).get(part, {}), spec_needs["nccl_env"][part]
            changed = sorted(k for k in new if old.get(k) != new[k])
            if changed:
                out.append((part, f"{', '.join(changed)} not as setup wrote it in env.sh", "nccl_env"))
    if spec_needs["deepspeed_env"] is not None and had.get("deepspeed_env") != spec_needs["deepspeed_env"]:
        out.append((f"launch.runner: {runner}" if "deepspeed_env" not in had else "env",
                    ".deepspeed_env differs from what setup wrote" if "deepspeed_env" in had
                    else "deepspeed needs .deepspeed_env and the hostfile, which setup has not written",
                    "deepspeed_env"))  # fmt: skip
    if "ssh_mesh" in had:
        # a node never set up is named once, as such (not again on every node whose mesh lacks it)
        new_hosts = [h for h in spec_needs["ssh_mesh"] if h not in (had["ssh_mesh"] or []) and h not in new_nodes]
        if new_hosts:
            out.append(("nodes", f"{', '.join(new_hosts)} not in the chief's ssh mesh", "ssh_mesh"))
    return out


NEVER = ("nodes", "never set up", "all roles")  # a difference: nodes this machine never set up


def differences(loaded: LoadedSpec, ignore: Sequence[str] = ()) -> list[Difference] | None:
    """What the spec needs that the last setup did not give (grouped over hosts), leaving out
    what the roles in ``ignore`` provide; None when this machine has no setup record for the
    cluster."""
    had = load(loaded.cluster_name)
    if had is None:
        return None
    grouped: dict[tuple[str, str, str], list[str]] = {}
    wanted = needs(loaded)
    new_nodes = [h for h, want in wanted.items() if h not in had or had[h].get("address") != want["address"]]
    for host, want in wanted.items():
        if host in new_nodes:
            grouped.setdefault(NEVER, []).append(host)
            continue
        for key in _host_differences(want, had[host], loaded.spec.launch.runner, new_nodes):
            if key[2] not in ignore:
                grouped.setdefault(key, []).append(host)
    return [Difference(what, detail, role, tuple(hosts)) for (what, detail, role), hosts in grouped.items()]


def fix(loaded: LoadedSpec, diffs: Sequence[Difference]) -> str:
    """The setup command that provides what ``diffs`` name."""
    roles = sorted({d.role for d in diffs})
    tags = "" if "all roles" in roles else " --tags " + ",".join(roles)
    return f"nodeops setup {sh_word(loaded.file)}{tags}"  # a command to paste into a shell
