"""What a launch runs before it starts anything: the workdir sync, the preflight, the fabric check."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from nodeops.backends.base import Sink
from nodeops.check import preflight as check
from nodeops.errors import EXIT_FAILURE, ExitWith, UsageError
from nodeops.setup import state as setup_state
from nodeops.setup.render import inventory
from nodeops.setup.runner import run_playbook
from nodeops.spec.model import LoadedSpec
from nodeops.transport import fan_out, tcp_reason


def setup_gate(loaded: LoadedSpec, doing: str, skip: str = "", ignore: Sequence[str] = ()) -> None:
    """Refuse (exit 2, before anything starts) a spec that needs what the last setup on this
    machine did not give the hosts: a new runner, package, env value, workdir or node (what the
    roles in ``ignore`` provide left out: `launch --sync` runs shared_path itself)."""
    diffs = setup_state.differences(loaded, ignore)
    if not diffs:
        return
    new_nodes = [h for d in diffs if (d.what, d.detail, d.role) == setup_state.NEVER for h in d.hosts]
    dead = unreachable(loaded, new_nodes)
    if dead:  # setup cannot give them anything either: that is the fix to name, once per host
        raise ExitWith(EXIT_FAILURE, "\n".join(f"{h}: {why}" for h, why in dead.items()) + "\n"
                       f"{', '.join(dead)} cannot be reached from this machine (never set up, and setup "
                       f"cannot reach {'it' if len(dead) == 1 else 'them'} either); nothing was {doing}. "
                       "fix: bring the node up, or take it out of the spec")  # fmt: skip
    lines = "\n".join(f"  {d.line()}" for d in diffs)
    raise UsageError(f"{loaded.file}: the spec changed since the last setup, in what setup provides; "
                     f"nothing was {doing}:\n{lines}\n"
                     f"  fix: {setup_state.fix(loaded, diffs)}" + (f"  ({skip})" if skip else ""))  # fmt: skip


def unreachable(loaded: LoadedSpec, aliases: Sequence[str]) -> dict[str, str]:
    """Of these nodes, those whose sshd this machine cannot reach over TCP, with the OS's reason
    (nodes behind a proxy_jump are not probed: only the bastion can say)."""
    spec = loaded.spec
    by_alias = {spec.alias(n): n for n in spec.nodes}
    direct = [a for a in aliases if a in by_alias and spec.group(by_alias[a]).proxy_jump is None]
    found = fan_out(direct, lambda a: tcp_reason(by_alias[a].address, spec.group(by_alias[a]).port))
    return {a: why for a, why in found.items() if why}


def sync_workdir(loaded: LoadedSpec, sink: Sink) -> None:
    """`launch --sync`: setup's shared_path role alone, on every host."""
    wd = loaded.spec.workdir
    if wd is None or wd.sync != "rsync":
        raise UsageError("--sync copies an rsync workdir; the spec has "
                         + ("no workdir" if wd is None else f"workdir.sync: {wd.sync}"))  # fmt: skip
    t0 = time.monotonic()
    # Connection data only, as for --via ansible: the copy needs no env values.
    result = run_playbook("setup.yml", inventory(loaded, None), kind="sync", tags=["shared_path"])
    if not result.ok:
        for hr in result.hosts.values():
            for e in hr.errors:
                sink.note(f"{hr.host}: {e}")
        raise ExitWith(EXIT_FAILURE, f"--sync failed on {', '.join(result.bad_hosts) or 'the controller'}; "
                       f"nothing was started (artifacts: {result.private_data_dir})")  # fmt: skip
    with contextlib.suppress(OSError):  # the record is a convenience: a read-only home must not fail the launch
        setup_state.record(loaded, [h.host for h in result.hosts.values() if h.in_play], ["shared_path"])
    copied = [h.host for h in result.hosts.values() if h.changed]
    sink.note(
        f"==> workdir synced in {time.monotonic() - t0:.1f}s ("
        + (f"copied to {', '.join(copied)}" if copied else "every node already had the source")
        + ")"
    )


def preflight(loaded: LoadedSpec, sink: Sink, script: str | None = None) -> None:
    """`nodeops check`'s fast subset: ssh from the chief, the job's ports, version parity, the
    workdir against the source, and the script present on every node."""
    t0 = time.monotonic()
    report = check.evaluate(
        loaded.spec,
        check.run(loaded, fast=True, timeout=60, script=script),
        fast=True,
        auto_gpus=loaded.discovered_gpus,
    )
    failed = [r for r in report.rows if r.status == "fail"]
    if failed:
        for r in failed:
            sink.note(f"{r.host}: {r.check}: {r.detail}")
        raise ExitWith(EXIT_FAILURE, f"preflight failed on {', '.join(dict.fromkeys(r.host for r in failed))}; "
                       f"nothing was started (details: nodeops check {loaded.file}; skip with --no-check)")  # fmt: skip
    sink.note(f"==> preflight ok in {time.monotonic() - t0:.1f}s (ssh, ports, versions on {len(report.hosts)} hosts)")
