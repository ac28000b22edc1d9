"""What one command costs the controller and the chief, sampled from this machine's /proc while it runs.

- controller: the command's process tree plus the ssh ControlMaster processes that hold a
  connection into the sandbox (they leave the tree when they daemonize): their open files
  (/proc/PID/fd), and the TCP connections from this machine to the sandbox's sshd ports
  (/proc/net/tcp), i.e. what `ss -tn dst SUBNET dport 22` lists;
- chief: node1's container (its cgroup's processes, read from the host as root): their open
  files, its TCP connections (inbound ssh, outbound ssh, all established) and the container's
  CPU seconds (the cgroup's cpu counter, read before and after).

Peaks over the samples (every ``every`` seconds) are reported. Nothing runs inside the nodes to
sample them, so the sampling does not add to what it measures there.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
ESTABLISHED = "01"


@dataclass
class Cost:
    ctl_fds: int = 0  # summed over the processes (RLIMIT_NOFILE is per process: see ctl_fds_max)
    ctl_fds_max: int = 0  # the most one controller process held
    ctl_procs: int = 0
    ctl_ssh: int = 0  # TCP connections controller -> sandbox sshd
    chief_fds: int = 0
    chief_procs: int = 0
    chief_ssh_in: int = 0
    chief_ssh_out: int = 0
    chief_tcp: int = 0
    chief_cpu: float = 0.0  # seconds
    mem_avail_min_gib: float = float("inf")
    samples: int = 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _tcp_rows(pid: str | None = None) -> list[tuple[str, int, str, int, str, str]]:
    """(local ip, local port, remote ip, remote port, state, inode) of the netns of ``pid`` (this
    process's when None), IPv4 and IPv4-mapped IPv6."""
    base = PROC / (pid or "self") / "net"
    rows = []
    for name in ("tcp", "tcp6"):
        for line in _read(base / name).splitlines()[1:]:
            parts = line.split()
            if len(parts) < 10:
                continue
            (lip, lport), (rip, rport) = (p.split(":") for p in parts[1:3])
            rows.append((_ip(lip), int(lport, 16), _ip(rip), int(rport, 16), parts[3], parts[9]))
    return rows


def _ip(hexip: str) -> str:
    raw = bytes.fromhex(hexip)
    if len(raw) == 16:  # ::ffff:a.b.c.d is stored as 4 little-endian words; v4 is the last one
        raw = raw[12:]
    return str(ipaddress.IPv4Address(raw[::-1]))


def _fds(pid: str) -> int:
    try:
        return len(os.listdir(PROC / pid / "fd"))
    except OSError:
        return 0


def _tree(root: int) -> set[str]:
    children: dict[str, list[str]] = {}
    for d in os.listdir(PROC):
        if d.isdigit():
            stat = _read(PROC / d / "stat")
            if stat:
                children.setdefault(stat.rsplit(")", 1)[1].split()[1], []).append(d)
    out, todo = set(), [str(root)]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _holders(inodes: set[str]) -> set[str]:
    """The ssh processes on this machine that hold one of these sockets."""
    out = set()
    for d in os.listdir(PROC):
        if not d.isdigit() or _read(PROC / d / "comm").strip() != "ssh":
            continue
        try:
            links = {os.readlink(PROC / d / "fd" / f) for f in os.listdir(PROC / d / "fd")}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            out.add(d)
    return out


def cgroup_dir(container_id: str, controller: str) -> Path | None:
    for cand in (CGROUP / controller / "docker" / container_id,  # v1, cgroupfs driver
                 CGROUP / controller / "system.slice" / f"docker-{container_id}.scope",  # v1, systemd
                 CGROUP / "system.slice" / f"docker-{container_id}.scope",  # v2, systemd
                 CGROUP / "docker" / container_id):  # v2, cgroupfs  # fmt: skip
        if cand.is_dir():
            return cand
    return None


def cpu_seconds(container_id: str) -> float:
    v1 = cgroup_dir(container_id, "cpuacct")
    if v1 is not None and (v1 / "cpuacct.usage").is_file():
        return int(_read(v1 / "cpuacct.usage") or 0) / 1e9
    v2 = cgroup_dir(container_id, "")
    for line in _read(v2 / "cpu.stat").splitlines() if v2 else ():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    return float("nan")


def container_pids(container_id: str) -> list[str]:
    d = cgroup_dir(container_id, "pids") or cgroup_dir(container_id, "")
    return _read(d / "cgroup.procs").split() if d else []


def container_cmdlines(container_id: str) -> list[str]:
    """Every process of the container, as `ps -eo args` shows it (read from the host)."""
    out = []
    for pid in container_pids(container_id):
        raw = _read(PROC / pid / "cmdline")
        if raw:
            out.append(raw.replace("\0", " ").strip())
    return out


def mem_available_gib() -> float:
    for line in _read(PROC / "meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class Sampler:
    """Samples while a command runs: ``with Sampler(pid, subnet, chief_id) as s: ...; s.cost``."""

    def __init__(self, root_pid: int, subnet: str, chief_id: str, every: float = 0.25) -> None:
        self.root, self.net, self.chief, self.every = root_pid, ipaddress.ip_network(subnet), chief_id, every
        self.cost = Cost()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._cpu0 = 0.0

    def __enter__(self) -> Sampler:
        self._cpu0 = cpu_seconds(self.chief)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cost.chief_cpu = cpu_seconds(self.chief) - self._cpu0

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every):
                return

    def sample(self) -> None:
        c = self.cost
        ours = {r[5] for r in _tcp_rows() if r[4] == ESTABLISHED and r[3] == 22
                and ipaddress.ip_address(r[2]) in self.net}  # fmt: skip
        pids = _tree(self.root) | _holders(ours)
        fds = [_fds(p) for p in pids]
        self._peak("ctl_fds", sum(fds))
        self._peak("ctl_fds_max", max(fds, default=0))
        self._peak("ctl_procs", len(pids))
        self._peak("ctl_ssh", len(ours))
        chief = container_pids(self.chief)
        self._peak("chief_fds", sum(_fds(p) for p in chief))
        self._peak("chief_procs", len(chief))
        rows = [r for r in _tcp_rows(chief[0]) if r[4] == ESTABLISHED] if chief else []
        self._peak("chief_ssh_in", sum(1 for r in rows if r[1] == 22))
        self._peak("chief_ssh_out", sum(1 for r in rows if r[3] == 22))
        self._peak("chief_tcp", len(rows))
        c.mem_avail_min_gib = min(c.mem_avail_min_gib, mem_available_gib())
        c.samples += 1

    def _peak(self, name: str, value: int) -> None:
        setattr(self.cost, name, max(getattr(self.cost, name), value))
