"""The ssh transport of the controller: one command on many hosts at once, and the ssh argv
that reaches a host through a cluster's generated ssh_config."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import pwd
import re
import resource
import socket
import stat
from collections.abc import Callable, Hashable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import TypeVar

from nodeops.errors import ControllerLimitError
from nodeops.node import protocol as P

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


# What one ssh child in flight costs this process: the read ends of its stdout and stderr pipes,
# and the pipe ends Popen holds while it starts the child. The rest of the process (logs, the
# spec, ssh_config, Python's own) stays under FDS_RESERVED.
FDS_PER_SSH = 3
FDS_RESERVED = 64
FIX = "raise it in this shell (e.g. `ulimit -n 65536`; above the hard limit: nofile in /etc/security/limits.conf)"


def fds_for(streams: int) -> int:
    """Open files this process needs to hold ``streams`` ssh children at once."""
    return FDS_RESERVED + FDS_PER_SSH * streams


def width_for_fds(n_hosts: int, width: int | None, soft: int) -> int:
    """How many hosts a fan-out may have in flight under the soft open-files limit ``soft``: all
    (or ``width``) when it fits, else as many as fit (the rest wait their turn); 0 when not one fits."""
    wanted = max(1, min(n_hosts, width or n_hosts))
    return max(0, min(wanted, (soft - FDS_RESERVED) // FDS_PER_SSH))


def fd_limit(needed: int) -> int:
    """This process's soft open-files limit (RLIMIT_NOFILE), first raised towards ``needed`` (up to
    the hard limit) when it is lower; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def fd_refusal(what: str, streams: int, soft: int) -> str:
    return (f"{what} needs one ssh per host at once ({streams} hosts, about {fds_for(streams)} open files), "
            f"but this process may open {soft} (RLIMIT_NOFILE, the open-files limit): {FIX}")  # fmt: skip


def ensure_fds(what: str, streams: int) -> None:
    """Refuse, naming the limit and the fix, a step that must hold ``streams`` ssh children at once
    (they live for the whole step, so waiting for a free slot would never end) when this process
    cannot open that many files, even after raising its soft limit to the hard one."""
    soft = fd_limit(fds_for(streams))
    if soft < fds_for(streams):
        raise ControllerLimitError(fd_refusal(what, streams, soft))


def limit_error(e: BaseException) -> ControllerLimitError | None:
    """The controller's own limit behind ``e`` (too many open files, no more processes or threads)."""
    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return ControllerLimitError(f"this machine ran out of open files ({e.strerror}; RLIMIT_NOFILE {soft}): {FIX}")
    if (isinstance(e, OSError) and e.errno == errno.EAGAIN) or (
        isinstance(e, RuntimeError) and "can't start new thread" in str(e)
    ):
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        return ControllerLimitError(
            f"this machine cannot start another process or thread ({e}; RLIMIT_NPROC {soft}): raise it in this "
            "shell (e.g. `ulimit -u 65536`), or run on fewer hosts at once (--limit)"
        )
    return None


def fan_out(hosts: Sequence[K], fn: Callable[[K], T], width: int | None = None) -> dict[K, T]:
    """fn(host) on every host at once (one thread each, as pdsh does, or at most ``width``);
    host -> result, in order. Any hashable key works (a run id, a (host, config) pair).

    fn runs one short ssh (or a socket) per host, so a fan-out wider than this process's
    open-files limit allows is narrowed to what fits (the rest wait their turn), never left to
    fail halfway; a limit still hit is raised as ControllerLimitError, naming it and the fix."""
    n = max(1, min(len(hosts), width or len(hosts)))
    soft = fd_limit(fds_for(n))
    allowed = width_for_fds(len(hosts), width, soft)
    if allowed < 1:
        raise ControllerLimitError(fd_refusal("this step", n, soft))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=allowed) as pool:
            return dict(zip(hosts, pool.map(fn, hosts), strict=True))
    except (OSError, RuntimeError) as e:
        limit = limit_error(e)
        if limit is None:
            raise
        raise limit from e


def ssh_argv(ssh_config: Path, host: str, *command: str, connect_timeout: int | None = None) -> list[str]:
    """ssh to a host through the cluster's generated ssh_config (strict host keys, multiplexed).
    ``connect_timeout``: seconds for the connection and its handshake, instead of the usual 10
    (ssh keeps an option's first value: this one comes before them)."""
    ensure_ssh_dir()  # where the ssh_config's masters live (once per process)
    first = ["-o", f"ConnectTimeout={connect_timeout}"] if connect_timeout is not None else []
    opts = [a for o in P.SSH_TIMEOUTS for a in ("-o", o)]
    return ["ssh", "-F", str(ssh_config), *first, *opts, host, *command]


# What ssh says when it never reached the host (no connection made): a cluster torn down, a
# host off. Not an authentication or host-key failure (the host answered), and not a connection
# dropped later, nor sshd's MaxStartups refusing one of many: those say nothing about the next.
NOT_REACHED = re.compile(
    r"Connection timed out|Connection to \S+ port \d+ timed out|No route to host|Connection refused|"
    r"Could not resolve hostname|Network is unreachable|Name or service not known|"
    r"Temporary failure in name resolution"
)


def not_reached(stderr: str) -> bool:
    """Whether ssh's own words say it never reached the host (see NOT_REACHED)."""
    return NOT_REACHED.search(stderr) is not None


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


# A Unix socket's path holds at most 103 bytes on macOS (104 with its NUL; 107 on Linux), and ssh
# binds a master's socket at PATH.<16 random characters> before renaming it to PATH: a ControlPath
# longer than 86 bytes fails every connection ("unix_listener: ... too long for Unix domain socket").
SOCKET_PATH_MAX = 103
MUX_SUFFIX = len(".0123456789abcdef")


def ssh_home() -> str:
    """The home ssh expands ``~`` to: the user's entry in the passwd database, not ``$HOME``."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # no entry (a container's arbitrary uid): ssh then uses $HOME
        return os.path.expanduser("~")


def fits_control_path(path: str) -> bool:
    """Whether ssh can bind a master's socket at ``path`` on every platform (``~`` as ssh
    expands it; the length that counts is the string's, whatever links it goes through)."""
    if path == "~" or path.startswith("~/"):
        path = ssh_home() + path[1:]
    return len(os.fsencode(path)) + MUX_SUFFIX <= SOCKET_PATH_MAX


def own_dir(d: Path) -> Path | None:
    """``d``, made (mode 0700) where missing, if it is a real dir of this user's that no one else
    may enter; else None (someone else's, a symlink, or open to others: a socket there could be
    another's)."""
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return d


def short_private_dirs() -> Iterator[Path]:
    """Short dirs of this user's own for ssh's control sockets where the usual place makes their
    paths too long: ``$XDG_RUNTIME_DIR/nodeops`` (``/run/user/<uid>``: private by design), then
    ``/tmp/nodeops-<uid>``; each made only when asked for, and only if it is this user's alone."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    for d in ([Path(runtime) / "nodeops"] if runtime else []) + [Path("/tmp") / f"nodeops-{os.getuid()}"]:
        mine = own_dir(d)
        if mine is not None:
            yield mine


@cache
def ensure_ssh_dir() -> None:
    """ssh binds its masters' sockets in ``~/.ssh`` (the generated ssh_config's ControlPath): on a
    controller that never used ssh it does not exist, and every connection would fail."""
    with contextlib.suppress(OSError):
        Path(ssh_home(), ".ssh").mkdir(mode=0o700, exist_ok=True)
