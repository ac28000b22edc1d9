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


FAKE_SSH = """#!/bin/sh
# ssh for relay_sync's tests: notes its arguments, drops ssh's options and the host, runs the
# command here.
printf '%s\\n' "$@" > "$SSH_ARGV_OUT"
while [ $# -gt 0 ]; do case "$1" in -i|-p|-o|-l) shift 2;; -*) shift;; *) break;; esac; done
shift
exec sh -c "$*"
"""


def test_relay_sync_passes_on_the_listed_files_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's real rsync, with an ssh that runs the far side here: only the source's files
    reach the target (an output on the relay stays there), and a second run changes nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SSH_ARGV_OUT", str(tmp_path / "ssh-argv"))
    relay, target = tmp_path / "relay dir", tmp_path / "target"
    (relay / "data").mkdir(parents=True)
    (relay / "train.py").write_text("print('x')\n")
    (relay / "data" / "it's.json").write_text("{}\n")
    (relay / "ckpt.pt").write_text("an output the job wrote on the chief\n")
    task = {"nodeops.cluster.relay_sync": {
        "src": str(relay), "dest": str(target), "files": ["train.py", "data/it's.json"], "checksum": True,
        "key": str(tmp_path / "no key"), "target": {"name": "node2", "address": "10.0.0.2", "port": 2222}},
        "register": "r"}  # fmt: skip
    show = {"ansible.builtin.debug": {"msg": "RESULT {{ r | to_json }}"}}
    p = play(tmp_path, [task, show])
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(re.search(r'RESULT (\{.*\})"', p.stdout).group(1).replace('\\"', '"'))  # type: ignore[union-attr]
    assert result["relayed"] is True and result["changed"] is True
    assert sorted(str(f.relative_to(target)) for f in target.rglob("*") if f.is_file()) == [
        "data/it's.json",
        "train.py",
    ]
    argv = (tmp_path / "ssh-argv").read_text().splitlines()
    # the mesh key, the node's port, never a prompt, and only a host key already pinned
    assert argv[:12] == ["-i", str(tmp_path / "no key"), "-p", "2222", "-o", "BatchMode=yes",
                         "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=30",
                         "-o", "ServerAliveInterval=15"], argv  # fmt: skip
    assert argv[12] == "10.0.0.2", argv
    again = play(tmp_path, [task, show])
    assert again.returncode == 0 and re.search(r"localhost\s*: ok=2\s+changed=0", again.stdout), again.stdout


# ssh for relay_sync's many-target test: the far side runs here in $TARGETS/<address> (whose
# stage/ exists, as the role creates the staging dir before the relay), each call holding a mark
# in $LIVE for half a second (how many transfers run at once); 10.0.0.9 refuses, as ssh says it.
FAKE_SSH_MANY = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -i|-p|-o|-l) shift 2;; -*) shift;; *) break;; esac; done
host=$1
shift
if [ "$host" = 10.0.0.9 ]; then
  echo "ssh: connect to host 10.0.0.9 port 22: Connection refused" >&2
  exit 255
fi
touch "$LIVE/$$"
ls "$LIVE" | wc -l >> "$PEAK"
sleep 0.5
mkdir -p "$TARGETS/$host/stage" && cd "$TARGETS/$host" && sh -c "$*"
rc=$?
rm -f "$LIVE/$$"
exit $rc
"""


def test_relay_sync_passes_on_to_many_targets_a_few_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: one task on the relay for every target: at most `forks` transfers at once (each its
    own ssh from the relay), a result per target, and the one target it cannot reach is named with
    ssh's reason in a warning and `relayed: false`, while the others hold the source."""
    bindir, live, targets = tmp_path / "bin", tmp_path / "live", tmp_path / "targets"
    for d in (bindir, live, targets):
        d.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH_MANY)
    (bindir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("LIVE", str(live))
    monkeypatch.setenv("PEAK", str(tmp_path / "peak"))
    monkeypatch.setenv("TARGETS", str(targets))
    src = tmp_path / "wheelhouse"
    src.mkdir()
    for i in range(3):
        (src / f"w{i}.whl").write_text(f"wheel {i}\n")
    nodes = [{"name": f"node{i}", "address": f"10.0.0.{i}"} for i in (2, 3, 4, 5, 9)]
    task = {"nodeops.cluster.relay_sync": {"src": str(src), "dest": "~/stage/wheelhouse", "key": str(tmp_path / "k"),
                                           "delete": True, "forks": 2, "targets": nodes}, "register": "r"}  # fmt: skip
    keep = {
        "ansible.builtin.copy": {"content": "{{ r | to_json }}", "dest": str(tmp_path / "result.json"), "mode": "0600"}
    }
    p = play(tmp_path, [task, keep])
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    each = result["by_target"]["node2"]["transferred"]  # the 3 files and the dirs rsync created
    assert result["relayed"] is False and result["changed"] is True and result["transferred"] == 4 * each >= 12, result
    assert {n: r["relayed"] for n, r in result["by_target"].items()} == {
        "node2": True, "node3": True, "node4": True, "node5": True, "node9": False}  # fmt: skip
    assert result["by_target"]["node5"] == {"relayed": True, "transferred": each, "rsync_rc": 0, "msg": ""}
    # rsync exits 255 (its ssh failed) or, when it noticed the dead stream first, 12: either way ssh's reason
    refused = r"on to node9 \(rsync exit (255|12)\): ssh: connect to host 10\.0\.0\.9 port 22: Connection refused"
    assert re.search(refused, result["by_target"]["node9"]["msg"]), result["by_target"]["node9"]
    for i in (2, 3, 4, 5):
        got = sorted(f.name for f in (targets / f"10.0.0.{i}" / "stage" / "wheelhouse").iterdir())
        assert got == ["w0.whl", "w1.whl", "w2.whl"], (i, got)
    said = " ".join((p.stdout + p.stderr).split())
    assert said.count("could not pass") == 1 and re.search(r"on to node9 \(rsync exit (255|12)\)", said), said
    peaks = [int(x) for x in (tmp_path / "peak").read_text().split()]
    assert len(peaks) == 4 and max(peaks) <= 2, peaks  # never more than forks at once (load may serialize them)
    again = play(tmp_path, [{**task, "nodeops.cluster.relay_sync": {**task["nodeops.cluster.relay_sync"],  # type: ignore[dict-item]
                                                                   "targets": nodes[:4]}}])  # fmt: skip
    assert again.returncode == 0 and re.search(r"localhost\s*: ok=1\s+changed=0", again.stdout), again.stdout


def test_relay_sync_that_cannot_reach_its_target_warns_and_says_so(tmp_path: Path) -> None:
    """No sshd answers: the task does not fail, returns relayed: false and warns with the target's
    name and ssh's reason, so the play can send from the controller instead."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.whl").write_text("wheel\n")
    task = {"nodeops.cluster.relay_sync": {
        "src": str(tmp_path / "src"), "dest": "~/.nodeops/python_env/wheelhouse", "key": str(tmp_path / "k"),
        "timeout": 3, "target": {"name": "node7", "address": "127.0.0.1", "port": 9}}, "register": "r"}  # fmt: skip
    p = play(tmp_path, [task, {"ansible.builtin.assert": {"that": ["not r.relayed", "not r.changed"]}}])
    assert p.returncode == 0, p.stdout + p.stderr
    warning = " ".join((p.stdout + p.stderr).split())
    assert (
        "could not pass" in warning and "on to node7" in warning and "rsync exit" in warning and "refused" in warning
    ), warning
