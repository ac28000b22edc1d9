"""roles/launch's stop.yml, run for real by ansible-playbook on three local hosts (connection
local): a start step that failed on one host stops the run on every host, the hosts still in the
play at once (in the forks, not one delegated command after another), and a host that left the
play from the play's first host; the failure names the host and its cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
STOP = ROOT / "roles/launch/tasks/stop.yml"


def run(tmp_path: Path, failed_when: str) -> subprocess.CompletedProcess[str]:
    play = [{"hosts": "all", "gather_facts": False,
             "vars": {"_launch_run": {"run_id": "20261127-000000-test",
                                      "markers": {"started_marker": "@@started", "stopped_marker": "@@stopped"}}},
             "tasks": [
                 {"name": "A start step that fails on b", "register": "_step", "changed_when": False,
                  "failed_when": failed_when,
                  "ansible.builtin.command": {"argv": ["sh", "-c", 'if [ "$1" = b ]; then echo broke >&2; exit 3; fi; '
                                                       "echo @@started", "x", "{{ inventory_hostname }}"]}},
                 {"name": "Stop", "ansible.builtin.include_tasks": str(STOP),
                  "vars": {"_launch_step": "start", "_launch_result_var": "_step"}},
             ]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    (tmp_path / "hosts").write_text("".join(f"{h} ansible_connection=local\n" for h in "abc"))
    env = {**os.environ, "ANSIBLE_LOCALHOST_WARNING": "false", "HOME": str(tmp_path)}
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts"),
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)  # fmt: skip


def test_a_failed_start_stops_every_host_still_in_the_play_at_once(tmp_path: Path) -> None:
    p = run(tmp_path, "false")
    assert p.returncode == 2, p.stdout[-3000:]
    out = p.stdout
    here = out.split("TASK [Stop the run on every host still in the play]")[1].split("TASK [")[0]
    assert sorted(line.split("[")[1].split("]")[0] for line in here.splitlines() if line.startswith("changed:")) == [
        "a", "b", "c"], out[-3000:]  # fmt: skip
    assert ("the start step failed on b: broke; stopped the run on every host: nothing of it is left running"
            in out), out[-3000:]  # fmt: skip


def test_a_host_that_left_the_play_is_stopped_from_the_first(tmp_path: Path) -> None:
    p = run(tmp_path, "inventory_hostname == 'b'")
    assert p.returncode == 2, p.stdout[-3000:]
    out = p.stdout
    assert "changed: [a -> b] => (item=b)" in out, out[-3000:]
    assert ("the start step failed on b: broke; stopped the run on every host: nothing of it is left running"
            in out), out[-3000:]  # fmt: skip
