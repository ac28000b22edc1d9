"""The ssh transport of the controller: one command on many hosts at once, and the ssh argv
that reaches a host through a cluster's generated ssh_config."""

from __future__ import annotations

import concurrent.futures
import socket
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

from nodeops.node import protocol as P

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def fan_out(hosts: Sequence[K], fn: Callable[[K], T], width: int | None = None) -> dict[K, T]:
    """fn(host) on every host at once (one thread each, as pdsh does, or at most ``width``);
    host -> result, in order. Any hashable key works (a run id, a (host, config) pair)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(hosts), width or len(hosts)))) as pool:
        return dict(zip(hosts, pool.map(fn, hosts), strict=True))


def ssh_argv(ssh_config: Path, host: str, *command: str) -> list[str]:
    """ssh to a host through the cluster's generated ssh_config (strict host keys, multiplexed)."""
    opts = [a for o in P.SSH_TIMEOUTS for a in ("-o", o)]
    return ["ssh", "-F", str(ssh_config), *opts, host, *command]


def last_line(text: str, default: str) -> str:
    """The last non-blank line of a command's stderr (ssh puts its reason there), or default."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else default


def tcp_reason(address: str, port: int, timeout: float = 5.0) -> str:
    """Why this machine cannot open a TCP connection to ``address:port`` (the OS's words, e.g.
    'No route to host', 'timed out'); '' when it can. No ssh: no key or host key is needed."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"connecting to {address}:{port} timed out after {timeout:g}s"
    except OSError as e:
        return f"{address}:{port}: {e.strerror or e}"
