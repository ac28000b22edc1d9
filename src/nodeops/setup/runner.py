"""The only module that imports ansible_runner.

Every run gets its own private_data_dir under ``$NODEOPS_HOME/runs/`` (mode 0700), which
is kept afterwards with its artifacts. A tuned ``ansible.cfg`` is generated into it.
Secrets reach Ansible through a 0600 vars file passed as ``-e @file`` (so never on a
command line) that is deleted when the run ends; ansible-runner's own env files are
suppressed. The result is a typed summary built from rc, status and per-host stats.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import itertools
import json
import os
import re
import resource
import secrets as _secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeops.errors import NodeopsError
from nodeops.quoting import ansible_yaml, ssh_args_options
from nodeops.resources import collections_path, data_dir, nodeops_home
from nodeops.setup.render import pins_digest
from nodeops.transport import fits_control_path, short_private_dirs

# Ansible needs roughly this many file descriptors per fork (pipes, ssh control sockets);
# with the usual soft limit of 1024, more than ~74 forks fail with "Too many open files".
FDS_PER_FORK = 12
FDS_RESERVED = 128
MAX_FORKS = 100
# Environment passed to ansible-playbook: ANSIBLE_*, ansible-runner's own variables and this
# allow-list. Nothing else of the caller's environment (tokens, cloud credentials, a secret's
# from_env source) reaches Ansible's process tree or the run's artifacts. ansible-runner
# itself copies os.environ whole, so the filter is applied to its prepared config.
ENV_PREFIXES = ("ANSIBLE_", "RUNNER_", "AWX_", "MITOGEN_")
ENV_ALLOW = ("HOME", "USER", "LOGNAME", "PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSH_AUTH_SOCK", "VIRTUAL_ENV",
             "PYTHONPATH", "DOCKER_HOST")  # fmt: skip


class RunnerError(NodeopsError):
    pass


@dataclass
class HostResult:
    host: str
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    task: str = ""  # the task this host is on (for progress) or last ran
    errors: list[str] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)  # unified diffs of changed files (--diff)
    warnings: list[str] = field(default_factory=list)  # tasks whose failure a role allows (ignore_errors)
    in_play: bool = False  # False for hosts --limit left out

    @property
    def status(self) -> str:
        if self.unreachable:
            return "unreachable"
        if self.failed:
            return "failed"
        return "ok"


@dataclass
class RunResult:
    rc: int
    status: str
    hosts: dict[str, HostResult]
    private_data_dir: Path
    seconds: float
    ansible: bool = True  # False when setup's fast path found nothing to do and ran no play

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.status == "successful" and all(h.status == "ok" for h in self.hosts.values())

    @property
    def changed(self) -> int:
        return sum(h.changed for h in self.hosts.values())

    @property
    def bad_hosts(self) -> list[str]:
        """Hosts that failed or were unreachable."""
        return [h.host for h in self.hosts.values() if h.status != "ok"]


def runs_dir() -> Path:
    base = nodeops_home()
    d = base / "runs"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def raise_fd_limit() -> int:
    """Raise this process's soft fd limit to the hard limit (children inherit it); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def forks_for(n_hosts: int, fd_limit: int) -> int:
    """One fork per host, capped, and never more than the fd limit allows."""
    by_fds = max(1, (fd_limit - FDS_RESERVED) // FDS_PER_FORK)
    return max(1, min(n_hosts, MAX_FORKS, by_fds))


# mitogen keeps one Python per node for the whole run, so a task costs a message instead of an
# ssh exchange and a fresh interpreter on the node; but its per-host bootstrap and controller-side
# routing cost more controller CPU than the ~20 tasks of a no-op setup save. Measured with
# bench/scale_bench.py on this project's 2-core machine (no-op setup, wall s / controller CPU s):
# 1 node 6.8/5.9 with mitogen vs 8.9/5.3 without; 4 nodes 15.0/14.3 vs 13.2/9.3; 8 nodes
# 24.1/23.2 vs 20.1/14.1. So: mitogen only for small plays, plain ssh (pipelining, ControlPersist)
# beyond, where the controller's CPU per node is what grows.
MITOGEN_MAX_HOSTS = 2


def mitogen_strategy_dir(hosts: int = 1) -> Path | None:
    """mitogen's strategy plugins, when mitogen is installed and the play is small (at most
    MITOGEN_MAX_HOSTS hosts); NODEOPS_MITOGEN=1 uses it for any size, NODEOPS_MITOGEN=0 never."""
    setting = os.environ.get("NODEOPS_MITOGEN", "auto").strip().lower()
    if setting in ("0", "false", "no", "off") or (
        setting not in ("1", "true", "yes", "on") and hosts > MITOGEN_MAX_HOSTS
    ):
        return None
    spec = importlib.util.find_spec("ansible_mitogen")
    if spec is None or spec.origin is None:
        return None
    d = Path(spec.origin).parent / "plugins" / "strategy"
    return d if d.is_dir() else None


CONTROL_NAME = 10  # Ansible's own name for a host's socket: 10 hex digits of (host, port, user)


def control_dir_for(identity: str) -> Path | None:
    """The dir of one identity set's ssh masters: ``$NODEOPS_HOME/cp/<identity>``, or where that
    makes a socket's path too long for ssh (a long home), the same under a short private dir
    (:func:`nodeops.resources.short_private_dirs`); None when none fits (the run then goes
    without ssh masters, slower but working). The path is checked as Ansible will use it:
    resolved (``unfrackpath``: ~, variables, links), so it is returned resolved."""
    for base in itertools.chain([nodeops_home()], short_private_dirs()):  # lazily: made only if needed
        d = Path(os.path.realpath(os.path.expandvars(os.path.expanduser(base / "cp" / identity))))
        if fits_control_path(str(d / ("x" * CONTROL_NAME))):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            return d
    return None


def ansible_cfg(forks: int, control_dir: Path | None, mitogen: Path | None = None) -> str:
    """Tuned settings: pipelining, ControlPersist, no implicit fact gathering, pinned host keys,
    and mitogen's strategy when available. Each host's ssh master is a socket in ``control_dir``
    named by Ansible (10 hex digits: a short path, see :func:`control_dir_for`); with no
    ``control_dir``, no masters."""
    mux = (
        ["ssh_args = -o ControlMaster=auto -o ControlPersist=120s -o PreferredAuthentications=publickey",
         f"control_path_dir = {control_dir}"] if control_dir is not None else
        ["ssh_args = -o ControlMaster=no -o PreferredAuthentications=publickey"]
    )  # fmt: skip
    strategy = [f"strategy_plugins = {mitogen}", "strategy = mitogen_linear"] if mitogen else []
    return "\n".join(
        [
            "# Generated by nodeops for this run.",
            "[defaults]",
            *strategy,
            f"forks = {forks}",
            "gathering = explicit",
            "host_key_checking = True",
            f"roles_path = {data_dir('roles')}",
            "retry_files_enabled = False",
            "interpreter_python = auto_silent",
            "timeout = 10",
            "internal_poll_interval = 0.001",
            "",
            "[ssh_connection]",
            "pipelining = True",
            *mux,
            "",
        ]
    )


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def connection_identity(host_vars: Iterable[Mapping[str, Any]]) -> str:
    """Digest naming the ssh control dir of a run: users, keys, ssh args and the contents of the
    known_hosts files those args pin (render.pins_digest)."""

    ids, pins = set(), set()
    for hv in host_vars:
        args = f"{hv.get('ansible_ssh_common_args', '')} {hv.get('ansible_ssh_extra_args', '')}".strip()
        ids.add(f"{hv.get('ansible_user', '')}:{hv.get('ansible_ssh_private_key_file', '')}:{args}")
        with contextlib.suppress(ValueError):  # unbalanced quotes: Ansible says so; the args are in ids
            pins.add(ssh_args_options(args).get("userknownhostsfile", ""))
    # this machine's name too: a home shared over NFS by two controllers keeps their masters apart
    return hashlib.sha256("\0".join([socket.gethostname(), *sorted(ids), pins_digest(pins)]).encode()).hexdigest()[:10]


# ssh's own reason inside Ansible's message, e.g. 'Data could not be sent to remote host "X".
# Make sure this host can be reached over ssh: ssh: connect to host X port 22: Connection timed out'
_SSH_REASON = re.compile(r"^(?:.*\s)?(ssh: .*|Host key verification failed.*)$")  # the last "ssh: "


def _event_error(res: Mapping[str, Any]) -> str:
    failed_items = [r for r in res.get("results") or () if isinstance(r, Mapping) and r.get("failed")]
    if failed_items:  # a loop: each failed item's own message (an input check names only its rule), once
        said: dict[str, int] = {}
        for r in failed_items:
            why = _event_error(r)
            said[why] = said.get(why, 0) + 1
        return "; ".join(why + (f" ({n} items)" if n > 1 else "") for why, n in said.items())
    msg = str(res.get("msg") or "")
    # For unreachable hosts, ssh's own line ("ssh: connect to host ...: No route to host") says why.
    ssh_lines = [m.group(1).strip() for m in map(_SSH_REASON.search, msg.splitlines()) if m]
    if ssh_lines:
        return ssh_lines[-1]
    if msg == "non-zero return code":  # a command or shell task: its own stderr says why
        msg = ""
    parts = [msg]
    for key in ("stderr", "module_stderr", "stdout"):
        if res.get(key) and not parts[0]:
            parts.append(_first_line(str(res[key])))
    return " ".join(p for p in parts if p).strip() or json.dumps(res)[:300]


def run_playbook(
    playbook: str,
    inventory: Mapping[str, Any],
    *,
    kind: str = "setup",
    secrets: Mapping[str, str] | None = None,
    extravars: Mapping[str, Any] | None = None,
    limit: str | None = None,
    tags: Sequence[str] = (),
    skip_tags: Sequence[str] = (),
    check: bool = False,
    diff: bool = False,
    verbosity: int = 0,
    on_update: Callable[[dict[str, HostResult]], None] | None = None,
    cancel: threading.Event | None = None,
    cfg: str | None = None,
) -> RunResult:
    """Run a shipped playbook (name under playbooks/) against an inventory dict.

    ``cfg`` replaces the generated ansible.cfg (the benchmark uses it to compare configs).
    """
    import ansible_runner  # type: ignore[import-untyped]  # lazy: ~0.3 s to import; only setup/launch/check need it

    host_vars = _inventory_host_vars(inventory)
    hosts_all = list(host_vars)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    pdd = runs_dir() / f"{kind}-{stamp}-{_secrets.token_hex(3)}"
    pdd.mkdir(mode=0o700)
    (pdd / "nodeops.pid").write_text(f"{os.getpid()}\n")  # `nodeops clean` keeps the dir while this lives
    (pdd / "inventory").mkdir(mode=0o700)
    (pdd / "inventory" / "hosts.yml").write_text(ansible_yaml(dict(inventory)))
    # ssh masters per identity set: runs with other keys, users, ssh options or host-key pins never
    # share a connection (a master checked the host key once; a run with other pins must check again).
    control_dir = control_dir_for(connection_identity(host_vars.values()))
    forks = forks_for(len(hosts_all), raise_fd_limit())
    (pdd / "ansible.cfg").write_text(
        cfg if cfg is not None else ansible_cfg(forks, control_dir, mitogen_strategy_dir(len(hosts_all)))
    )

    results = {h: HostResult(h) for h in hosts_all}
    secrets_file = pdd / "secrets.yml"
    cmdline: list[str] = []
    # Extra vars go in 0600 files passed as -e @file: never values on a command line.
    var_files: list[tuple[Path, dict[str, Any]]] = []
    if extravars:
        var_files.append((pdd / "vars.yml", dict(extravars)))
    if secrets:
        var_files.append((secrets_file, {"nodeops_secret_env": dict(secrets)}))
    for path, data in var_files:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(ansible_yaml(data))
        cmdline += ["-e", f"@{path}"]
    if check:
        cmdline.append("--check")
    if diff:
        cmdline.append("--diff")
    if tags:
        cmdline += ["--tags", ",".join(tags)]
    if skip_tags:
        cmdline += ["--skip-tags", ",".join(skip_tags)]

    def on_event(event: dict[str, Any]) -> bool:
        data = event.get("event_data") or {}
        host = data.get("host")
        name = event.get("event", "")
        if host in results:
            hr = results[host]
            if name == "runner_on_start":
                hr.task = data.get("task", "")
                hr.in_play = True
            elif name == "runner_on_ok":
                res = data.get("res") or {}
                if diff and res.get("changed"):
                    hr.diffs += unified_diffs(data.get("task", ""), res.get("diff"))
                # a module's own warnings (relay_sync: a node the chief could not reach)
                hr.warnings += [f"{data.get('task', '')}: {w}" for w in res.get("warnings") or [] if isinstance(w, str)]
            elif name == "runner_on_failed":
                said = f"{data.get('task', '')}: {_event_error(data.get('res') or {})}"
                (hr.warnings if data.get("ignore_errors") else hr.errors).append(said)
            elif name == "runner_on_unreachable":
                hr.errors.append(f"unreachable: {unreachable_error(data.get('res') or {}, host_vars[host], host)}")
            if on_update:
                on_update(results)
        return True

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_ALLOW}
    # ansible-playbook sits beside this interpreter (the same venv), whether or not it is on PATH.
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", os.defpath)])
    # ansible-runner sets ANSIBLE_HOST_KEY_CHECKING=False unless the variable is present, and the
    # environment beats ansible.cfg. Host keys are pinned, so say it explicitly.
    env["ANSIBLE_HOST_KEY_CHECKING"] = "True"
    if not (Path(bindir) / "ansible-playbook").exists() and shutil.which("ansible-playbook", path=env["PATH"]) is None:
        raise RunnerError("ansible-playbook not found; reinstall nodeops (it depends on ansible-core)")
    env["ANSIBLE_CONFIG"] = str(pdd / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    # The roles call the collection's modules by FQCN (nodeops.cluster.*): this tree is that
    # collection, ahead of any other copy installed in ~/.ansible (ansible.posix and the rest of
    # the `ansible` package still come from site-packages).
    env["ANSIBLE_COLLECTIONS_PATH"] = str(collections_path(runs_dir().parent / "collections"))
    t0 = time.monotonic()
    try:
        r = ansible_runner.interface.init_runner(
            private_data_dir=str(pdd),
            playbook=str(data_dir("playbooks") / playbook),
            inventory=str(pdd / "inventory" / "hosts.yml"),
            envvars=env,
            cmdline=" ".join(cmdline) if cmdline else None,
            limit=limit,
            forks=forks,
            verbosity=verbosity,
            quiet=True,
            suppress_env_files=True,
            event_handler=on_event,
            # Always pass a callback: without one, ansible-runner installs its own SIGINT/SIGTERM
            # handlers for the whole process and never restores them, so Ctrl-C stops working.
            cancel_callback=(lambda: cancel.is_set()) if cancel else (lambda: False),
        )
        r.config.env = {k: v for k, v in r.config.env.items() if k.startswith(ENV_PREFIXES) or k in env}
        r.config.env.update(env)
        r.run()
    finally:
        secrets_file.unlink(missing_ok=True)
    for stat, attr in (("ok", "ok"), ("changed", "changed"), ("failures", "failed"), ("dark", "unreachable"),
                       ("skipped", "skipped")):  # fmt: skip
        for host, count in ((r.stats or {}).get(stat) or {}).items():
            if host in results:
                setattr(results[host], attr, count)
    for hr in results.values():
        hr.task = ""
    if on_update:
        on_update(results)
    return RunResult(rc=r.rc, status=r.status, hosts=results, private_data_dir=pdd, seconds=time.monotonic() - t0)


def unified_diffs(task: str, diff: Any) -> list[str]:
    """Ansible's ``diff`` result (a dict or a list of them) as unified diffs, one per file."""

    out = []
    for d in diff if isinstance(diff, list) else [diff] if isinstance(diff, dict) else []:
        before, after = d.get("before"), d.get("after")
        if not isinstance(before, str) or not isinstance(after, str) or before == after:
            if d.get("prepared"):
                out.append(f"{task}:\n{d['prepared']}")
            continue
        head_a = str(d.get("before_header") or "before")
        head_b = str(d.get("after_header") or "after")
        lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     f"{head_a} (now)", f"{head_b} (wanted)")  # fmt: skip
        out.append(f"{task}:\n" + "".join(ln if ln.endswith("\n") else ln + "\n" for ln in lines))
    return out


def _inventory_host_vars(inventory: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}

    def walk(group: Mapping[str, Any]) -> None:
        for h, hv in (group.get("hosts") or {}).items():
            out.setdefault(h, hv or {})
        for child in (group.get("children") or {}).values():
            walk(child or {})

    for group in inventory.values():
        walk(group or {})
    return out


def _inventory_hosts(inventory: Mapping[str, Any]) -> list[str]:
    return list(_inventory_host_vars(inventory))


def unreachable_error(res: Mapping[str, Any], hv: Mapping[str, Any], host: str) -> str:
    """ssh's own line when Ansible has it; else (mitogen says only "Connection timed out.") one
    in the same form, naming the address and port."""
    err = _event_error(res)
    if err.startswith(("ssh:", "Host key")):
        return err
    err = err.removeprefix("Task failed: ").strip().rstrip(".")
    return f"ssh: connect to host {hv.get('ansible_host', host)} port {hv.get('ansible_port', 22)}: {err}"
