"""Issue 43: no role or playbook runs a task per host delegated to one inventory host.

Ansible runs a task on up to `forks` hosts at once; a task delegated to one host (the chief) from
each of them runs that many commands at once over the controller's one ssh connection to it
(ControlMaster), and sshd refuses sessions past MaxSessions (10 by default): "Session open
refused by peer". A task delegated to an inventory host must run once (``run_once``; the relay
tasks instead run on the relay host itself, with no ``delegate_to``); ``localhost`` (the
controller, no ssh) may take a task per host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
LOCAL = {"localhost", "127.0.0.1"}


def tasks_in(items: Any) -> Iterator[dict[str, Any]]:
    """Every task of a task list or a play list, blocks, rescue, always and plays' sections included."""
    for item in items or []:
        if not isinstance(item, dict):
            continue
        yield item
        for key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers"):
            yield from tasks_in(item.get(key))


def task_files() -> list[Path]:
    files = sorted((ROOT / "roles").glob("*/tasks/*.yml")) + sorted((ROOT / "roles").glob("*/handlers/*.yml"))
    return files + sorted((ROOT / "playbooks").glob("**/*.yml"))


def fan_in(path: Path, root: Path = ROOT) -> list[str]:
    """The tasks in ``path`` that each host of a play delegates to one inventory host."""
    return [f"{path.relative_to(root)}: {t.get('name', '?')} (delegate_to: {t['delegate_to']})"
            for t in tasks_in(yaml.safe_load(path.read_text()))
            if t.get("delegate_to") is not None and str(t["delegate_to"]).strip() not in LOCAL
            and t.get("run_once") not in (True, "true", "yes")]  # fmt: skip


def test_no_task_per_host_is_delegated_to_one_host() -> None:
    files = task_files()
    assert len(files) > 20, files  # the roles' task files and the playbooks were found
    assert [t for f in files for t in fan_in(f)] == []


def test_the_check_finds_a_task_per_host_delegated_to_the_chief(tmp_path: Path) -> None:
    """The check itself: the relay task as it was before issue 43 is found; run once, or delegated
    to the controller, it is not."""
    relay = {"name": "Pass the wheelhouse on from the relay host", "nodeops.cluster.relay_sync": {},
             "delegate_to": "{{ python_env_relay_host or inventory_hostname }}"}  # fmt: skip
    (tmp_path / "t.yml").write_text(yaml.safe_dump([
        {"name": "outer", "block": [relay]},
        {**relay, "name": "once", "run_once": True},
        {**relay, "name": "local", "delegate_to": "localhost"},
    ]))  # fmt: skip
    to = "{{ python_env_relay_host or inventory_hostname }}"
    assert fan_in(tmp_path / "t.yml", tmp_path) == [
        f"t.yml: Pass the wheelhouse on from the relay host (delegate_to: {to})"
    ]
