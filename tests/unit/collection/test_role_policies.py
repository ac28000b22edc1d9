"""Policies every shipped role and playbook must keep. Each test names the offending file and task."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
YAML_FILES = sorted(p for d in ("roles", "playbooks") for p in (ROOT / d).rglob("*.yml") if "molecule" not in p.parts)


def tasks_in(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from tasks_in(item)
    elif isinstance(node, dict):
        yield node
        for key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers"):
            if key in node:
                yield from tasks_in(node[key])


def all_tasks() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in YAML_FILES:
        for task in tasks_in(yaml.safe_load(path.read_text())):
            yield path, task


def test_there_are_roles_to_check() -> None:
    assert len(YAML_FILES) > 10


def test_synchronize_always_verifies_host_keys() -> None:
    """ansible.posix.synchronize turns host key checking off unless told not to."""
    bad = [
        f"{p.relative_to(ROOT)}: {t.get('name')}"
        for p, t in all_tasks()
        if "ansible.posix.synchronize" in t
        and not (
            t["ansible.posix.synchronize"].get("verify_host") and t["ansible.posix.synchronize"].get("use_ssh_args")
        )
    ]
    assert bad == []


def test_no_file_disables_host_key_checking() -> None:
    offenders = []
    for base in ("roles", "playbooks", "templates", "src"):
        for p in (ROOT / base).rglob("*"):
            if p.is_file() and p.suffix in {".yml", ".j2", ".py", ".cfg", ".sh"}:
                text = p.read_text(errors="replace")
                if "StrictHostKeyChecking=no" in text or "StrictHostKeyChecking no" in text:
                    offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


@pytest.mark.parametrize("module", ["ansible.builtin.command", "ansible.builtin.shell"])
def test_commands_declare_when_they_change(module: str) -> None:
    bad = [
        f"{p.relative_to(ROOT)}: {t.get('name')}"
        for p, t in all_tasks()
        if module in t
        and "changed_when" not in t
        and not (isinstance(t[module], dict) and ({"creates", "removes"} & set(t[module])))
    ]
    assert bad == []
