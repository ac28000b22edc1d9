"""Collection modules run for real by ansible-playbook on localhost (connection local), from the
collection as nodeops links it (nodeops.cluster.*)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nodeops.resources import collections_path

pytestmark = pytest.mark.slow


def play(tmp_path: Path, tasks: list[dict[str, object]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "play.yml").write_text(json.dumps([{"hosts": "localhost", "gather_facts": False,
                                                    "connection": "local", "tasks": tasks}]))  # fmt: skip
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(collections_path(tmp_path / "collections")),
           "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}  # fmt: skip
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                          capture_output=True, text=True, env=env, timeout=120,
                          check=False)  # fmt: skip


def test_deepspeed_env_file_keeps_the_users_lines_and_mode(tmp_path: Path) -> None:
    path, state = tmp_path / ".deepspeed_env", tmp_path / "state" / "owned"
    path.write_text("MY_VAR=mine\nNCCL_DEBUG=INFO\n")
    path.chmod(0o640)
    task = {"nodeops.cluster.deepspeed_env_file": {"path": str(path), "state_file": str(state),
                                                   "vars": {"NCCL_DEBUG": "WARN", "NODEOPS": "1"}}}  # fmt: skip
    p = play(tmp_path, [task])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert path.read_text() == "MY_VAR=mine\nNCCL_DEBUG=WARN\nNODEOPS=1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the user's mode, not the umask's
    again = play(tmp_path, [task])
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-2000:]


def test_deepspeed_env_file_writes_the_hostfile_and_every_dir_in_one_call(tmp_path: Path) -> None:
    work, state = tmp_path / "work", tmp_path / "home" / ".nodeops" / "c1"
    work.mkdir()
    (work / ".deepspeed_env").write_text("USER=kept\n")
    # the owned-keys list an earlier run (one task per dir) left: still read, so its key goes
    (state.parent).mkdir(parents=True)
    state.mkdir(mode=0o755)
    (state / ("deepspeed_env." + re.sub(r"[^A-Za-z0-9]+", "_", str(work)) + ".keys")).write_text("GONE\n")
    (work / ".deepspeed_env").write_text("USER=kept\nGONE=1\n")
    task = {
        "nodeops.cluster.deepspeed_env_file": {
            "dirs": [str(work)],
            "state_dir": str(state),
            "vars": {"NCCL_IB_DISABLE": "1"},
            "hostfile": str(state / "hostfile"),
            "hostfile_content": "10.0.0.1 slots=2\n10.0.0.2 slots=1\n",
        }
    }
    p = play(tmp_path, [task])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (work / ".deepspeed_env").read_text() == "USER=kept\nNCCL_IB_DISABLE=1\n"
    assert (state / "hostfile").read_text() == "10.0.0.1 slots=2\n10.0.0.2 slots=1\n"
    assert stat.S_IMODE((state / "hostfile").stat().st_mode) == 0o644
    again = play(tmp_path, [task])
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-2000:]
    fresh = tmp_path / "fresh"
    task["nodeops.cluster.deepspeed_env_file"]["state_dir"] = str(fresh)  # type: ignore[index]
    assert play(tmp_path, [task]).returncode == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700  # a state dir it creates is private
