"""Issue 17, item 8: a role's input check prints only the rule that failed, not every rule at
once. Real ansible-playbook on localhost (the checks run on the controller and stop the role
before it touches a host), one bad input per case, the others valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeops.resources import collections_path, data_dir

pytestmark = pytest.mark.slow
ROLES = data_dir("roles")


CASES = {
    "shared_path-path": ("shared_path", {"shared_path_path": "rel/dir", "shared_path_source": "@tmp"},
                         "shared_path_path must be absolute (got 'rel/dir')"),
    "shared_path-source": ("shared_path", {"shared_path_path": "/srv/w", "shared_path_source": "/no/such/src"},
                           "rsync needs shared_path_source to be a directory on the controller (got '/no/such/src')"),
    "ssh_mesh-mode": ("ssh_mesh", {"ssh_mesh_mode": "star"}, "ssh_mesh_mode must be chief or full (got 'star')"),
    "python_env-venv": ("python_env", {"python_env_venv_path": "venvs/x"},
                        "python_env_venv_path must be absolute or start with ~/ (got 'venvs/x')"),
    "nccl_env-ib": ("nccl_env", {"nccl_env_ib": "on"}, "nccl_env_ib must be auto or off (got 'on')"),
    "deepspeed_env-hosts": ("deepspeed_env", {"deepspeed_env_hosts": [{"host": "a", "slots": 1}, {"host": "a",
                                                                                                "slots": 2}]},
                            "deepspeed_env_hosts must list each host once"),
    "deepspeed_env-slots": ("deepspeed_env", {"deepspeed_env_hosts": [{"host": "a", "slots": 0}]},
                            "each deepspeed_env_hosts entry needs a host and slots (a whole number, at least 1)"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_only_the_failing_rule_is_printed(case: str, tmp_path: Path) -> None:
    role, bad, expected = CASES[case]
    extra = {k: (str(tmp_path) if v == "@tmp" else v) for k, v in bad.items()}
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "tasks": [{"ansible.builtin.include_role": {"name": role, "tasks_from": "nodeops"}}]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    (tmp_path / "vars.json").write_text(json.dumps(extra))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROLES), "ANSIBLE_STDOUT_CALLBACK": "json",
           "ANSIBLE_COLLECTIONS_PATH": str(collections_path(tmp_path / "collections")),
           "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}  # fmt: skip
    bindir = Path(sys.executable).parent
    p = subprocess.run([str(bindir / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "play.yml"),
                        "-e", f"@{tmp_path / 'vars.json'}"], capture_output=True, text=True, env=env,
                       timeout=120, check=False)  # fmt: skip
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-2000:]
    out = json.loads(p.stdout)
    task = out["plays"][0]["tasks"][-1]
    assert task["task"]["name"].startswith(f"{role} : Check"), task["task"]["name"]
    results = task["hosts"]["localhost"]["results"]
    failed = [r["msg"] for r in results if r.get("failed")]
    assert failed == [f"{role}: {expected}"], failed  # the one rule that fails, and only it
    assert len(results) >= 4  # every rule was evaluated
