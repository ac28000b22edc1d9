"""`nodeops check`: a full-mesh preflight, run from the chief over the cluster network.

``run()`` pipes ``probe.py`` to the chief over ssh (the controller's generated ssh_config,
strict host keys); the chief listens on the job's ports and probes every node over ssh.
``evaluate()`` is pure: facts in, one ok/warn/fail row per (host, check) out. The chief's
values are the reference for parity (versions, packages, workdir hash): a node that differs
from the chief is the one reported.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nodeops.errors import NodeopsError
from nodeops.launch.launchers import rendezvous
from nodeops.node import probe

# the rules that need no spec live in check_rules (shipped to a Slurm job's preflight step)
from nodeops.node.check_rules import FAIL as FAIL
from nodeops.node.check_rules import OK as OK
from nodeops.node.check_rules import PARITY as PARITY
from nodeops.node.check_rules import RUNNER_COMMANDS as RUNNER_COMMANDS
from nodeops.node.check_rules import WARN as WARN
from nodeops.node.check_rules import Row as Row
from nodeops.node.check_rules import env_rows, parity_rows, workdir_rows
from nodeops.node.check_rules import runner_commands as runner_commands
from nodeops.node.check_rules import shown as shown
from nodeops.quoting import sh_word
from nodeops.setup import workdir
from nodeops.setup.render import activation, ssh_config
from nodeops.spec.model import LoadedSpec, ResourceSpec
from nodeops.transport import fds_for, last_line, ssh_argv

BRIDGE_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "flannel", "cali", "vxlan", "lxc")
CLOCK_WARN_S = 1.0
NOFILE_WARN = 8192  # the usual soft default is 1024; env.sh raises soft to hard for jobs
SHM_WARN = 1 << 30
NEIGH_SPARE = 128  # neighbour entries beside the peers: the gateway, storage, the controller
DISK_WARN, DISK_FAIL = 10 << 30, 1 << 30


@dataclass
class Report:
    rows: list[Row]
    values: dict[str, dict[str, str]]  # host -> parity key -> value
    hosts: list[str]

    def worst(self) -> str:
        states = {r.status for r in self.rows}
        return FAIL if FAIL in states else WARN if WARN in states else OK

    def exit_code(self, strict: bool = False) -> int:
        w = self.worst()
        return 1 if w == FAIL or (strict and w == WARN) else 0

    def diff(self) -> dict[str, dict[str, str]]:
        """Parity values that are not the same on every host: key -> host -> value."""
        keys = sorted({k for v in self.values.values() for k in v})
        out = {}
        for k in keys:
            per = {h: self.values.get(h, {}).get(k, "-") for h in self.hosts}
            if len(set(per.values())) > 1:
                out[k] = per
        return out

    def to_json(self, strict: bool = False) -> dict[str, Any]:
        return {
            "status": self.worst(),
            "exit_code": self.exit_code(strict),
            "hosts": {h: [asdict(r) for r in self.rows if r.host == h] for h in self.hosts},
            "diff": self.diff(),
        }


class CheckError(NodeopsError):
    pass


def ports(spec: ResourceSpec) -> list[int]:
    out = [spec.launch.master_port]
    if spec.launch.runner == "torchrun" and rendezvous(spec) == "c10d" and spec.launch.rdzv_port not in out:
        out.append(spec.launch.rdzv_port)
    return out


def plan(loaded: LoadedSpec, *, fast: bool = False, timeout: float = 120, script: str | None = None) -> dict[str, Any]:
    """What the chief runs: its listeners, and per node how to reach it and what to probe."""
    spec = loaded.spec
    wd = spec.workdir.path if spec.workdir is not None else None
    manifest = workdir.source_manifest(loaded)
    nodes = []
    for node in spec.ranked_nodes():
        group = spec.group(node)
        nodes.append({
            "name": spec.alias(node), "address": node.address, "port": group.port, "user": group.username or "",
            "plan": {"workdir": wd, "exclude": workdir.excludes(loaded), "activate": activation(spec, node),
                     "fast": fast, "env_file": f".nodeops/{loaded.cluster_name}/env.sh", "script": script,
                     "commands": runner_commands(spec.launch.runner, node is spec.chief)},
        })  # fmt: skip
    out = {"mode": "chief", "nonce": secrets.token_hex(8), "ports": ports(spec), "timeout": timeout,
           "chief_address": spec.chief.address, "nodes": nodes}  # fmt: skip
    if manifest is not None:
        out["manifest"] = {"code": workdir.manifest_path().read_text(), "manifest": manifest}
    return out


def run(loaded: LoadedSpec, *, fast: bool = False, timeout: float = 120, script: str | None = None) -> dict[str, Any]:
    """Run the probe on the chief; returns its JSON, or a chief-unreachable stand-in."""
    spec = loaded.spec
    chief = spec.alias(spec.chief)
    the_plan = plan(loaded, fast=fast, timeout=timeout, script=script)
    payload = json.dumps({"source": Path(probe.__file__).read_text(), "plan": the_plan})
    with tempfile.TemporaryDirectory(prefix="nodeops-check-") as tmp:
        cfg = Path(tmp) / "ssh_config"
        cfg.write_text(ssh_config(loaded))
        os.chmod(cfg, 0o600)
        argv = ssh_argv(cfg, chief, "python3 -c " + sh_word(probe.BOOT))
        try:
            p = subprocess.run(argv, input=payload, capture_output=True, text=True, timeout=timeout + 30,
                               errors="replace")  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"unreachable": f"the probe on the chief did not answer within {timeout + 30:.0f}s"}
    docs = probe.documents(p.stdout)
    if docs:
        return docs[0]
    why = last_line(p.stderr, f"ssh exited {p.returncode}")
    if p.returncode == 255:
        return {"unreachable": f"ssh from this machine to the chief {chief} failed: {why}"}
    raise CheckError(f"the probe failed on the chief {chief} (exit {p.returncode}): {why}")


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _ifname_matches(dev: str, setting: str) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma list of prefixes, '=' for exact, '^' to exclude."""
    exclude = setting.startswith("^")
    items = [i for i in setting.lstrip("^").split(",") if i]
    hit = any(dev == i[1:] if i.startswith("=") else dev.startswith(i) for i in items)
    return not hit if exclude else hit


def evaluate(spec: ResourceSpec, result: dict[str, Any], *, fast: bool = False,
             auto_gpus: dict[str, list[int]] | None = None) -> Report:  # fmt: skip
    """Pure: the chief's JSON (or a chief-unreachable stand-in) -> rows."""
    hosts = [spec.alias(n) for n in spec.ranked_nodes()]
    chief = spec.alias(spec.chief)
    rows: list[Row] = []
    values: dict[str, dict[str, str]] = {}
    if "unreachable" in result:
        rows.append(Row(chief, "ssh", FAIL, result["unreachable"]))
        rows += [Row(h, "ssh", FAIL, "not checked: the chief is unreachable") for h in hosts if h != chief]
        return Report(rows, values, hosts)
    listeners = result.get("listeners", {})
    for port, lst in listeners.items():
        if lst.get("error"):
            rows.append(Row(chief, f"port {port}", FAIL, lst["error"]))
    facts_by_host: dict[str, dict[str, Any]] = {}
    for node in spec.ranked_nodes():
        h = spec.alias(node)
        r = result.get("nodes", {}).get(h, {})
        ssh = r.get("ssh", {})
        if not ssh.get("ok"):
            rows.append(
                Row(h, "ssh", FAIL, f"ssh from the chief {chief} ({node.address}): {ssh.get('error', 'no answer')}")
            )
            continue
        rows.append(Row(h, "ssh", OK, f"from the chief, BatchMode, strict host key ({ssh.get('seconds', 0):.1f}s)"))
        if "error" in r:
            rows.append(Row(h, "probe", FAIL, r["error"]))
            continue
        facts_by_host[h] = r["facts"]
    for node in spec.ranked_nodes():
        h = spec.alias(node)
        if h in facts_by_host:
            rows += _node_rows(spec, node, h, facts_by_host[h], listeners, fast, values, auto_gpus)
    rows += parity_rows(chief, facts_by_host, values, fast)
    rows += chief_fd_rows(chief, facts_by_host.get(chief), len(hosts))
    order = {h: i for i, h in enumerate(hosts)}
    rows.sort(key=lambda r: order.get(r.host, 0))  # stable: per host, checks in the order made
    return Report(rows, values, hosts)


def chief_fd_rows(chief: str, f: dict[str, Any] | None, n_hosts: int) -> list[Row]:
    """A failing row when the chief's open-files limit, as a job gets it, cannot hold the run's
    supervisor: it keeps one ssh per node (its guards) for the whole run. Nothing when it can."""
    if f is None:
        return []
    soft = ((f.get("env") or {}).get("nofile") or f.get("nofile") or [0, 0])[0]
    need = fds_for(n_hosts)
    if soft >= need:
        return []
    why = (
        f"ulimit -n {soft} on the chief; the run's supervisor holds one ssh per node ({n_hosts} nodes, about "
        f"{need} open files): raise nofile for the login user (/etc/security/limits.conf) on the chief"
    )
    return [Row(chief, "supervisor fds", FAIL, why)]


def _node_rows(
    spec: ResourceSpec, node: Any, h: str, f: dict[str, Any], listeners: dict[str, Any], fast: bool,
    values: dict[str, dict[str, str]], auto_gpus: dict[str, list[int]] | None = None,
) -> list[Row]:  # fmt: skip
    rows: list[Row] = []
    chief_addr = spec.chief.address
    for port, c in f.get("ports", {}).items():
        if listeners.get(port, {}).get("error"):
            rows.append(Row(h, f"port {port}", FAIL, f"not tested: the chief could not listen on {port}"))
        elif c.get("ok"):
            rows.append(Row(h, f"port {port}", OK, f"connected to {chief_addr}:{port} ({c['rtt_ms']:.1f} ms)"))
        else:
            rows.append(Row(h, f"port {port}", FAIL, f"{c.get('error')} (firewall on the chief, or a route?)"))
    env = f.get("env", {})
    v = values.setdefault(h, {})
    rows += env_rows(h, env, spec.launch.runner, v)
    rows += workdir_rows(
        h, f, spec.workdir.path if spec.workdir else "", v
    )  # the fast subset too: launch must not run a stale copy
    if fast:
        return rows
    route = f.get("route", {})
    setting = (env.get("ifnames") or {}).get("NCCL_SOCKET_IFNAME") or spec.network.socket_ifname
    if "error" in route:
        rows.append(Row(h, "interface", WARN, f"cannot tell the route to {chief_addr}: {route['error']}"))
    else:
        dev = str(route.get("dev"))
        detail = f"{dev} ({route.get('src')}) reaches the chief"
        if dev.startswith(BRIDGE_PREFIXES):
            rows.append(Row(h, "interface", WARN, f"{detail}, but {dev} looks like a container bridge/veth"))
        elif setting and setting != "auto" and not _ifname_matches(dev, setting):
            rows.append(Row(h, "interface", WARN, f"{detail}, but NCCL_SOCKET_IFNAME={setting}; NCCL/gloo "
                                                  "will use a different interface than the route"))  # fmt: skip
        else:
            rows.append(Row(h, "interface", OK, detail + (f"; NCCL_SOCKET_IFNAME={setting}" if setting else "")))
    offsets = [c["offset_s"] for c in f.get("ports", {}).values() if c.get("ok")]
    if offsets:
        off = offsets[0]
        status = WARN if abs(off) > CLOCK_WARN_S else OK
        rows.append(Row(h, "clock", status, f"offset to the chief {off * 1000:+.1f} ms"
                                             + ("; sync clocks (chrony/ntp)" if status == WARN else "")))  # fmt: skip
    rows.append(_gpu_row(node, h, f, env, v, auto_gpus))
    soft = (env.get("nofile") or f.get("nofile") or [0, 0])[0]  # as a job gets it (env.sh may raise it)
    rows.append(Row(h, "ulimit -n", WARN if soft < NOFILE_WARN else OK,
                    f"{soft}" + (f" (< {NOFILE_WARN}; DataLoader workers and NCCL can run out)" if soft < NOFILE_WARN
                                 else "")))  # fmt: skip
    rows += neighbour_rows(h, f, [n.address for n in spec.nodes if n is not node], setting or "")
    shm = f.get("shm_bytes")
    if shm is None:
        rows.append(Row(h, "/dev/shm", WARN, "no /dev/shm"))
    else:
        rows.append(Row(h, "/dev/shm", WARN if shm < SHM_WARN else OK,
                        _gib(shm) + (" (< 1 GiB: DataLoader workers die with bus errors; docker: --shm-size)"
                                     if shm < SHM_WARN else "")))  # fmt: skip
    disk = f.get("disk_free", {})
    free = disk.get("bytes", 0)
    status = FAIL if free < DISK_FAIL else WARN if free < DISK_WARN else OK
    rows.append(Row(h, "disk", status, f"{_gib(free)} free in {disk.get('path')}"))
    if not f.get("env_file"):
        rows.append(Row(h, "env file", WARN, "no cluster env file (NCCL/GLOO settings); run `nodeops setup`"))
    return rows


def neighbour_rows(h: str, f: dict[str, Any], peers_of: Sequence[str], ifname: str = "") -> list[Row]:
    """Whether the kernel's neighbour (ARP/NDP) table can hold this node's peers: every other
    node of the spec (``peers_of``, addresses) in the subnet of its interface to the chief takes
    an entry once the ranks connect (every node talks to the chief's store; gloo's full mesh
    and all-to-all talk to every node); nodes behind a router take none. An address that is a
    name counts as a peer. The limit holds for every interface together: where the ranks' own
    (``ifname``, NCCL_SOCKET_IFNAME's setting) is not the route's, every node counts. Past
    ``gc_thresh3`` (1,024 by default) the kernel says "neighbor table overflow" and new
    connections can fail with "No route to host". No row where the limit is not visible (a
    container's network namespace: the host's applies)."""
    neigh = f.get("neigh")
    route = f.get("route") or {}
    if not isinstance(neigh, dict) or not isinstance(neigh.get("limit"), int) or "error" in route:
        return []
    limit, family = neigh["limit"], neigh.get("family", "ipv4")
    dev = str(route.get("dev") or "")
    net = _network(str(route.get("net") or ""))
    if ifname and ifname != "auto" and dev and not _ifname_matches(dev, ifname):
        net, where = None, f"the cluster (NCCL/gloo use {ifname}, not {dev}, the route to the chief)"
    else:
        where = (f"{dev}'s subnet" if dev else "its subnet") + (f" {net}" if net is not None else "")
    peers = sum(1 for a in peers_of if net is None or _in(a, net))
    need = peers + NEIGH_SPARE
    if limit >= need:
        return [Row(h, "neighbours", OK, f"gc_thresh3 {limit}: room for {peers} peer(s) in {where}")]
    why = (
        f"gc_thresh3 {limit}, but {peers} peer(s) share {where} (about {need} neighbour entries with the "
        f"gateway and others): a job whose ranks all connect to each other can fail with 'No route to host'. "
        f"Raise it (as root): sysctl -w net.{family}.neigh.default.gc_thresh3={2 * need} "
        f"net.{family}.neigh.default.gc_thresh2={need} net.{family}.neigh.default.gc_thresh1={need // 4}, "
        "and in /etc/sysctl.d/ to keep it after a reboot"
    )
    return [Row(h, "neighbours", WARN, why)]


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(text, strict=False) if text else None
    except ValueError:
        return None


def _in(address: str, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Whether ``address`` is in ``net``; a name (not an address) counts as in it."""
    try:
        return ipaddress.ip_address(address) in net
    except ValueError:
        return True


def _gpu_row(node: Any, h: str, f: dict[str, Any], env: dict[str, Any], v: dict[str, str],
             auto_gpus: dict[str, list[int]] | None = None) -> Row:  # fmt: skip
    smi = f.get("nvidia_smi") or {}
    gpus = smi.get("gpus", [])
    if gpus:
        v["driver"] = shown(gpus[0].get("driver"))
    want = list(node.gpus) if isinstance(node.gpus, list) else []
    if node.gpus == "auto" or (auto_gpus is not None and h in auto_gpus and not want):
        # gpus: auto that setup has not discovered, or discovered none: 1 process, said plainly
        if node.gpus == "auto":
            return Row(h, "gpus", WARN, f"gpus: auto not discovered yet (run setup); counts 1 process for now "
                                        f"({len(gpus)} visible now)")  # fmt: skip
        return Row(h, "gpus", OK if not gpus else WARN,
                   "gpus: auto: no NVIDIA GPU found at setup; runs 1 process" if not gpus else
                   f"gpus: auto: none found at setup, but {len(gpus)} visible now: run setup again")  # fmt: skip
    if not want:
        return Row(h, "gpus", OK, f"none in the spec ({len(gpus)} visible)" if gpus else "none in the spec")
    if smi.get("rc") == 127:
        return Row(h, "gpus", FAIL, f"the spec lists GPUs {want}, but nvidia-smi is not installed (no driver?)")
    if smi.get("rc") != 0:
        return Row(h, "gpus", FAIL, f"nvidia-smi failed: {' '.join(smi.get('error') or [])}")
    seen = sorted(int(g["index"]) for g in gpus)
    missing = [i for i in want if i not in seen]
    if missing:
        return Row(h, "gpus", FAIL, f"the spec lists GPUs {want}; nvidia-smi shows {seen} (missing {missing})")
    torch_n = env.get("cuda_devices")
    if torch_n is not None and torch_n < len(want):
        why = f"torch.version.cuda={env.get('torch_cuda')}; a CPU build, or CUDA_VISIBLE_DEVICES?"
        return Row(h, "gpus", FAIL, f"nvidia-smi shows {len(seen)} GPUs but torch sees {torch_n} ({why})")
    names = sorted({str(g["name"]) for g in gpus})
    return Row(h, "gpus", OK, f"{len(seen)} visible ({', '.join(names)}), torch sees {torch_n}")
