"""The Slurm batch driver (nodeops.node.slurm_batch): its pure parts (records, the GPU count and
rank plan, each runner's argv, the signal decisions, the restart rules' answers), and the whole
batch script run by a real bash and python3 with stand-ins for scontrol and srun. The live path
is tests/integration/test_slurm.py; tests/unit/backends/test_slurm.py runs the runners' steps."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeops.backends.slurm import job as slurm
from nodeops.node import slurm_batch as B
from nodeops.spec.load import load_spec_text
from nodeops.spec.loading import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def config(name: str = "slurm-full.happy.yaml") -> dict[str, object]:
    return slurm.batch_config(load_spec(SPECS / name))


def test_result_records_are_the_lines_the_bash_script_printed() -> None:
    # the bash script's printf formats, filled the same way: the controller reads these bytes
    res = B.ended(3, 1, "SIGUSR1", requeued=True, hung=False)
    printf = subprocess.run(
        ["bash", "-c", 'printf \'{"exit": %d, "restart": %d, "signal": "%s", "requeued": true, "hang": %s}\' '
         '3 1 SIGUSR1 false'], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert B.result_text(res) == printf
    line = subprocess.run(["bash", "-c", 'printf \'{"attempt": %d, "nodes": "%s", "result": %s}\' 2 "gpu[01-03]" "$1"',
                           "-", printf], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert B.attempt_line(2, "gpu[01-03]", res) == line
    assert B.result_text(None) == "null"
    assert B.attempt_line(1, "n1", None) == '{"attempt": 1, "nodes": "n1", "result": null}'


def test_the_begun_line_of_the_batch_shell_is_the_drivers_attempt_line(tmp_path: Path) -> None:
    text = slurm.batch_script(load_spec(SPECS / "slurm-full.happy.yaml"))
    begun = re.search(r"^printf '\{\"attempt\".*$", text, re.M)
    assert begun is not None
    env = {**os.environ, "run_dir": str(tmp_path), "restart": "2", "SLURM_JOB_NODELIST": "gpu[01-03]"}
    subprocess.run(["bash", "-euc", begun.group(0)], env=env, check=True)
    assert (tmp_path / "attempts.jsonl").read_text() == B.attempt_line(3, "gpu[01-03]", None) + "\n"


def test_a_run_writes_its_result_and_adds_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEOPS_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-03]")
    for restart, res in ((0, B.ended(3, 0, "", requeued=True)), (1, B.ended(0, 1, "SIGUSR1"))):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        run = B.Batch(config(), str(tmp_path / "c.json"), [])
        run.result(None)
        run.result(res)
    lines = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["result"] and a["result"]["exit"]) for a in lines] == [(1, None), (1, 3), (2, None),
                                                                                      (2, 0)]  # fmt: skip
    assert json.loads((tmp_path / "result.json").read_text()) == lines[3]["result"]
    assert list(lines[3]["result"]) == ["exit", "restart", "signal", "requeued", "hang"]
    st = slurm.Poll(state="COMPLETED", reason="", exit="0:0", nodes="gpu[01-03]", result=lines[3]["result"],
                    attempts=lines)  # fmt: skip
    assert slurm.attempt_lines(st) == ["attempt 1 on gpu[01-03]: exit 3, requeued",
                                       "attempt 2 on gpu[01-03]: exit 0, got SIGUSR1, not requeued"]  # fmt: skip


def test_the_tasks_pass_signals_on_only_under_proctrack_cgroup() -> None:
    for conf, want in [("ProctrackType           = proctrack/cgroup\n", True),
                       ("ProctrackType           = proctrack/linuxproc\n", False),
                       ("ProctrackType           = proctrack/pgid\n", False),
                       ("ProctrackType = proctrack/cgroup\nSignalChildrenProcesses = yes\n", False),
                       ("ProctrackType = proctrack/cgroup\nSignalChildrenProcesses = NO\n", True),
                       ("X = 1\nProctrackType = proctrack/cgroup\nSignalChildrenProcesses = 1\n", False),
                       ("", False)]:  # fmt: skip
        assert B.forward_signals(conf) is want, conf


def test_what_a_nodes_task_does_with_each_signal() -> None:
    plain = B.task_signals("torchrun", None)
    assert plain == {s: (s, False) for s in ("TERM", "INT", "HUP", "QUIT")}
    assert B.task_signals("torchrun", "USR1")["USR1"] == ("USR1", True)
    ds = B.task_signals("deepspeed", None)  # DeepSpeed's launcher ends its ranks on TERM and INT only
    assert ds["HUP"] == ds["QUIT"] == ("TERM", False) and ds["INT"] == ("INT", False)


def test_the_gpu_count_plans_one_rank_per_gpu_node_by_node() -> None:
    counts = B.gpu_counts("node1 2 0,1\nnode2 1 3\nnode3 0\n\n")
    assert counts == {"node1": (2, "0,1"), "node2": (1, "3"), "node3": (0, "")}
    plan, why = B.plan_ranks(["node1", "node2", "node3"], counts, 4, "node1", 0)
    assert plan is not None and why == ""
    # node3 has no GPUs: nproc_per_node ranks; the others' GPUs (not the batch node's) for mpirun's daemons
    assert (plan.ranks, plan.per_node, plan.other_gpus) == (7, "2,1,4", 1)
    assert plan.rank_nodes == ["node1"] * 2 + ["node2"] + ["node3"] * 4
    assert plan.world == ["node1=2=0,1", "node2=1=3", "node3=4="]
    plan, why = B.plan_ranks(["node1", "node9"], counts, 1, "node1", 124)
    assert plan is None and why == "node9 did not answer the srun step that counts each node's GPUs (it exited 124)"
    assert B.plan_ranks([], counts, 1, "node1", 0) == (None, "no node in the allocation (scontrol show hostnames "
                                                             "gave none)")  # fmt: skip
    assert B.gpu_counts("node1 x\n") == {"node1": (0, "")}


def test_each_runners_command_line() -> None:
    cfg = config()
    env = {"SLURM_JOB_NUM_NODES": "16", "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "MASTER_ADDR": "h",
           "MASTER_PORT": "20042"}  # fmt: skip
    assert B.torchrun_argv(cfg, env, "42", "1", ["train.py", "a b"]) == [
        "python", "-m", "torch.distributed.run", "--nnodes=16", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:20042", "--rdzv-id=42", "--max-restarts=1",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "train.py", "a b"]  # fmt: skip
    # launch.restarts: the attempt's own node count; no GPUs from Slurm: nproc_per_node
    restarts = dict(config("slurm-sandbox.happy.yaml"), restarts=1, nproc=3)
    got = B.torchrun_argv(restarts, {**env, "SLURM_GPUS_ON_NODE": ""}, "42-2", "0", ["t.py"])
    assert got[3:5] == ["--nnodes=2", "--nproc-per-node=3"] and got[-2:] == ["--max-restarts=0", "t.py"]
    ds = B.deepspeed_argv("/env/bin/python", {**env, "NODEOPS_DS_WORLD": "e30="}, 1, ["t.py"])
    assert ds == ["/env/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--node_rank=1",
                  "--master_addr=h", "--master_port=20042", "t.py"]  # fmt: skip
    task = ["python3", "-I", "/r/batch/slurm_batch.py", "task", "/r/batch/config.json"]
    assert B.step_argv(cfg, task, "torchrun", "42", 1, ["t.py"], log_dir="/r/logs") == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--wait=300", "--open-mode=append",
        "--output=/r/logs/%N.log", *task, "torchrun", "42", "1", "t.py"]  # fmt: skip
    later = B.step_argv(cfg, task, "torchrun", "42-2", 0, [], nodes=["n1", "n3"], overlap=True, wait=60, log_dir="L")
    assert later[:6] == ["srun", "--overlap", "--nodes=2", "--ntasks=2", "--nodelist=n1,n3", "--ntasks-per-node=1"]
    assert "--wait=60" in later
    plan, _ = B.plan_ranks(["n1", "n2"], {"n1": (2, ""), "n2": (1, "")}, 1, "n1", 0)
    assert plan is not None
    assert B.mpirun_argv(plan, B.plm_args("3", plan.other_gpus), "/r/mpi_shim.sh", ["t.py"]) == [
        "mpirun", "-np", "3", "--mca", "plm_slurm_args", "--gpus=1", "--bind-to", "none", "--map-by", "slot",
        "--tag-output", "sh", "/r/mpi_shim.sh", "python3", "t.py"]  # fmt: skip
    assert B.plm_args("", 1) == [] and B.plm_args("2", 0) == ["--mca", "plm_slurm_args", "--gres=none"]


def test_the_restart_rules_answer_and_the_node_address() -> None:
    assert B.next_attempt("go node1,node3 2.5\n") == 2.5
    assert B.next_attempt("go node1,node3") == 0.0 and B.next_attempt("go n x") == 0.0
    assert B.next_attempt("stop") is None and B.next_attempt("") is None
    assert B.node_addr("NodeName=n1 Arch=x\n   NodeAddr=10.9.0.1 NodeHostName=n1\n") == "10.9.0.1"
    assert B.node_addr("Node n9 not found\n") == ""
    assert B.shell_rc(-15) == 143 and B.shell_rc(3) == 3


def test_the_script_carries_the_driver_and_its_settings_byte_for_byte() -> None:
    for name in ("slurm-full.happy.yaml", "slurm-sandbox.happy.yaml", "slurm-deepspeed.happy.yaml"):
        loaded = load_spec(SPECS / name)
        text = slurm.batch_script(loaded)
        driver = re.search(r"<< 'NODEOPS_DRIVER' \|\| exit 97\n(.*?)^NODEOPS_DRIVER$", text, re.M | re.S)
        conf = re.search(r"<< 'NODEOPS_CONFIG' \|\| exit 97\n(.*?)^NODEOPS_CONFIG$", text, re.M | re.S)
        assert driver is not None and conf is not None
        assert driver.group(1) == Path(B.__file__).read_text()
        assert json.loads(conf.group(1)) == slurm.batch_config(loaded)
        assert text.endswith('exec python3 -I "$run_dir/batch/slurm_batch.py" batch "$run_dir/batch/config.json" '
                             '"$@"\n')  # fmt: skip


FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=10.9.0.1" ;;
  "show config") echo "ProctrackType           = proctrack/cgroup" ;;  # Slurm signals each task only
  requeue*) echo "$@" >> "$NODEOPS_RUN_DIR/requeued" ;;
esac
"""
# the training step: its argv kept; each node's task run as slurmstepd would (SLURMD_NODENAME,
# its output into the node's log), in the background; USR1 (srun forwards what it gets) goes to
# both tasks, and srun ends once they have
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$*" >> "$NODEOPS_RUN_DIR/srun.calls"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
pids=()
for n in node1 node2; do SLURMD_NODENAME=$n SLURM_GPUS_ON_NODE=1 "$@" >> "$NODEOPS_RUN_DIR/logs/$n.log" 2>&1 &
  pids+=($!); done
trap 'echo USR1 >> "$NODEOPS_RUN_DIR/srun.signals"; kill -USR1 "${pids[@]}"' USR1
rc=0
for p in "${pids[@]}"; do while :; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done
  [ "$r" -ne 0 ] && rc=$r; done
exit $rc
"""
# torchrun: ready, then (FAKE_SLEEP) a long run; USR1 ends its ranks in a moment: exit 1
FAKE_TORCHRUN = """#!/bin/bash
trap 'sleep 0.3; exit 1' USR1
echo "$SLURMD_NODENAME ready: $*"
touch "$NODEOPS_RUN_DIR/ready.$SLURMD_NODENAME"
if [ -n "${FAKE_SLEEP:-}" ]; then for i in $(seq 1 100); do sleep 0.1; done; fi
exit "${FAKE_EXIT:-0}"
"""


def batch_job(tmp_path: Path, slurm_extra: str = "") -> tuple[str, Path, dict[str, str]]:
    """A 2-node torchrun job on a stand-in allocation, its run dir empty: as when job.sbatch from
    `nodeops render` is submitted by hand (launch writes nothing there)."""
    work = tmp_path / "work"
    work.mkdir()
    spec = load_spec_text(f"slurm:\n  nodes: 2\n{slurm_extra}nodes:\n  - address: 10.0.0.1\nworkdir:\n  path: {work}\n",
                          str(tmp_path / "cluster.yaml"))  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, "python": FAKE_TORCHRUN}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    # this Python's own dir next (a pyenv shim for python3 would put its own bin, and its python, first)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "NODEOPS_RUN_DIR": str(run),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURMD_NODENAME": "node1"}  # fmt: skip
    return slurm.batch_script(spec), run, env


def test_a_script_submitted_by_hand_trains_with_nothing_from_launch(tmp_path: Path) -> None:
    script, run, env = batch_job(tmp_path)
    p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py", "--lr", "1 2"], env=env, capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == ["nodeops: job 42 (restart 0) on node[1-2]", "nodeops: srun exited 0"]
    [call] = (run / "srun.calls").read_text().splitlines()
    assert call.startswith(f"--ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 --open-mode=append "
                           f"--output={run}/logs/%N.log python3 -I {run}/batch/slurm_batch.py task ")  # fmt: skip
    for n in ("node1", "node2"):
        line = (run / "logs" / f"{n}.log").read_text()
        assert line == (f"{n} ready: -m torch.distributed.run --nnodes=2 --nproc-per-node=1 "
                        "--rdzv-backend=c10d --rdzv-endpoint=10.9.0.1:20042 --rdzv-id=42 --max-restarts=0 "
                        "train.py --lr 1 2\n")  # fmt: skip
    res = json.loads((run / "result.json").read_text())
    times = res.pop("times")
    assert res == B.ended(0, 0, "")
    # the step's timeline: no heartbeat reached the batch node here (10.9.0.1 is no address of this machine)
    assert sorted(times) == ["began", "ended"] and times["began"] <= times["ended"]
    assert len((run / "attempts.jsonl").read_text().splitlines()) == 2
    # a failing rank: the step's exit is the run's
    p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env={**env, "FAKE_EXIT": "3"},
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 3 and "nodeops: srun exited 3" in p.stdout
    assert json.loads((run / "result.json").read_text())["exit"] == 3


def test_the_time_limit_signal_reaches_the_step_and_the_driver_waits_for_srun_to_end(tmp_path: Path) -> None:
    script, run, env = batch_job(tmp_path, "  signal: {name: USR1, seconds: 90}\n  max_requeues: 1\n")
    with (tmp_path / "batch.log").open("w") as log:
        proc = subprocess.Popen(["bash", "-c", script, "job.sbatch", "train.py"], env={**env, "FAKE_SLEEP": "1"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not all((run / f"ready.{n}").exists() for n in ("node1", "node2")):
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "batch.log").read_text()
                time.sleep(0.1)
            time.sleep(0.3)  # the traps are set
            proc.send_signal(signal.SIGUSR1)  # B: the batch shell only, which is the driver now
            rc = proc.wait(timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "batch.log").read_text()
    assert (run / "srun.signals").read_text() == "USR1\n", out  # forwarded once, to srun
    # each node's task saw torchrun end on the signal (exit 1): its mark, and exit 0; the run did not finish
    assert sorted(p.name for p in (run / "signalled").iterdir()) == ["node1", "node2"]
    assert "nodeops: torchrun on node2 ended its ranks after SIGUSR1" in (run / "logs" / "node2.log").read_text()
    lines = out.splitlines()
    i = lines.index("nodeops: SIGUSR1 (the time limit is near): forwarding it to torchrun on every node")
    assert lines[i + 1 :] == ["nodeops: srun exited 0",
                              "nodeops: the ranks ended on SIGUSR1 before the time limit; the run did not finish "
                              "(exit 1)", "nodeops: requeueing job 42 (restart 1 of 1)"], out  # fmt: skip
    assert rc == 1
    res = json.loads((run / "result.json").read_text())
    assert {k: v for k, v in res.items() if k != "times"} == B.ended(1, 0, "SIGUSR1", requeued=True)
    assert (run / "requeued").read_text() == "requeue 42\n"
    [call] = (run / "srun.calls").read_text().splitlines()
    assert "--wait=90 " in call  # at least the signal's seconds
