"""`nodeops setup`: check the request, render the spec, run the roles, keep what they gave.

The CLI draws the live progress (``on_update``) and the summary; everything else is here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nodeops import backends, gpus, setup_state
from nodeops.backends.base import Sink
from nodeops.errors import UsageError
from nodeops.loading import load_spec
from nodeops.render import inventory, require_controller_files, resolve_secrets
from nodeops.runner import HostResult, RunResult, run_playbook

ROLE_TAGS = setup_state.ROLES
PHASE_TAGS = ("install", "configure", "verify")
# Each role's own input checks (one assert task per role): nodeops has checked the same rules
# on the spec, with line numbers, and the controller's files (render.controller_issues), before
# any host is touched. Infra repos running the roles keep them.
ROLE_INPUT_CHECKS = tuple(f"{r}_preflight" for r in ROLE_TAGS if r != "packages")


def resolve_limit(by_name: dict[str, str], limit: str | None) -> list[str] | None:
    """--limit's names or addresses as spec host names (exit 2 naming any unknown one)."""
    if limit is None:
        return None
    by_address = {addr: name for name, addr in by_name.items()}
    out, unknown = [], []
    for item in (i.strip() for i in limit.split(",")):
        name = item if item in by_name else by_address.get(item)
        if name is None:
            unknown.append(item or "''")
        elif name not in out:
            out.append(name)
    if unknown or not out:
        known = ", ".join(f"{n} ({a})" for n, a in by_name.items())
        raise UsageError(f"--limit: {', '.join(unknown) or 'nothing given'} not in the spec; hosts: {known}")
    return out


def check_targets(tags: Sequence[str]) -> None:
    bad = [t for t in tags if t not in ROLE_TAGS + PHASE_TAGS]
    if bad:
        raise UsageError(f"--tags: unknown {', '.join(bad)}; use {', '.join(ROLE_TAGS + PHASE_TAGS)}")


@dataclass
class SetupRequest:
    spec_path: Path
    group: str | None = None
    tags: list[str] = field(default_factory=list)  # roles or phases, already split on commas
    limit: str | None = None  # comma-separated spec names or addresses
    check: bool = False  # Ansible check mode
    diff: bool = False
    verbose: int = 0


def setup(request: SetupRequest, sink: Sink, on_update: Callable[[dict[str, HostResult]], None] | None = None,
          cancel: threading.Event | None = None) -> RunResult:  # fmt: skip
    """Run setup.yml on the spec's hosts; returns Ansible's result (the caller judges and shows
    it). After a successful run outside check mode, what the roles that ran gave each host is
    recorded (setup_state), for `launch` and `check` to compare specs with."""
    loaded = load_spec(request.spec_path, request.group)
    for w in loaded.warnings:
        sink.note(str(w))
    by_name = {loaded.spec.alias(n): n.address for n in loaded.spec.ranked_nodes()}
    tags = list(request.tags)
    check_targets(tags)
    skip: tuple[str, ...] = ROLE_INPUT_CHECKS
    backend = backends.for_spec(loaded.spec)
    if backend.setup_skips:
        if any(t in backend.setup_skips for t in tags):
            raise UsageError(f"--tags {', '.join(t for t in tags if t in backend.setup_skips)}: not used with "
                             f"backend: {backend.name} (nothing was run)")  # fmt: skip
        skip = (*skip, *backend.setup_skips)
    limited = resolve_limit(by_name, request.limit)
    require_controller_files(loaded, os.environ, setup=True, tags=tags)
    if gpus.auto_nodes(loaded):  # before rendering: the hostfile's slots and nodeops_gpus need them
        loaded, found = gpus.setup_discover(loaded, limited or None)
        if found:
            said = [f"{h}: {len(ids)} GPU(s)" if ids else f"{h}: no NVIDIA GPU, 1 process" for h, ids in found.items()]
            sink.note("==> gpus: auto: " + ", ".join(said))
    inv = inventory(loaded, os.environ)
    chief = next(iter(by_name))
    if limited and chief not in limited and (not tags or "ssh_mesh" in tags) and "ssh_mesh" not in skip:
        limited.insert(0, chief)
        sink.note(f"note: the chief {chief} joins --limit: ssh_mesh needs its key (use --tags to skip ssh_mesh)")
    secrets = resolve_secrets(loaded.spec, os.environ)
    result = run_playbook(
        "setup.yml", inv, secrets=secrets, limit=",".join(limited) if limited else None, tags=tags,
        skip_tags=skip, check=request.check, diff=request.diff, verbosity=request.verbose,
        on_update=on_update, cancel=cancel,
    )  # fmt: skip
    roles = [r for r in (tags or ROLE_TAGS) if r in ROLE_TAGS and r not in skip]
    if result.ok and not request.check and roles:
        try:
            setup_state.record(loaded, [h.host for h in result.hosts.values() if h.in_play], roles)
        except OSError as e:  # setup itself succeeded: say what launch/check will miss
            sink.note(f"warning: could not keep the setup record ({e}); launch and check will not compare "
                      "the spec with this setup")  # fmt: skip
    return result
