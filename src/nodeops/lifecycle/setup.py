"""`nodeops setup`: check the request, render the spec, run the roles, keep what they gave.

The CLI draws the live progress (``on_update``) and the summary; everything else is here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeops import backends
from nodeops.backends.base import Sink
from nodeops.errors import NodeopsError, UsageError
from nodeops.setup import fast as setup_fast
from nodeops.setup import gpus
from nodeops.setup import state as setup_state
from nodeops.setup.render import inventory, require_controller_files, resolve_secrets
from nodeops.setup.runner import HostResult, RunResult, run_playbook
from nodeops.spec.loading import load_spec
from nodeops.spec.model import LoadedSpec

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
    full: bool = False  # run every role on every host, even where the probe finds nothing to do


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
    started = time.monotonic()
    roles_by_host = setup_fast.roles_of(inv, skip)
    wanted = setup_fast.inputs(inv)
    probed: list[str] = []  # hosts the fast path found as recorded (not in the play)
    manifest: dict[str, Any] | None = None  # the workdir source's, built once (by the first probe)
    looked = False
    if not (request.full or tags or limited or request.check or request.diff):
        record = setup_state.load(loaded.cluster_name)
        if record and any(isinstance(e.get("digests"), dict) for e in record.values()):
            sink.note(f"==> probing {len(by_name)} node(s) against the setup record (setup --full skips this)")
            manifest, looked = setup_fast.source_manifest(loaded, inv), True
            seen = setup_fast.probe(loaded, inv, setup_fast.plans(inv, roles_by_host, manifest), secrets)
            run = setup_fast.decide(roles_by_host, wanted, record, seen, by_name)
            setup_fast.add_gate(run, roles_by_host, setup_state.differences(loaded) or [], chief)
            need = [h for h, why in run.items() if why]
            if not need:
                hosts = {h: HostResult(h, ok=len(r), in_play=True, task="as recorded")
                         for h, r in roles_by_host.items()}  # fmt: skip
                return RunResult(0, "successful", hosts, setup_state.record_path(loaded.cluster_name).parent,
                                 time.monotonic() - started, ansible=False)  # fmt: skip
            for h in need:
                sink.note(f"    {h}: {setup_fast.reasons(run[h])}")
            wd = loaded.spec.workdir
            relay = inv["all"]["vars"]["nodeops_relay"] and wd is not None and wd.sync == "rsync"
            joined = [h for h in setup_fast.joins(run, chief, loaded.spec.mesh.mode, relay=relay) if h not in need]
            limited = [h for h in by_name if h in need or h in joined]
            probed = [h for h in by_name if h not in limited]
            tags = [r for r in ROLE_TAGS if any(r in why for why in run.values())]
            if not probed:
                limited = None  # every host: no --limit
                if all(set(run[h]) == set(roles_by_host[h]) for h in by_name):
                    tags = []  # everything, everywhere: the plain run
    result = run_playbook(
        "setup.yml", inv, secrets=secrets, limit=",".join(limited) if limited else None, tags=tags,
        skip_tags=skip, check=request.check, diff=request.diff, verbosity=request.verbose,
        on_update=on_update, cancel=cancel,
    )  # fmt: skip
    roles = [r for r in (tags or ROLE_TAGS) if r in ROLE_TAGS and r not in skip]
    if result.ok and not request.check and roles:
        ran = [h.host for h in result.hosts.values() if h.in_play]
        try:
            setup_state.record(loaded, ran, roles)
            if "deepspeed_env" in roles and chief in ran:  # its files live on the chief: every host has them now
                setup_state.record(loaded, list(by_name), ["deepspeed_env"])
        except OSError as e:  # setup itself succeeded: say what launch/check will miss
            sink.note(f"warning: could not keep the setup record ({e}); launch and check will not compare "
                      "the spec with this setup")  # fmt: skip
        try:
            if not looked:
                manifest = setup_fast.source_manifest(loaded, inv)
            _record_digests(loaded, inv, secrets, {h: [r for r in roles_by_host[h] if r in roles] for h in ran},
                            wanted, by_name, manifest, sink)  # fmt: skip
        except (OSError, NodeopsError, TypeError, ValueError, AttributeError) as e:  # setup itself succeeded
            sink.note(f"warning: could not record the nodes' state ({type(e).__name__}: {e}); the next setup "
                      "runs every role again")  # fmt: skip
    for h in probed:
        result.hosts[h] = HostResult(h, ok=len(roles_by_host[h]), in_play=True, task="as recorded")
    result.seconds = time.monotonic() - started
    return result


def _record_digests(loaded: LoadedSpec, inv: dict[str, object], secrets: dict[str, str],
                    ran: dict[str, list[str]], wanted: dict[str, dict[str, str]], by_name: dict[str, str],
                    manifest: dict[str, Any] | None, sink: Sink) -> None:  # fmt: skip
    """Probe the hosts that ran and record their roles' state, for the next setup's fast path."""
    ran = {h: r for h, r in ran.items() if r}
    if not ran:
        return
    found = setup_fast.probe(loaded, inv, setup_fast.plans(inv, ran, manifest), secrets)
    clean = setup_fast.recordable(wanted, found)
    dropped = {h: [r for r in roles if r not in clean.get(h, {})] for h, roles in ran.items()}
    setup_state.record_digests(loaded.cluster_name, by_name, {h: clean.get(h, {}) for h in ran}, dropped)
    unread = [f"{h}: {why}" for h, why in found.failed.items()]
    unread += [f"{h}: {r}: {s['bad']}" for h, states in found.states.items() for r, s in states.items()
               if s["bad"] and r in ran[h]]  # fmt: skip
    for line in unread:
        sink.note(f"note: the probe after setup found {line}; the next setup runs it again")
