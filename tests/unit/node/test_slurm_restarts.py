"""Automatic restarts on Slurm (launch.restarts inside the allocation): the rules the batch node
applies (nodeops.node.slurm_failures), and the whole batch script in a real bash with stand-ins for
srun and scontrol (python3 is the real one: it runs the shipped package). The live path, with a
node's container killed on a real Slurm, is tests/integration/test_slurm.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeops.backends import store
from nodeops.backends.slurm import backend as slurm_backend
from nodeops.backends.slurm import job as slurm
from nodeops.node import slurm_batch as B
from nodeops.node import slurm_failures as SF
from nodeops.node import stacks as S
from nodeops.spec.load import load_spec_text

# srun's own lines, as Slurm 22.05 wrote them on the sandbox when node3's container was killed
# and node2's task then ended (--kill-on-bad-exit=1 --wait=20): node3's task never ended.
LOST_NODE3 = """srun: error: node2: task 1: Terminated
srun: launch/slurm: _step_signal: Terminating StepId=1.0
srun: error: node1: task 0: Terminated
srun: First task exited 20s ago
srun: StepId=1.0 task 2: running
srun: StepId=1.0 tasks 0-1: exited abnormally
srun: launch/slurm: _step_signal: Terminating StepId=1.0
srun: Job step aborted: Waiting up to 12 seconds for job step to finish.
srun: error: Timed out waiting for job step to complete""".splitlines()
PEER = [
    "[rank0]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:5"
]
OWN = ["[rank2]:ValueError: bad batch", "torch.distributed.elastic... failed (exitcode: 3) local_rank: 0 (pid: 77)",
       "exitcode  : 3 (pid: 77)"]  # fmt: skip


def test_a_task_srun_gave_up_on_or_a_node_slurm_marks_not_responding_is_lost() -> None:
    nodes = ["node1", "node2", "node3"]
    assert SF.lost_nodes(LOST_NODE3, nodes, {}) == [("node3", "its task never ended (srun gave up waiting for it)")]
    assert SF.lost_nodes(["srun: StepId=5.0 tasks 0-1,3: running"], ["a", "b", "c", "d"], {}) == [
        ("a", "its task never ended (srun gave up waiting for it)"),
        ("b", "its task never ended (srun gave up waiting for it)"),
        ("d", "its task never ended (srun gave up waiting for it)"),
    ]
    states = {"node1": "MIXED", "node2": "IDLE+DRAIN", "node3": "MIXED+NOT_RESPONDING"}
    assert SF.lost_nodes([], nodes, states) == [("node3", "Slurm marks it NOT_RESPONDING")]
    assert SF.lost_nodes([], nodes, {"node2": "DOWN"}) == [("node2", "Slurm marks it DOWN")]
    # older Slurm appends "*" for a node that does not respond
    assert SF.lost_nodes([], nodes, {"node2": "MIXED*"}) == [("node2", "Slurm marks it NOT_RESPONDING")]
    # srun numbers tasks in the allocation's order: the node it named for a task wins over the guess
    named = [
        "srun: error: node1: task 0: Exited with exit code 1",
        "srun: error: node4: task 2: Terminated",
        "srun: StepId=3.1 task 1: running",
    ]
    assert SF.lost_nodes(named, ["node1", "node4", "node3"], {}) == [
        ("node3", "its task never ended (srun gave up waiting for it)")
    ]
    assert SF.lost_nodes(["srun: StepId=1.0 task 7: running"], nodes, {}) == []  # beyond the step: no guess


def test_a_failed_attempt_is_classified_as_the_ssh_supervisor_would() -> None:
    nodes = ["node1", "node2", "node3"]
    # the lost node, not the nodes whose ranks lost it
    assert SF.classify(LOST_NODE3, {"node1": PEER, "node2": PEER}, nodes, {}) == (
        "lost", "node3", "its task never ended (srun gave up waiting for it)")  # fmt: skip
    # a rank's own exit code is the script's error, whoever srun reported first
    batch = [
        "srun: error: node1: task 0: Exited with exit code 1",
        "srun: error: node3: task 2: Exited with exit code 3",
    ]
    assert SF.classify(batch, {"node1": PEER, "node3": OWN}, nodes, {}) == ("script", "node3", "exited 3")
    # a node killed (srun: Killed, no code of its own): a signal, an infrastructure fault
    batch = ["srun: error: node2: task 1: Killed", "srun: error: node1: task 0: Exited with exit code 1"]
    assert SF.classify(batch, {"node1": PEER, "node2": []}, nodes, {}) == ("signal", "node2", "killed")
    # only lost peers and no node lost: nobody to blame
    assert SF.classify(["srun: error: node1: task 0: Exited with exit code 1"], {"node1": PEER}, nodes, {}) == (
        "peer", None, "its ranks lost a peer (no node was lost)")  # fmt: skip
    # the hang watchdog's verdict wins
    hang = {"host": "node2", "why": "rank 1 stuck"}
    assert SF.classify(batch, {}, nodes, {}, hang) == ("hang", "node2", "rank 1 stuck")
    assert SF.classify([], {}, nodes, {}) == ("lost", None, "srun ended the step with no node reported as failed")


def test_a_signal_after_an_uncaught_exception_is_the_scripts_error(tmp_path: Path) -> None:
    """The ranks' hook marks an exception the script did not catch (raised/HOST-PID.txt): the
    worker torchrun names (its pid) then counts as the script's error, not a signal's."""
    tail = ["torch.distributed.elastic... failed (exitcode: -6) local_rank: 0 (pid: 4242)"]
    batch = ["srun: error: node2: task 1: Exited with exit code 1"]
    since = time.time()
    assert SF.classify(batch, {"node2": tail}, ["node1", "node2"], {}, None, str(tmp_path), since)[0] == "signal"
    (tmp_path / "raised").mkdir()
    (tmp_path / "raised" / "node1-4242.txt").write_text("RuntimeError: node1's rank with the same pid")
    assert SF.classify(batch, {"node2": tail}, ["node1", "node2"], {}, None, str(tmp_path), since)[0] == "signal"
    (tmp_path / "raised" / "node2-4242.txt").write_text("RuntimeError: a bug")
    assert SF.classify(batch, {"node2": tail}, ["node1", "node2"], {}, None, str(tmp_path), since) == (
        "script", "node2", "a rank's exit code -6, after an uncaught exception")  # fmt: skip
    os.utime(tmp_path / "raised" / "node2-4242.txt", (since - 60, since - 60))  # an earlier attempt's
    assert SF.classify(batch, {"node2": tail}, ["node1", "node2"], {}, None, str(tmp_path), since)[0] == "signal"


def test_last_run_starts_after_the_last_requeue_or_restart() -> None:
    lines = ["a", f"{SF.RESTART_MARK} 1", "b", f"{SF.ATTEMPT_MARK}2/3 on node1,node3 (node rank 0)", "c"]
    assert SF.last_run(lines) == ["c"]
    assert SF.last_run(["a"]) == ["a"]


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run dir with the restart rules of a 2-node job with 1 spare, and a stand-in scontrol
    that says each node's state from FAKE_STATES (NODE=STATE,...)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nfor kv in ${FAKE_STATES//,/ }; do [ "${kv%%=*}" = "$4" ] && s=${kv#*=}; done\n'
        'echo "NodeName=$4 State=${s:-IDLE}"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_STATES", "")
    d = tmp_path / "run"
    (d / "logs").mkdir(parents=True)
    cfg = {"nodes": 2, "restarts": 2, "restart_on": "infra", "min_nodes": 1, "backoff": 4}
    (d / SF.CONFIG).write_text(json.dumps(cfg))
    return d


def attempts(d: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((d / SF.ATTEMPTS).read_text())  # type: ignore[no-any-return]


def test_a_lost_node_is_replaced_by_the_spare_then_the_run_shrinks_then_stops(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    d = run_dir
    # the batch node first whatever the allocation's order; the rest beyond the job's count are spares
    assert SF.start(str(d), "node2", ["node1", "node2", "node3"]) == ["node2", "node1"]
    assert attempts(d)["spares"] == ["node3"] and attempts(d)["total"] == 3
    # attempt 1: node1 lost -> the spare takes its node rank, after the back-off
    (d / "batch.log").write_text("srun: error: node2: task 1: Exited with exit code 1\n"
                                 "srun: StepId=9.0 task 0: running\n")  # fmt: skip
    (d / "logs" / "node2.log").write_text("\n".join(PEER) + "\n")
    assert SF.decide(str(d), 1, 1) == (["node2", "node3"], 4.0)
    a = attempts(d)
    first = a["attempts"][0]
    assert [first[k] for k in ("outcome", "kind", "culprit", "excluded")] == ["failed", "lost", "node1", ["node1"]]
    # (c10d gives node ranks in the order the nodes join: the spare takes the node's place, not its rank)
    assert first["decision"] == "node1 excluded; spare node3 takes its place"
    assert a["active"] == ["node2", "node3"] and a["spares"] == [] and len(a["attempts"]) == 1
    # the next attempt is in the record once it starts (after the back-off), not before
    assert SF.begin(str(d), 2) == ["node2", "node3"]
    assert attempts(d)["attempts"][1]["hosts"] == ["node2", "node3"] and "next" not in attempts(d)
    mark = "==> nodeops: attempt 2/3 on node2,node3; after attempt 1: lost on node1; node1 excluded"
    assert (d / "logs" / "node3.log").read_text() == mark + "\n"
    assert mark in capsys.readouterr().err
    with pytest.raises(ValueError, match="no attempt 3 was decided"):
        SF.begin(str(d), 3)
    # attempt 2: Slurm marks node3 not responding -> no spare left: on with 1 node (min_nodes 1), back-off doubled
    monkeypatch.setenv("FAKE_STATES", "node3=MIXED+NOT_RESPONDING")
    with (d / "batch.log").open("a") as f:
        f.write(f"{SF.ATTEMPT_MARK}2/3 ...\nsrun: error: node2: task 0: Exited with exit code 1\n")
    assert SF.decide(str(d), 2, 1) == (["node2"], 8.0)
    said = attempts(d)["attempts"][1]["decision"]
    assert said == "node3 excluded; no spare left: going on with 1 node(s) (min_nodes 1)"
    SF.begin(str(d), 3)
    # attempt 3 fails too: no restart left
    assert SF.decide(str(d), 3, 1) is None
    a = attempts(d)
    assert a["done"] and a["attempts"][2]["decision"].startswith("no restart: no restart left (2 used)")
    lines = slurm.restart_lines(slurm.Poll("COMPLETED", "", "", "", recovery=a))
    assert lines[0] == ("attempt 1/3 on node2,node1: failed (lost on node1: its task never ended (srun gave up "
                        "waiting for it)); node1 excluded; spare node3 takes its place")  # fmt: skip
    assert len(lines) == 3


def test_the_scripts_own_error_is_not_restarted_and_the_batch_node_is_never_excluded(run_dir: Path) -> None:
    d = run_dir
    SF.start(str(d), "node1", ["node1", "node2", "node3"])
    (d / "batch.log").write_text("srun: error: node2: task 1: Exited with exit code 3\n")
    (d / "logs" / "node2.log").write_text("\n".join(OWN) + "\n")
    assert SF.decide(str(d), 1, 3) is None
    assert attempts(d)["attempts"][0]["decision"].startswith("no restart: the script's own error")
    # the batch node killed (its task): restarted on the same nodes, the spare kept
    SF.start(str(d), "node1", ["node1", "node2", "node3"])
    (d / "batch.log").write_text("srun: error: node1: task 0: Killed\n")
    (d / "logs" / "node2.log").write_text("")
    assert SF.decide(str(d), 1, 137) == (["node1", "node2"], 4.0)
    assert "node1 is the batch node, which cannot be excluded" in attempts(d)["attempts"][0]["decision"]
    # a success ends the record; the time-limit signal ends the restarts
    SF.begin(str(d), 2)
    assert SF.decide(str(d), 2, 0) is None and attempts(d)["done"]
    SF.start(str(d), "node1", ["node1", "node2", "node3"])
    assert SF.decide(str(d), 1, 1, "SIGUSR1") is None
    assert "SIGUSR1 came" in attempts(d)["attempts"][0]["decision"]
    # a hang: the report moves aside for the next attempt, whose watchdog starts clean
    SF.start(str(d), "node1", ["node1", "node2", "node3"])
    (d / "hang.json").write_text(json.dumps({"host": "node2", "why": "rank 1 stuck in all_reduce"}))
    assert SF.decide(str(d), 1, 124) == (["node1", "node3"], 4.0)
    assert not (d / "hang.json").exists() and (d / "hang.attempt-1.json").exists()
    assert attempts(d)["attempts"][0]["outcome"] == "hung"


def test_the_same_failure_on_the_spare_ends_the_restarts(run_dir: Path) -> None:
    d = run_dir
    SF.start(str(d), "node1", ["node1", "node2", "node3"])
    (d / "batch.log").write_text("srun: error: node2: task 1: Killed\n")
    assert SF.decide(str(d), 1, 137) == (["node1", "node3"], 4.0)  # the spare takes node2's place
    SF.begin(str(d), 2)
    with (d / "batch.log").open("a") as f:
        f.write(f"{SF.ATTEMPT_MARK}2/3 ...\nsrun: error: node3: task 1: Killed\n")
    assert SF.decide(str(d), 2, 137) is None
    a = attempts(d)
    assert a["done"] and a["attempts"][1]["decision"] == (
        "no restart: the same failure twice (signal at node rank 1: killed; on node2 then node3): not a node fault; "
        "not restarting (node2 excluded for it)"
    )


def test_the_command_line_answers_what_the_batch_script_reads(run_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": ""}
    pkg = run_dir / SF.PACKAGE_DIR
    spec = load_spec_text("slurm:\n  nodes: 2\n  spare_nodes: 1\nnodes:\n  - address: 10.0.0.1\n"
                          "launch:\n  restarts: 2\n", "c.yaml")  # fmt: skip
    for name, text in slurm_backend.recover_files(spec.spec).items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)

    def sf(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["python3", "-E", "-s", "-m", "nodeops.node.slurm_failures", *args], cwd=pkg, env=env,
                              capture_output=True, text=True, timeout=30, check=False)  # fmt: skip

    p = sf("start", str(run_dir), "node1", "node1", "node2", "node3")
    assert (p.returncode, p.stdout) == (0, "node1,node2\n"), p.stderr
    (run_dir / "batch.log").write_text("srun: error: node2: task 1: Killed\n")
    p = sf("decide", str(run_dir), "1", "137")
    assert (p.returncode, p.stdout) == (0, "go node1,node3 3\n"), p.stderr  # restart_backoff's default 3s
    p = sf("begin", str(run_dir), "2")
    assert (p.returncode, p.stdout) == (0, "node1,node3\n"), p.stderr
    p = sf("decide", str(run_dir), "2", "0")
    assert (p.returncode, p.stdout) == (0, "stop\n"), p.stderr
    # the rules failing (a record that does not read) is said in one line, never a traceback
    (run_dir / SF.ATTEMPTS).write_text('{"attempts": []}')
    p = sf("decide", str(run_dir), "3", "1")
    assert p.returncode == 1 and p.stderr.startswith("nodeops: restarts: IndexError") and "Traceback" not in p.stderr
    p = sf("start", str(run_dir), "node1", "node1")
    assert p.returncode == 1 and "the allocation has 1 node(s), fewer than the job's 2" in p.stderr
    assert sf("bogus").returncode == 2


FAKE_SRUN = """#!/bin/bash
# the training step: its argv kept; attempt 1 (rdzv id 42-1) loses node2 (its task never ends),
# later attempts end well. Each node's task line goes to its log, as srun --output would.
pre=() nodes=
while [ $# -gt 0 ] && [ "$1" != python3 ]; do
  case $1 in --nodelist=*) nodes=${1#--nodelist=} ;; esac
  pre+=("$1"); shift
done
printf '%s | %s\\n' "${pre[*]}" "${*:6}" >> "$NODEOPS_RUN_DIR/srun.calls"  # (python3 -I DRIVER task CONFIG left out)
rdzv=$7
for n in ${nodes//,/ }; do
  echo "task on $n rdzv $rdzv restart $NODEOPS_RESTART_COUNT attempt $NODEOPS_ATTEMPT" >> "$NODEOPS_RUN_DIR/logs/$n.log"
done
if [ "$rdzv" = 42-1 ] || [ -n "${FAKE_LOSE:-}" ]; then
  echo "[rank0]:RuntimeError: Connection closed by peer [10.9.0.2]:1" >> "$NODEOPS_RUN_DIR/logs/node1.log"
  echo "srun: error: node1: task 0: Exited with exit code 1" >&2
  echo "srun: StepId=42.0 task 1: running" >&2
  exit 1
fi
"""


def batch_job(tmp_path: Path, slurm_extra: str, launch: str,
              shape: str = "  nodes: 2\n  spare_nodes: 1\n") -> tuple[str, Path, dict[str, str]]:  # fmt: skip
    """A 2-node job with 1 spare (node3) on a stand-in allocation node[1-3], node1 the batch
    node (``shape``: another job on it): its batch script, its run dir with what launch ships,
    and the job's env."""
    work = tmp_path / "work"
    work.mkdir()
    spec = load_spec_text(f"slurm:\n{shape}{slurm_extra}nodes:\n  - address: 10.0.0.1\n"
                          f"workdir:\n  path: {work}\nlaunch:\n{launch}", str(tmp_path / "cluster.yaml"))  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = ('#!/bin/sh\ncase "$1 $2" in\n  "show hostnames") printf "node1\\nnode2\\nnode3\\n" ;;\n'
                '  "show node") echo "NodeName=$3 NodeAddr=10.9.0.1 State=IDLE" ;;\nesac\n')  # fmt: skip
    for name, text in {"scontrol": scontrol, "srun": FAKE_SRUN}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    for name, text in slurm_backend.run_files(spec).items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "NODEOPS_RUN_DIR": str(run),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "3",
           "SLURMD_NODENAME": "node1"}  # fmt: skip
    return slurm.batch_script(spec), run, env


def test_the_batch_script_restarts_on_the_spare_inside_its_allocation(tmp_path: Path) -> None:
    script, run, env = batch_job(tmp_path, "", "  restarts: 1\n  restart_backoff: 0\n")
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    with (run / "batch.log").open("w") as log:  # as sbatch --output writes it
        p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py", "--lr", "1 2"], env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=60, check=False)  # fmt: skip
    out = (run / "batch.log").read_text()
    assert p.returncode == 0, out
    calls = (run / "srun.calls").read_text().splitlines()
    assert len(calls) == 2, calls
    assert "--nodes=2 --ntasks=2 --nodelist=node1,node2 " in calls[0] and "--overlap" not in calls[0]
    assert calls[1].startswith("--overlap --nodes=2 --ntasks=2 --nodelist=node1,node3 "), calls[1]
    assert calls[1].endswith(" | torchrun 42-2 0 train.py --lr 1 2")
    assert "task on node3 rdzv 42-2 restart 1 attempt 2" in (run / "logs" / "node3.log").read_text()
    assert "==> nodeops: attempt 2/2 on node1,node3; after attempt 1: lost on node2; node2 excluded" in out
    a = json.loads((run / SF.ATTEMPTS).read_text())
    assert [x["outcome"] for x in a["attempts"]] == ["failed", "ok"] and a["done"]
    assert json.loads((run / "result.json").read_text())["exit"] == 0
    shutil.rmtree(run / SF.PACKAGE_DIR)  # no rules shipped: the job says so and starts no rank
    (run / "srun.calls").unlink()
    p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env=env, capture_output=True, text=True,
                       timeout=60, check=False)  # fmt: skip
    assert p.returncode == 1 and "cannot plan the attempts" in p.stderr and not (run / "srun.calls").exists()


def test_a_job_whose_batch_script_ended_is_over_while_a_lost_node_holds_it_in_completing() -> None:
    """A killed node keeps its job COMPLETING until Slurm sets the node down (SlurmdTimeout, 300 s
    by default): with the batch script's result there, the run is over and its verdict is read."""
    st = slurm.Poll("COMPLETING", "", "0:0", "node2", result={"exit": 0, "requeued": False})
    assert st.ended and slurm.outcome(st) == "ok" and slurm.exit_code(st) == 0
    assert slurm.describe(st) == "ended (exit 0); Slurm is still completing it on node2"
    failed = slurm.Poll("COMPLETING", "", "", "node2", result={"exit": 3, "requeued": False})
    assert failed.ended and slurm.outcome(failed) == "failed" and slurm.exit_code(failed) == 3
    # no result yet (the batch script is still ending), or requeued (it comes back): not over
    assert not slurm.Poll("COMPLETING", "", "", "node2").ended
    assert not slurm.Poll("COMPLETING", "", "", "node2", result={"exit": 1, "requeued": True}).ended


def test_the_time_limit_signal_during_the_back_off_ends_the_run_and_leaves_no_sleep(tmp_path: Path) -> None:
    """SIGUSR1 (slurm.signal) during the back-off: no next attempt, the record closed saying why,
    and the back-off's sleep ended with the batch shell."""
    script, run, env = batch_job(
        tmp_path, "  signal: {name: USR1, seconds: 60}\n", "  restarts: 2\n  restart_backoff: 37s\n"
    )
    with (run / "batch.log").open("w") as log:
        proc = subprocess.Popen(["bash", "-c", script, "job.sbatch", "train.py"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while '"next"' not in ((run / SF.ATTEMPTS).read_text() if (run / SF.ATTEMPTS).exists() else ""):
                assert time.monotonic() < deadline and proc.poll() is None, (run / "batch.log").read_text()
                time.sleep(0.1)
            time.sleep(0.5)  # in the back-off's sleep
            t = time.monotonic()
            proc.send_signal(signal.SIGUSR1)
            assert proc.wait(timeout=15) == 1, (run / "batch.log").read_text()
            assert time.monotonic() - t < 10
            # (before the cleanup below, which would end it anyway)
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
            assert "sleep 37" not in ps
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    a = json.loads((run / SF.ATTEMPTS).read_text())
    assert len(a["attempts"]) == 1 and a["done"] and "next" not in a, a
    assert a["attempts"][0]["decision"] == ("node2 excluded; spare node3 takes its place; but SIGUSR1 came (the "
                                            "time limit is near): no next attempt")  # fmt: skip
    assert len((run / "srun.calls").read_text().splitlines()) == 1


# srun for the heartbeats' test: each node's task run for real (the driver's task mode, under a
# stand-in torchrun that prints rank lines), each in its own process group as slurmstepd runs it.
# Attempt 1 (rdzv 42-1; any step with FAKE_LOSE) loses node2 once its ranks printed: its task
# and torchrun killed at once, node1's torchrun then reports its failed rank, and srun waits on
# for node2's task, which never ends; SIGTERM makes it kill the tasks it can reach (Slurm's
# forced termination) and wait on. A step with no --nodelist runs on the whole allocation.
LOSING_SRUN = """#!/bin/bash
nodes=node1,node2,node3
while [ $# -gt 0 ] && [ "$1" != python3 ]; do
  case $1 in --nodelist=*) nodes=${1#--nodelist=} ;; esac
  shift
done
rdzv=$7
declare -A pids
for n in ${nodes//,/ }; do
  SLURMD_NODENAME=$n setsid "$@" >> "$NODEOPS_RUN_DIR/logs/$n.log" 2>&1 &
  pids[$n]=$!
done
gone=
trap 'echo TERM >> "$NODEOPS_RUN_DIR/srun.signals"
      for n in "${!pids[@]}"; do [ "$n" = "$gone" ] || kill -KILL -- "-${pids[$n]}" 2>/dev/null; done' TERM
if [ "$rdzv" = 42-1 ] || [ -n "${FAKE_LOSE:-}" ]; then
  until grep -q 'rank1.:step 12' "$NODEOPS_RUN_DIR/logs/node2.log" 2>/dev/null; do sleep 0.1; done
  kill -KILL -- "-${pids[node2]}"; gone=node2
  echo "E1127 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:1] failed (exitcode: 1) local_rank: 0 \
(pid: 1) of binary: python" >> "$NODEOPS_RUN_DIR/logs/node1.log"
  while :; do sleep 0.2; done
fi
rc=0
for n in "${!pids[@]}"; do wait "${pids[$n]}" || rc=$?; done
exit $rc
"""
# torchrun: a rank line each 0.2 s, for good in attempt 1, else 3 of them and exit 0
STAND_IN_TORCHRUN = """#!/bin/bash
case "$*" in *--rdzv-id=42-1*) steps=100000 ;; *) steps=${FAKE_LOSE:+100000} ;; esac
r=0; [ "$SLURMD_NODENAME" = node1 ] || r=1
for i in $(seq 1 "${steps:-3}"); do echo "[rank$r]:step $i"; sleep 0.2; done
"""


def test_a_node_whose_heartbeats_stop_is_lost_within_seconds_and_the_spare_takes_its_place(tmp_path: Path) -> None:
    """The heartbeats, end to end on a stand-in allocation (real tasks, real UDP on this
    machine): node2's task dies silently; node1's rank fails soon after; the batch node names
    node2 lost LOST_QUICK after its last heartbeat, ends the step (srun would wait for node2's
    task for good), and attempt 2 runs on node1 and the spare. Each attempt's timeline is in
    attempts.json."""
    script, run, env = batch_job(tmp_path, "", "  restarts: 1\n  restart_backoff: 0\n")
    bin_dir = losing_allocation(tmp_path, run)
    env["PATH"] = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # this python3 for the tasks
    t = time.monotonic()
    with (run / "batch.log").open("w") as log:
        p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=60, check=False)  # fmt: skip
    took = time.monotonic() - t
    out = (run / "batch.log").read_text()
    assert p.returncode == 0, out
    assert re.search(r"^nodeops: node2 lost: its task has sent no heartbeat for \d+\.\ds \(the last at [\d:]+\), "
                     r"after a rank failed on node1; stopping the training step$", out, re.M), out  # fmt: skip
    assert "nodeops: srun still waits for node2's task: SIGKILL" in out
    assert "nodeops: srun exited 137: the step was ended for node2, lost (exit 1)" in out
    assert (run / "srun.signals").read_text() == "TERM\n"
    a = json.loads((run / SF.ATTEMPTS).read_text())
    first, second = a["attempts"]
    assert (first["kind"], first["culprit"], first["excluded"]) == ("lost", "node2", ["node2"]), first
    assert first["decision"] == "node2 excluded; spare node3 takes its place"
    t1, t2 = first["times"], second["times"]
    # node2 last heard, then named lost LOST_QUICK later (node1's rank had failed), then the step ended
    assert t1["began"] < t1["ranks_up"] <= t1["last_progress"] < t1["failed"] == t1["stop_sent"] < t1["ended"]
    assert B.LOST_QUICK <= t1["failed"] - t1["last_progress"] < B.LOST_AFTER + 3, t1
    assert t1["ended"] - t1["stop_sent"] < B.LOST_GRACE + 3, t1
    assert t1["ended"] <= first["preflight_done"] <= second["started"] <= t2["began"] < t2["ranks_up"] < t2["ended"]
    assert "failed" not in t2 and second["outcome"] == "ok"
    # the run's timeline as `status` shows it: the incident's offsets, and the goodput
    [line], good = store.timeline({"attempts": a["attempts"]})
    offsets = r"detected \+\d\.\d s; stopped \+\d\.\d s; preflight \+\d+\.\d s; started \+\d+\.\d s; training again"
    assert re.fullmatch(r"attempt 1 -> 2: lost on node2 at [\d:]+; " + offsets + r" \+\d+\.\d s", line), line
    assert good is not None and 0 < good["goodput"] < 1 and good["faults"] > 0 and good["restarts"] > 0
    assert took < 45, out
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(run) not in ps, ps  # every task, torchrun and srun ended


def losing_allocation(tmp_path: Path, run: Path) -> Path:
    """The stand-in allocation whose srun loses node2 (its task dies silently), with the stand-in
    torchrun, the batch node at 127.0.0.1 (for the heartbeats) and the logs dir: its bin dir."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "srun").write_text(LOSING_SRUN)
    (bin_dir / "python").write_text(STAND_IN_TORCHRUN)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "scontrol").write_text((bin_dir / "scontrol").read_text().replace("10.9.0.1", "127.0.0.1"))
    (run / "logs").mkdir()
    return bin_dir


def test_finished_ranks_are_counted_per_node_in_the_shared_run_dir(tmp_path: Path) -> None:
    for d, names in (("stacks", ["node1-11.txt", "node1-12.txt", "node2-7.txt"]), ("finished", ["node1-11.txt"])):
        (tmp_path / d).mkdir()
        for n in names:
            (tmp_path / d / n).write_text("")
    since = time.time() - 5
    files = {"finished_dir": "finished", "stacks_dir": "stacks"}
    assert B.finished_ranks(str(tmp_path), files, ["node1", "node2", "node3"], since) == {
        "node1": [1, 2], "node2": [0, 1], "node3": [0, 0]}  # fmt: skip
    assert B.finished_ranks(str(tmp_path), files, ["node1"], time.time() + 60) == {"node1": [0, 0]}  # earlier marks
    assert B.finished_ranks(str(tmp_path / "none"), files, ["node1"], since) == {"node1": [0, 0]}
    for d, names in (("stacks", ["gpu-1-5.txt", "gpu-6.txt", "gpu-x.txt"]), ("finished", ["gpu-1-5.txt"])):
        for n in names:
            (tmp_path / d / n).write_text("")
    # node "gpu" counts its own marks only, never node "gpu-1"'s; a name without a pid is no mark
    assert B.finished_ranks(str(tmp_path), files, ["gpu", "gpu-1"], since) == {"gpu": [0, 1], "gpu-1": [1, 1]}
    names = ("gpu-1-5.txt", "gpu-x.txt", "gpu-5", "-5.txt", "gpu-\u00b2.txt", "a.b-7.txt")
    assert [B.mark_host(n) for n in names] == [S.mark_host(n) for n in names] == ["gpu-1", "", "", "", "", "a.b"]


@pytest.mark.parametrize("slurm_name", ["queue-dy-c5-1", None])
def test_the_ranks_marks_carry_slurms_node_name_where_it_is_not_the_hostname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_name: str | None
) -> None:
    """A Slurm NodeName need not be the host's name (AWS ParallelCluster: queue-dy-c5-1 on
    ip-10-0-0-1), and the batch counts each node's marks by its Slurm name: the ranks' real hook
    (a real Python with it as sitecustomize) names its marks by SLURMD_NODENAME where Slurm set it,
    else by the hostname, and the readers on the node (stacks.stack_file) say the same."""
    run = tmp_path / "run1"
    (run / S.HOOK_DIR).mkdir(parents=True)
    (run / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(run / S.HOOK_DIR), "NODEOPS_RUN_ID": run.name, "RANK": "0"}
    if slurm_name:
        env["SLURMD_NODENAME"] = slurm_name
    since = time.time()
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], env=env, capture_output=True,
                       text=True, timeout=60, check=True)  # fmt: skip
    pid = int(p.stdout)
    name = slurm_name or os.uname()[1]
    assert sorted(os.listdir(run / S.STACKS_DIR)) == [f"{name}-{pid}.txt"]
    assert sorted(os.listdir(run / S.FINISHED_DIR)) == [f"{name}-{pid}.txt"]
    files = {"finished_dir": S.FINISHED_DIR, "stacks_dir": S.STACKS_DIR}
    assert B.finished_ranks(str(run), files, [name], since) == {name: [1, 1]}
    # a reader finds a live rank's dump file by the rank's environment, whatever its own says
    monkeypatch.setenv("SLURMD_NODENAME", "the-readers-own")
    with subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"], env=env,
                          stdout=subprocess.PIPE) as rank:  # fmt: skip
        try:
            assert rank.stdout is not None and rank.stdout.readline() == b"1\n"
            assert S.stack_file(str(run), rank.pid) == str(run / S.STACKS_DIR / f"{name}-{rank.pid}.txt")
            assert (run / S.STACKS_DIR / f"{name}-{rank.pid}.txt").exists()
        finally:
            rank.kill()


# srun (on the stand-in allocation node[1-3]): every rank ends its script (the hook's finished mark; node2's second
# rank not when FAKE_UNFINISHED is set), then node2's rank dies in its teardown (SIGABRT)
TEARDOWN_SRUN = """#!/bin/bash
mkdir -p "$NODEOPS_RUN_DIR/stacks" "$NODEOPS_RUN_DIR/finished"
for m in node1-11 node2-21 node2-22 node3-31; do
  : > "$NODEOPS_RUN_DIR/stacks/$m.txt"
  [ -n "${FAKE_UNFINISHED:-}" ] && [ $m = node2-22 ] || : > "$NODEOPS_RUN_DIR/finished/$m.txt"
done
echo "[rank0]:final loss 0.01" >> "$NODEOPS_RUN_DIR/logs/node1.log"
echo "terminate called without an active exception" >> "$NODEOPS_RUN_DIR/logs/node2.log"
echo "srun: error: node2: task 1: Aborted (core dumped)" >&2
exit 134
"""


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_job_that_finished_then_crashed_in_teardown_exits_3_and_is_not_run_again(tmp_path: Path,
                                                                                    restarts: int) -> None:  # fmt: skip
    """Every rank ended its script, then one aborted in its teardown: on Slurm as over ssh, the
    run's exit code is failures.TEARDOWN_EXIT, and launch.restarts does not run it again. A crash
    while a rank still worked keeps the rank's own code (and restarts as any failure would)."""
    script, run, env = batch_job(tmp_path, "", f"  restarts: {restarts}\n  restart_backoff: 0\n",
                                 shape="  nodes: 3\n")  # fmt: skip
    (tmp_path / "bin" / "srun").write_text(TEARDOWN_SRUN)
    (run / "logs").mkdir(exist_ok=True)
    for unfinished in ("", "1"):
        env["FAKE_UNFINISHED"] = unfinished
        with (run / "batch.log").open("w") as log:
            p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, timeout=60, check=False)  # fmt: skip
        out = (run / "batch.log").read_text()
        res = json.loads((run / "result.json").read_text())
        assert p.returncode == 134 and res["exit"] == 134, out
        counts = {"node1": [1, 1], "node2": [1 if unfinished else 2, 2], "node3": [1, 1]}
        assert res["finished"] == counts, res
        recovery = json.loads((run / SF.ATTEMPTS).read_text()) if restarts else None
        st = slurm.Poll("FAILED", "", "134:0", "node[1-2]", result=res, recovery=recovery)
        assert slurm.teardown(st) is not bool(unfinished)
        assert slurm.exit_code(st) == (134 if unfinished else 3)
        if not restarts:  # ranks that ended on the time limit or a preemption did not crash in teardown
            for other in (dataclasses.replace(st, state="TIMEOUT"),
                          dataclasses.replace(st, result=dict(res, signal="SIGUSR1"))):  # fmt: skip
                assert slurm.teardown(other) is False
        if restarts:
            kinds = [a.get("kind") for a in recovery["attempts"]]  # type: ignore[index]
            assert kinds == (["signal"] if unfinished else ["teardown"]), recovery  # (restart_on: infra)
            if not unfinished:
                assert "every rank had finished its work" in recovery["attempts"][0]["decision"]  # type: ignore[index]
        for d in ("stacks", "finished"):
            shutil.rmtree(run / d)
        for name in (SF.ATTEMPTS, "attempts.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                (run / name).unlink()


def test_without_restarts_a_lost_node_ends_the_job_in_seconds_and_is_named(tmp_path: Path) -> None:
    """No launch.restarts: node2's heartbeats stop, the batch node ends the step (srun would wait
    for node2's task for good), and the run ends failed (exit 1) with node2 named lost in
    result.json, with the step's timeline."""
    script, run, env = batch_job(tmp_path, "", "  restarts: 0\n", shape="  nodes: 3\n")
    bin_dir = losing_allocation(tmp_path, run)
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", FAKE_LOSE="1")
    with (run / "batch.log").open("w") as log:
        p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=60, check=False)  # fmt: skip
    out = (run / "batch.log").read_text()
    assert p.returncode == 1, out
    assert "nodeops: srun exited 137: the step was ended for node2, lost (exit 1)" in out
    res = json.loads((run / "result.json").read_text())
    assert res["exit"] == 1 and res["lost"]["node"] == "node2" and res["lost"]["why"].startswith("its task has sent")
    t = res["times"]
    assert t["began"] < t["ranks_up"] <= t["last_progress"] == res["lost"]["heard"] < t["failed"] <= t["ended"]
    st = slurm.Poll("FAILED", "", "1:0", "node[1-3]", result=res)
    assert slurm.fault_of(st) == {"host": "node2", "code": None, "kind": "lost", "why": res["lost"]["why"]}
    assert store.timeline_lines(slurm.timeline_result(st))[0].startswith("attempt 1: lost on node2 at ")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(run) not in ps, ps
