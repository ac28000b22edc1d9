"""The Slurm backend's pure parts, and its login-node actions run for real on this machine (the
"no login node" transport: ``bash -s`` here), with stand-in sbatch/squeue/scontrol scripts on
PATH that record what they were given. The live path is tests/integration/test_slurm.py."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeops.backends import store
from nodeops.backends.slurm import backend as slurm_backend
from nodeops.backends.slurm import job as slurm
from nodeops.check import preflight as check
from nodeops.lifecycle import runs
from nodeops.node import failures
from nodeops.node import slurm_batch as SB
from nodeops.node import slurm_failures as SF
from nodeops.sandbox import slurm as sandbox_slurm
from nodeops.spec import deepspeed as ds
from nodeops.spec.load import load_spec_text
from nodeops.spec.loading import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
HOSTILE = ["train.py", "--name", "it's a $(touch /tmp/pwned) `id`; rm -rf ~", "a\nb", "*", "", "--", "${HOME}"]


def test_sbatch_lines_follow_the_spec() -> None:
    loaded = load_spec(SPECS / "slurm-full.happy.yaml")
    lines = slurm.sbatch_lines(loaded.spec, "bigjob")
    assert lines[:4] == ["--job-name=nodeops-bigjob", "--nodes=16", "--ntasks-per-node=1", "--open-mode=append"]
    for want in ("--partition=gpu", "--account=proj-42", "--qos=high", "--time=1-12:00:00", "--gpus-per-node=8",
                 "--cpus-per-task=96", "--mem=900G", "--constraint=a100", "--exclusive", "--signal=B:USR1@300",
                 "--requeue", "--reservation=big-run", "--begin=now+60", "--requeue-debug"):  # fmt: skip
        assert want in lines
    sandbox = slurm.sbatch_lines(load_spec(SPECS / "slurm-sandbox.happy.yaml").spec, "slurmbox")
    assert "--gpus=4" in sandbox and "--no-requeue" in sandbox
    assert not any(line.startswith("--signal") for line in sandbox)


@pytest.mark.parametrize("name", ["slurm-full.happy.yaml", "slurm-sandbox.happy.yaml", "slurm-deepspeed.happy.yaml"])
def test_batch_script_is_valid_bash_and_carries_no_user_argument(name: str) -> None:
    text = slurm.batch_script(load_spec(SPECS / name))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert text.startswith("#!/bin/bash\n")
    # the training command arrives as the script's own arguments, never rendered into it
    assert text.endswith('exec python3 -I "$run_dir/batch/slurm_batch.py" batch "$run_dir/batch/config.json" "$@"\n')
    assert "train.py" not in text


def test_signal_is_handed_to_torchrun_only_when_asked() -> None:
    full = slurm.batch_config(load_spec(SPECS / "slurm-full.happy.yaml"))
    assert full["torchrun_extra"] == ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    assert (full["signal"], full["max_requeues"], full["step_wait"]) == ("USR1", 3, 300)
    plain = slurm.batch_config(load_spec(SPECS / "slurm-sandbox.happy.yaml"))
    assert (plain["torchrun_extra"], plain["signal"], plain["max_requeues"], plain["step_wait"]) == ([], None, 0, 60)


FAKE_TORCHRUN = """#!/bin/bash
# stands in for torchrun: on USR1 or TERM it takes a moment to end its ranks, then exits 1 (or
# FAKE_SIGNAL_EXIT, after the marks FAKE_RANK names); a second signal would end it at once (as
# torchrun's shutdown does): it is counted
n=0
gone() { sleep 0 & local pid=$!; wait "$pid"; echo "$pid"; }  # the pid of a rank that has ended
mark() { mkdir -p "$NODEOPS_RUN_DIR/$1"; : > "$NODEOPS_RUN_DIR/$1/node7-$2.txt"; }
marks() {
  case "${FAKE_RANK:-}" in
    done) p=$(gone); mark stacks "$p"; mark finished "$p" ;;  # its rank ended its script
    started) mark stacks "$(gone)" ;;  # its rank ended without ending its script (a crash)
    half) p=$(gone); mark stacks "$p"; mark finished "$p"; mark stacks "$(gone)" ;;  # one of two
    stale) p=$(gone); mark stacks "$p"; mark finished "$p"  # ended before the signal
           touch -d "@$(($(date +%s) - 5))" "$NODEOPS_RUN_DIR/finished/node7-$p.txt" ;;
    late) (sleep 1.5; mark finished "$BASHPID") & mark stacks "$!" ;;  # still checkpointing
  esac
}
end() {
  n=$((n + 1)); echo "$1" >> "$NODEOPS_RUN_DIR/ended"
  if [ "$n" -eq 1 ]; then sleep 0.5; marks; exit "${FAKE_SIGNAL_EXIT:-1}"; fi
}
trap 'end USR1' USR1
trap 'end TERM' TERM
echo "$@" > "$NODEOPS_RUN_DIR/ready"
if [ -n "${FAKE_EXIT:-}" ]; then exit "$FAKE_EXIT"; fi
while :; do sleep 0.1; done
"""


def run_task(tmp_path: Path, spec: str, sig: int | None, *, fake_exit: str = "", cgroup: bool = False,
             signal_exit: str = "", rank: str = "") -> tuple[int, str]:  # fmt: skip
    """The batch driver's per-node task (``slurm_batch.py task``), run by python3 in a session of
    its own with a stand-in torchrun. ``sig`` goes to every process of it, as slurmstepd signals a
    step, or with ``cgroup`` to the task's own process only, as under proctrack/cgroup (the batch
    driver then sets NODEOPS_FORWARD_SIGNALS)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(slurm.batch_config(load_spec(SPECS / spec))))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_TORCHRUN)
    (bin_dir / "python").chmod(0o755)
    for f in ("ready", "ended", "signalled/node7", *(str(m.relative_to(tmp_path)) for d in ("stacks", "finished")
                                                     for m in (tmp_path / d).glob("*.txt"))):  # fmt: skip
        (tmp_path / f).unlink(missing_ok=True)
    # (this Python's own dir before the rest: a pyenv shim for python3 would put its own python first)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "NODEOPS_RUN_DIR": str(tmp_path),
           "SLURMD_NODENAME": "node7", "SLURM_JOB_NUM_NODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "FAKE_EXIT": fake_exit, "NODEOPS_FORWARD_SIGNALS": "1" if cgroup else "",
           "FAKE_SIGNAL_EXIT": signal_exit, "FAKE_RANK": rank}  # fmt: skip
    task = ["python3", "-I", SB.__file__, "task", str(cfg)]
    p = subprocess.Popen([*task, "torchrun", "42", "0", "train.py", "--lr", "1"], env=env, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        ready = tmp_path / "ready"  # (written after it is made: wait for its line)
        while not (ready.exists() and ready.read_text().endswith("\n")) and p.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "--rdzv-id=42 --max-restarts=0" in (tmp_path / "ready").read_text()
        time.sleep(0.2)  # the fake's traps are set
        if sig is not None:
            os.kill(p.pid, sig) if cgroup else os.killpg(p.pid, sig)
        out, _ = p.communicate(timeout=10)
        return p.returncode, out
    finally:  # a failed assertion must not leave the task and its stand-in running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@pytest.mark.parametrize("cgroup", [False, True])
def test_a_nodes_task_waits_for_torchrun_and_after_the_time_limit_signal_ends_well(
    tmp_path: Path, cgroup: bool
) -> None:
    # after SIGUSR1 torchrun's exit 1 only says it ended its ranks: the task exits 0 (so that srun's
    # --kill-on-bad-exit leaves the other nodes' ranks their time to checkpoint) and leaves a mark;
    # torchrun got the signal exactly once, from Slurm or (cgroup) passed on by the task's bash
    rc, out = run_task(tmp_path, "slurm-full.happy.yaml", signal.SIGUSR1, cgroup=cgroup)
    assert (rc, (tmp_path / "ended").read_text()) == (0, "USR1\n")
    assert "nodeops: torchrun on node7 ended its ranks after SIGUSR1" in out
    assert (tmp_path / "signalled" / "node7").exists()
    # SIGTERM (scancel, the time limit): the task waits for torchrun's own shutdown and exits with its code
    for spec in ("slurm-full.happy.yaml", "slurm-sandbox.happy.yaml"):
        rc, out = run_task(tmp_path, spec, signal.SIGTERM, cgroup=cgroup)
        assert (rc, (tmp_path / "ended").read_text(), out) == (1, "TERM\n", "")
        assert not (tmp_path / "signalled" / "node7").exists()
    # no signal: torchrun's own exit code, whatever it is
    assert run_task(tmp_path, "slurm-full.happy.yaml", None, fake_exit="3") == (3, "")
    assert run_task(tmp_path, "slurm-sandbox.happy.yaml", None, fake_exit="0") == (0, "")


def test_a_torchrun_that_dies_in_its_teardown_after_its_ranks_ended_on_the_time_limit_signal_ends_well(
    tmp_path: Path,
) -> None:
    # a CI run: after SIGUSR1 the rendezvous host's torchrun ended with its ranks and took the
    # TCPStore with it; the last node's torchrun, still waiting for its rank's longer checkpoint,
    # then died of SIGABRT (134) in its own teardown, and the run exited 134, not 1. Once every rank
    # the node started has ended its script after the signal, that exit says the ranks ended on it;
    # a rank still checkpointing when torchrun died is waited for (late)
    for rank in ("done", "late"):
        t = time.monotonic()
        rc, out = run_task(tmp_path, "slurm-full.happy.yaml", signal.SIGUSR1, signal_exit="134", rank=rank)
        assert (rc, (tmp_path / "signalled" / "node7").exists()) == (0, True), (rank, out)
        assert "torchrun on node7 ended its ranks after SIGUSR1, then exited 134 in its own teardown" in out
        assert time.monotonic() - t < 30, rank  # (not the 300 s the task may wait for a rank)
    # a rank that did not end its script, one of two that did not, or one that ended before the
    # signal came (its mark older than the task): the node failed, its exit stays
    for rank in ("started", "half", "stale", ""):
        rc, out = run_task(tmp_path, "slurm-full.happy.yaml", signal.SIGUSR1, signal_exit="134", rank=rank)
        assert (rc, out, (tmp_path / "signalled" / "node7").exists()) == (134, "", False), rank
    # SIGTERM is not the time limit's signal: torchrun's exit stays its own, every rank done or not
    rc, out = run_task(tmp_path, "slurm-full.happy.yaml", signal.SIGTERM, signal_exit="134", rank="done")
    assert (rc, out) == (134, "")


def test_each_run_of_a_requeued_job_is_kept_and_shown() -> None:
    text = slurm.batch_script(load_spec(SPECS / "slurm-full.happy.yaml"))
    # (the batch driver's records: tests/unit/node/test_slurm_batch.py)
    results = [None, SB.ended(3, 0, "", requeued=True), None, SB.ended(0, 1, "SIGUSR1")]
    lines = [json.loads(SB.attempt_line(1 + i // 2, "gpu[01-03]", r)) for i, r in enumerate(results)]
    assert [a["attempt"] for a in lines] == [1, 1, 2, 2] and lines[1]["result"]["exit"] == 3
    st = slurm.Poll(state="COMPLETED", reason="", exit="0:0", nodes="gpu[01-03]", result=lines[3]["result"],
                    attempts=lines)  # fmt: skip
    assert slurm.attempt_lines(st) == ["attempt 1 on gpu[01-03]: exit 3, requeued",
                                       "attempt 2 on gpu[01-03]: exit 0, got SIGUSR1, not requeued"]  # fmt: skip
    # a run Slurm ended before it wrote its result (a time limit), and one still running
    ended = dataclasses.replace(st, state="TIMEOUT", attempts=lines[:3])
    assert slurm.attempt_lines(ended)[1] == "attempt 2 on gpu[01-03]: ended with no result (Slurm ended it: TIMEOUT)"
    running = dataclasses.replace(st, state="RUNNING", attempts=lines[:3])
    assert slurm.attempt_lines(running)[1] == "attempt 2 on gpu[01-03]: running"
    # a job that never requeued lists no attempts
    assert slurm.attempt_lines(dataclasses.replace(st, attempts=lines[2:])) == []
    # the ranks see which run this is
    assert "export NODEOPS_RESTART_COUNT=$restart NODEOPS_ATTEMPT=$((restart + 1))" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("sbatch_extra: {output: x}", "may not set --output"),
        ("sbatch_extra: {--signal: USR2}", "may not set --signal"),
        ("sbatch_extra: {nodes: 4}", "may not set --nodes"),
        ("sbatch_extra: {'bad name': x}", "is not an sbatch option name"),
        ("sbatch_extra: {mail-user: 'a\"b'}", "characters sbatch would split"),
        ("sbatch_extra: {mail-user: 'a&b'}", "characters sbatch would split"),
        ("sbatch_extra: {sig: 'B:TERM@1'}", "may not set --sig (sbatch reads it as --signal)"),
        ("sbatch_extra: {part: x}", "(sbatch reads it as --partition)"),
        ("sbatch_extra: {comment: x}", "may not set --comment"),
        ("signal: {name: TERM}", "Input should be 'USR1' or 'USR2'"),
        ("gpus_per_node: 0", "greater than or equal to 1"),
        ("time: '1:2:3:4'", "is not a Slurm time limit"),
        ("mem: 64GB", "is not a Slurm memory size"),
        ("gpus: 1", "fewer than nodes"),
        ("signal: {name: KILL}", "Input should be"),
        ("signal: {name: USR1, seconds: 0}", "greater than or equal to 1"),
        ("account: 'a b'", "characters sbatch would split"),
    ],
)
def test_bad_slurm_fields_are_refused(extra: str, message: str) -> None:
    from nodeops.errors import SpecError

    text = f"slurm:\n  nodes: 2\n  {extra}\nnodes:\n  - address: 10.0.0.1\n"
    with pytest.raises(SpecError) as info:
        load_spec_text(text)
    assert message in str(info.value), str(info.value)


def test_backend_defaults_to_slurm_with_a_section_and_ssh_without() -> None:
    assert load_spec_text("slurm: {nodes: 2}\nnodes: [{address: 10.0.0.1}]\n").spec.on_slurm
    assert not load_spec_text("nodes: [{address: 10.0.0.1}]\n").spec.on_slurm
    from nodeops.errors import SpecError

    with pytest.raises(SpecError, match="backend is ssh"):
        load_spec_text("backend: ssh\nslurm: {nodes: 2}\nnodes: [{address: 10.0.0.1}]\n")


BATCH = """nodeops: job 12 (restart 0) on node[1-3]
srun: error: node2: task 1: Exited with exit code 3
srun: launch/slurm: _step_signal: Terminating StepId=12.0
srun: error: node1: task 0: Terminated
srun: error: node3: tasks 2-3: Exited with exit code 1
nodeops: srun exited 143
""".splitlines()


def test_first_failure_is_the_node_that_failed_by_itself() -> None:
    assert SF.first_failure(BATCH) == ("node2", 3)
    # srun may report a victim first: node1's ranks lost their peer node2, whose own rank failed
    racy = ["srun: error: node1: task 0: Exited with exit code 1", "srun: error: node2: task 1: Terminated"]
    tails = {"node1": ["[rank1]:RuntimeError: Connection closed by peer [10.0.0.12]:41234"],
             "node2": ["[rank2]:failing on purpose", "  exitcode  : 1 (pid: 111)"]}  # fmt: skip
    assert SF.first_failure(racy, tails) == ("node2", 1)
    assert SF.first_failure(racy) == ("node1", 1)  # without the lines, srun's order is all there is
    assert SF.first_failure(["srun: error: node1: task 0: Exited with exit code 0"]) is None
    assert SF.first_failure([]) is None


def test_exit_code_prefers_the_failing_task_over_srun() -> None:
    def poll(state: str, exit: str = "0:0", result: dict[str, object] | None = None) -> slurm.Poll:
        return slurm.Poll(state=state, reason="None", exit=exit, nodes="node[1-3]", result=result)

    assert slurm.exit_code(poll("COMPLETED")) == 0
    assert slurm.exit_code(poll("CANCELLED", "0:15")) == 130
    assert slurm.exit_code(poll("FAILED", "143:0", {"exit": 143}), BATCH) == 3
    assert slurm.exit_code(poll("FAILED", "143:0", {"exit": 143})) == 143
    assert slurm.exit_code(poll("TIMEOUT", "0:15")) == 1
    assert slurm.exit_code(poll("FAILED", "2:0")) == 1  # 2 is nodeops' "bad usage": never a job's
    assert slurm.describe(poll("PENDING")) == "PENDING"
    assert slurm.describe(slurm.Poll("PENDING", "BeginTime", "0:0", "")) == "PENDING (BeginTime)"
    assert slurm.describe(poll("FAILED", "1:0")) == "FAILED (ExitCode 1:0) on node[1-3]"
    assert slurm.describe(poll("")).startswith("unknown to Slurm now")


def test_a_job_the_hang_watchdog_ended_is_hung_with_exit_124_unless_it_was_requeued() -> None:
    report = {"why": "hung: no progress for 21s; rank 2 stuck in stuck_forever (ddp_train.py:33)", "host": "node3"}
    hung = slurm.Poll("FAILED", "None", "124:0", "node[1-3]", result={"exit": 124, "hang": True, "requeued": False,
                                                                       "hang_report": report})  # fmt: skip
    assert slurm.outcome(hung) == "hung" and slurm.exit_code(hung) == 124
    assert slurm.describe(hung) == f"FAILED: {report['why']}; suspect node node3"
    forgotten = slurm.Poll("", "", "", "", result=hung.result)
    assert slurm.outcome(forgotten) == "hung" and slurm.describe(forgotten).startswith("ended: hung: ")
    requeued = slurm.Poll("PENDING", "BeginTime", "0:0", "", result={**(hung.result or {}), "requeued": True})
    assert slurm.hang_of(requeued) is None and slurm.describe(requeued) == "PENDING (BeginTime)"
    assert slurm.outcome(slurm.Poll("FAILED", "None", "1:0", "", result={"exit": 1, "hang": False})) == "failed"


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home and stand-ins for sbatch/squeue/scontrol/scancel that record their argv as JSON."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    rec = tmp_path / "calls"
    scontrol = "JobId=4242 JobState=RUNNING Reason=None ExitCode=0:0"
    for tool, out in (("sbatch", "4242;cluster"), ("squeue", "RUNNING|None|node[1-2]"), ("scontrol", scontrol),
                      ("scancel", ""), ("sacct", "")):  # fmt: skip
        script = bin_dir / tool
        script.write_text(
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"open({str(rec)!r}, 'a').write(json.dumps([{tool!r}, sys.argv[1:],"
            " {k: v for k, v in os.environ.items() if k.startswith('NODEOPS_')}]) + '\\n')\n"
            f"print({out!r})\n"
        )
        script.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def calls(d: Path) -> list[list[object]]:
    return [json.loads(line) for line in (d / "calls").read_text().splitlines()]


def test_submit_passes_hostile_arguments_literally(fake_slurm: Path) -> None:
    login = slurm.Login(None)
    job = slurm.submit(login, "20261123-010203-abcd", "#!/bin/bash\necho hi\n", HOSTILE)
    assert job == "4242"
    [(tool, argv, env)] = calls(fake_slurm)
    rdir = fake_slurm / "home" / ".nodeops" / "runs" / "20261123-010203-abcd"
    assert tool == "sbatch"
    assert argv == ["--parsable", "--export=ALL,NODEOPS_RUN_DIR,NODEOPS_RUN_ID",
                    "--comment=nodeops-run=20261123-010203-abcd", f"--output={rdir}/batch.log", f"{rdir}/job.sbatch",
                    *HOSTILE]  # fmt: skip
    # by name in --export (a value would be split at its commas), with SBATCH_EXPORT=NONE too
    assert env == {"NODEOPS_RUN_DIR": str(rdir), "NODEOPS_RUN_ID": "20261123-010203-abcd"}
    assert (rdir / "job.sbatch").read_text() == "#!/bin/bash\necho hi\n"
    assert oct((rdir).stat().st_mode & 0o777) == "0o700" and (rdir / "logs").is_dir()
    assert not Path("/tmp/pwned").exists()


def test_submit_names_the_login_node_when_sbatch_fails(fake_slurm: Path) -> None:
    (fake_slurm / "bin" / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Invalid partition name' >&2\nexit 1\n")
    with pytest.raises(slurm.SlurmError, match="sbatch failed on this machine: sbatch: error: Invalid partition"):
        slurm.submit(slurm.Login(None), "r1", "x", ["t.py"])


def test_poll_reads_whole_lines_from_where_it_left_off(fake_slurm: Path) -> None:
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r2"
    (d / "logs").mkdir(parents=True)
    (d / "batch.log").write_text("nodeops: job 4242\n")
    (d / "logs" / "node1.log").write_text("[rank0]:héllo\n[rank1]:partial")
    login = slurm.Login(None)
    fol = slurm.Follower(login, "r2", "4242", None)
    st = fol.step()
    assert (st.state, st.reason, st.exit, st.nodes) == ("RUNNING", "None", "0:0", "node[1-2]")
    assert list(fol.tails["node1"]) == ["[rank0]:héllo"] and list(fol.tails["batch"]) == ["nodeops: job 4242"]
    with (d / "logs" / "node1.log").open("a") as f:
        f.write(" line\n")
    fol.step()
    assert list(fol.tails["node1"]) == ["[rank0]:héllo", "[rank1]:partial line"]
    (d / "logs" / "node1.log").open("a").write("no newline at the end")
    fol.step(whole=True)  # at the job's end the rest is read too
    assert list(fol.tails["node1"])[-1] == "no newline at the end"
    assert [c[0] for c in calls(fake_slurm)].count("squeue") == 3


def test_cancel_escalates_to_kill_full(fake_slurm: Path) -> None:
    assert slurm.cancel(slurm.Login(None), "4242") == ""
    assert slurm.cancel(slurm.Login(None), "4242", kill=True) == ""
    assert [c[1] for c in calls(fake_slurm)] == [["4242"], ["--signal=KILL", "--full", "4242"]]


def test_sandbox_slurm_conf_and_gres() -> None:
    conf = sandbox_slurm.slurm_conf("t", [("node1", "10.0.0.11", 2), ("node2", "10.0.0.12", 1)], 4)
    assert "SlurmctldHost=node1(10.0.0.11)" in conf
    assert "NodeName=node1 NodeAddr=10.0.0.11 CPUs=4 Gres=gpu:2 State=UNKNOWN" in conf
    assert "ProctrackType=proctrack/linuxproc" in conf and "TaskPlugin=task/none" in conf
    assert sandbox_slurm.gres_conf(2) == "AutoDetect=off\nName=gpu File=/dev/nvidia[0-1]\n"
    assert sandbox_slurm.gres_conf(1) == "AutoDetect=off\nName=gpu File=/dev/nvidia0\n"
    script = sandbox_slurm.node_script(conf, "x", b"k" * 1024, 2, controller=True)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "slurmctld -D" in script and "mknod -m 0666 /dev/nvidia1 c 1 3" in script
    assert "kkkk" not in script  # the munge key travels base64-encoded on stdin, never as text


def test_a_requeued_jobs_failure_report_reads_its_last_run_only() -> None:
    lines = ["[rank2]:first try", f"{SF.RESTART_MARK} 1", "[rank2]:second try", f"{SF.RESTART_MARK} 2", "x"]
    assert SF.last_run(lines) == ["x"]
    assert SF.last_run(["a", "b"]) == ["a", "b"]
    text = slurm.batch_script(load_spec(SPECS / "slurm-full.happy.yaml"))
    assert f'echo "{SF.RESTART_MARK} $restart" >> "$run_dir/logs/$n.log"' in text


def test_check_srun_step_asks_for_the_jobs_shape() -> None:
    opts = slurm_backend.srun_options(load_spec(SPECS / "slurm-full.happy.yaml").spec)
    assert opts[:2] == ["--nodes=16", "--ntasks-per-node=1"]
    for want in ("--partition=gpu", "--account=proj-42", "--qos=high", "--constraint=a100", "--gpus-per-node=8",
                 "--reservation=big-run"):  # fmt: skip
        assert want in opts
    assert not any(o.startswith(("--begin", "--signal", "--exclusive")) for o in opts)
    report = check.Report([check.Row("n1", "ssh", "ok", "x"), check.Row("n1", "torch", "ok", "y")], {}, ["n1"])
    rows = slurm_backend.as_srun_rows(report, "3 node(s) asked for, 2 answered").rows
    assert [(r.check, r.status) for r in rows] == [("srun", "fail"), ("srun", "ok"), ("torch", "ok")]


def test_runs_reads_a_slurm_runs_state(fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeops.backends import store
    from nodeops.lifecycle import runs

    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "nh"))
    d = store.jobs_dir() / "20261123-010203-abcd"
    d.mkdir(parents=True)
    store.Job(run_id=d.name, dir=d, hosts=["localhost"], argv=["t.py"], runner="torchrun", chief="localhost",
             backend="slurm", handle={"job_id": "4242"}).save()  # fmt: skip
    [run] = runs.local_runs()
    assert run.state == "unknown"
    runs.refresh([run])
    assert (run.state, run.detail) == ("running", "Slurm job 4242: RUNNING on node[1-2]")
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/sh\necho 'FAILED|NonZeroExitCode|node[1-2]'\n")
    [run] = runs.local_runs()
    runs.refresh([run])
    assert (run.state, run.exit_code, run.verdict) == ("failed", 1, True)


def test_launch_options_without_meaning_on_slurm_are_refused_before_anything_runs(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from nodeops.cli import app

    key = tmp_path / "id_ed25519"
    key.write_text("not a real key\n")
    spec = tmp_path / "cluster.yaml"
    spec.write_text((SPECS / "slurm-sandbox.happy.yaml").read_text().replace("~/.ssh/id_ed25519", str(key)))
    cli = CliRunner()
    for opts in (["--script", "run.sh"], ["--via", "ansible"]):
        r = cli.invoke(app, ["launch", *opts, str(spec), "train.py"])
        assert r.exit_code == 2, (opts, r.output)
        assert "cannot be used with backend: slurm (nothing was run)" in r.output
    r = cli.invoke(app, ["launch", "--detach", "--attach", str(spec), "train.py"])
    assert r.exit_code == 2 and "--detach and --attach contradict each other" in r.output
    r = cli.invoke(app, ["launch", "--dry-run", str(spec), "--", "train.py", "it's", "$(id)"])
    assert r.exit_code == 0, r.output
    assert "sbatch --parsable --output=RUN_DIR/batch.log RUN_DIR/job.sbatch train.py 'it'\"'\"'s' '$(id)'" in r.output
    assert "#SBATCH --gpus=4" in r.output
    r = cli.invoke(app, ["launch", "--dry-run", "--fabric-check", str(spec), "train.py"])
    assert r.exit_code == 0 and "a step before training would measure the fabric of the job's nodes" in r.output


def test_poll_tells_a_forgotten_job_from_a_failing_controller(fake_slurm: Path) -> None:
    bin_dir = fake_slurm / "bin"
    for tool in ("squeue", "scontrol"):
        (bin_dir / tool).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    st = slurm.poll(slurm.Login(None), "r3", "4242", {})
    assert st.forgotten and not st.error and st.ended
    for tool in ("squeue", "scontrol"):
        (bin_dir / tool).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out on send/recv' >&2\n"
                                    "exit 1\n")  # fmt: skip
    st = slurm.poll(slurm.Login(None), "r3", "4242", {})
    assert not st.forgotten and not st.ended and "Socket timed out" in st.error
    assert slurm.describe(st).startswith("state unknown (squeue: slurm_load_jobs error: Socket timed out")
    fol = slurm.Follower(slurm.Login(None), "r3", "4242", None)
    with pytest.raises(slurm.SlurmError, match="job 4242 may still be running"):
        fol.until_end(interval=0.05, patience=0.3)
    # a job that wrote its result and was then forgotten by Slurm ended, with that result
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r3"
    d.mkdir(parents=True)
    (d / "result.json").write_text('{"exit": 0, "restart": 0, "signal": "", "requeued": false}\n')
    for tool in ("squeue", "scontrol"):
        (bin_dir / tool).write_text("#!/bin/sh\necho 'Invalid job id specified' >&2\nexit 1\n")
    st = fol.until_end(interval=0.05)
    assert st.forgotten and slurm.exit_code(st) == 0
    assert slurm.describe(st) == "ended (exit 0; Slurm has forgotten it since)"


def test_a_truncated_log_is_read_again_from_its_start(fake_slurm: Path) -> None:
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r4" / "logs"
    d.mkdir(parents=True)
    (d / "node1.log").write_text("one\ntwo\nthree\n")
    fol = slurm.Follower(slurm.Login(None), "r4", "4242", None)
    fol.step()
    (d / "node1.log").write_text("new\n")
    fol.step()
    assert list(fol.tails["node1"]) == ["one", "two", "three", "new"]


def test_a_rank_line_torchruns_tee_cut_in_two_is_followed_whole(fake_slurm: Path) -> None:
    # what a CI run's node log held: rank 2's print cut by the tee, with rank 3's line between
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r7" / "logs"
    d.mkdir(parents=True)
    m = "\x1e"  # torchrun's prefix as nodeops sets it: the mark, then [rankN]:
    (d / "node2.log").write_text(f"{m}[rank2]:attempt 2{m}[rank3]:three\n{m}[rank2]:\n{m}[rank2]:done\n"
                                 f"{m}[rank2]:a piece of{m}[rank1]:one\n")  # fmt: skip
    got: list[tuple[str, str]] = []
    fol = slurm.Follower(slurm.Login(None), "r7", "4242", lambda host, line: got.append((host, line)))
    fol.step()
    assert got == [("node2", "[rank3]:three"), ("node2", "[rank2]:attempt 2"), ("node2", "[rank2]:done"),
                   ("node2", "[rank1]:one")]  # fmt: skip
    with (d / "node2.log").open("a") as f:  # its end comes in a later poll
        f.write(f"{m}[rank0]:zero\n{m}[rank2]: a line\n{m}[rank0]:no newline")
    fol.step()
    assert got[-2:] == [("node2", "[rank0]:zero"), ("node2", "[rank2]:a piece of a line")]
    fol.step(whole=True)  # the end: the last line, though it has no newline
    assert got[-1] == ("node2", "[rank0]:no newline")
    assert list(fol.tails["node2"]) == [line for _, line in got]
    # the log truncated (the job requeued) while a piece waits: the piece is shown, then the new log
    (d / "node2.log").write_text(f"{m}[rank1]:cut{m}[rank0]:x, a line longer than the next log\n")
    fol.step()
    (d / "node2.log").write_text("nodeops: requeued, restart 1\n")
    fol.step()
    assert got[-3:] == [("node2", "[rank0]:x, a line longer than the next log"), ("node2", "[rank1]:cut"),
                        ("node2", "nodeops: requeued, restart 1")]  # fmt: skip


def test_ctrl_c_while_sbatch_runs_still_records_the_job_and_cancels_it(
    fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from nodeops.backends import store
    from nodeops.cli import app

    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "nh"))
    (fake_slurm / "bin" / "sbatch").write_text(f"#!/bin/sh\nkill -INT {os.getpid()}\nsleep 0.2\necho 4343\n")
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/sh\necho 'CANCELLED|None|node[1-2]'\n")
    spec = tmp_path / "local.yaml"
    spec.write_text("slurm: {nodes: 2}\nnodes: [{address: 10.0.0.1}]\n")
    r = CliRunner().invoke(app, ["launch", str(spec), "--", "t.py"])
    assert r.exit_code == 130, r.output
    assert "interrupted while submitting: job 4343 cancelled" in r.output
    job = store.find(None)
    assert job.handle["job_id"] == "4343" and job.backend == "slurm"
    assert [c[1] for c in calls(fake_slurm) if c[0] == "scancel"][:1] == [["4343"]]


def test_a_job_slurmctld_forgot_is_read_from_accounting_where_there_is_one(fake_slurm: Path) -> None:
    bin_dir = fake_slurm / "bin"
    for tool in ("squeue", "scontrol"):
        (bin_dir / tool).write_text("#!/bin/sh\necho 'Invalid job id specified' >&2\nexit 1\n")
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'CANCELLED by 1000|0:15|node[1-2]'\n")
    st = slurm.poll(slurm.Login(None), "r5", "4242", {})
    assert (st.state, st.exit, st.nodes) == ("CANCELLED", "0:15", "node[1-2]")
    assert slurm.exit_code(st) == 130
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    assert slurm.poll(slurm.Login(None), "r5", "4242", {}).forgotten


def test_submit_keeps_a_users_sbatch_export_and_finds_a_job_whose_sbatch_timed_out(
    fake_slurm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    slurm.submit(slurm.Login(None), "20261123-010203-abcd", "x", ["t.py"])
    assert calls(fake_slurm)[-1][1][1] == "--export=NODEOPS_RUN_DIR,NODEOPS_RUN_ID"
    monkeypatch.setenv("SBATCH_EXPORT", "ALL,HF_HOME")
    slurm.submit(slurm.Login(None), "20261123-010203-abcd", "x", ["t.py"])
    assert calls(fake_slurm)[-1][1][1] == "--export=ALL,HF_HOME,NODEOPS_RUN_DIR,NODEOPS_RUN_ID"
    # sbatch answers too late (slurmctld busy) but queues the job: found again by its comment
    monkeypatch.setattr(slurm.Login, "run", _timing_out_sbatch(slurm.Login.run))
    (fake_slurm / "bin" / "squeue").write_text(
        "#!/bin/sh\necho '77 nodeops-run=20261123-000000-ffff'\necho '78 nodeops-run=20261123-010203-abcd'\n"
    )
    assert slurm.submit(slurm.Login(None), "20261123-010203-abcd", "x", ["t.py"]) == "78"
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/sh\necho '77 nodeops-run=20261123-000000-ffff'\n")
    with pytest.raises(slurm.SlurmError, match="squeue shows no job of run 20261123-010203-abcd, so none was queued"):
        slurm.submit(slurm.Login(None), "20261123-010203-abcd", "x", ["t.py"])


def _timing_out_sbatch(run):  # type: ignore[no-untyped-def]
    def fake(self, script, timeout=60):  # type: ignore[no-untyped-def]
        if "sbatch --parsable" in script:
            raise slurm.SlurmError(f"{self.where}: no answer within {timeout:.0f}s")
        return run(self, script, timeout)

    return fake


def test_a_forgotten_job_is_never_left_running(fake_slurm: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from nodeops.backends import store
    from nodeops.lifecycle import runs

    for tool in ("squeue", "scontrol"):
        (fake_slurm / "bin" / tool).write_text("#!/bin/sh\necho 'Invalid job id specified' >&2\nexit 1\n")
    # a requeued job cannot be forgotten while queued: once forgotten it has ended
    assert slurm.Poll("", "", "", "", result={"exit": 1, "requeued": True}).ended
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "nh"))
    d = store.jobs_dir() / "20261123-010203-abcd"
    d.mkdir(parents=True)
    store.Job(run_id=d.name, dir=d, hosts=["localhost"], argv=["t.py"], runner="torchrun", chief="localhost",
             backend="slurm", handle={"job_id": "4242", "state": "RUNNING"}).save()  # fmt: skip
    [run] = runs.local_runs()
    runs.refresh([run])
    assert run.state == "gone" and "Slurm has forgotten how" in run.detail


def test_a_whole_read_ends_even_while_the_job_keeps_writing(fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r6" / "logs"
    d.mkdir(parents=True)
    monkeypatch.setattr(slurm, "READ_MAX", 64)
    (d / "node1.log").write_text("".join(f"line {i:03d}\n" for i in range(40)))  # 360 bytes: 6 reads
    fol = slurm.Follower(slurm.Login(None), "r6", "4242", None)
    real_poll = slurm.poll

    def growing(*a: object, **kw: object) -> slurm.Poll:
        with (d / "node1.log").open("a") as f:  # the job writes between any two reads
            f.write("more\n")
        return real_poll(*a, max_bytes=64, **{k: v for k, v in kw.items() if k != "max_bytes"})  # type: ignore[arg-type]

    monkeypatch.setattr(slurm, "poll", growing)
    fol.step(whole=True)
    assert list(fol.tails["node1"])[:40] == [f"line {i:03d}" for i in range(40)]


FAKE_SLURM = {
    # the allocation: node1 (the batch node, 2 GPUs) and node2 (1 GPU)
    "scontrol": """#!/bin/sh
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=10.9.0.1" ;;
esac
""",
    # the GPU-counting step prints FAKE_COUNT (no preflight.in, no fabric args: no other step);
    # the training step (runner deepspeed: python3 -I slurm_batch.py task ...) runs its task once
    # per node, as srun would
    "srun": """#!/bin/bash
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
if [ "${4:-}" != task ]; then printf '%s' "$FAKE_COUNT"; exit 0; fi
for n in node1 node2; do SLURMD_NODENAME=$n "$@" >> "$NODEOPS_RUN_DIR/logs/$n.log" 2>&1 || exit $?; done
""",
    # DeepSpeed's per-node launcher (python -u -m deepspeed.launcher.launch): records its argv
    # and the env .deepspeed_env gave it
    "python": """#!/bin/bash
printf '%s\\n' "$0" "$@" "DS_A=${DS_A:-}" "DS_B=${DS_B:-}" "DS_C=${DS_C:-}" "PYTHONPATH=$PYTHONPATH" \\
  > "$NODEOPS_RUN_DIR/launch.$SLURMD_NODENAME"
echo "started on $SLURMD_NODENAME"
""",
    # Open MPI's mpirun: records how it was called, writes tagged lines and, failing, its report
    "mpirun": """#!/bin/bash
printf '%s\\n' "SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE" "$@" > "$NODEOPS_RUN_DIR/mpirun.args"
printf '[1,0]<stdout>:hello from 0\\n[1,2]<stdout>:hello from 2\\n[1,1]<stdout>:part[1,0]<stdout>:bye 0\\n'
if [ "$FAKE_MPI_EXIT" != 0 ]; then
  printf '  Process name: [[77,1],2]\\n  Exit code:    %s\\n' "$FAKE_MPI_EXIT"
fi
exit "$FAKE_MPI_EXIT"
""",
}


def run_mpirun_job(tmp_path: Path, *, count: str = "node1 2\nnode2 1\n", mpi_exit: int = 0,
                   ship: bool = True, runner: str = "mpirun") -> tuple[int, str]:  # fmt: skip
    """The whole batch script for runner mpirun (or ``runner``), in a real bash with stand-ins for
    scontrol, srun, mpirun and python (python3 is the real one: it runs the shipped mpi_split.py)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    spec = load_spec_text(
        f"slurm:\n  nodes: 2\n  gpus: 3\nnodes:\n  - address: 10.0.0.1\nworkdir:\n  path: {work}\n"
        f"launch:\n  runner: {runner}\n", str(tmp_path / "cluster.yaml"))  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    if ship:
        for name, text in slurm_backend.run_files(spec).items():
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_text(text)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "NODEOPS_RUN_DIR": str(run), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "node1", "SLURM_GPUS": "3", "FAKE_COUNT": count,
           "FAKE_MPI_EXIT": str(mpi_exit)}  # fmt: skip
    p = subprocess.run(["bash", "-c", slurm.batch_script(spec), "job.sbatch", "train.py", "--lr", "1 2"], env=env,
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    return p.returncode, p.stdout + p.stderr


def test_the_mpirun_batch_script_fills_ranks_by_gpus_and_splits_their_lines_by_node(tmp_path: Path) -> None:
    rc, out = run_mpirun_job(tmp_path)
    assert rc == 0, out
    run = tmp_path / "run"
    args = (run / "mpirun.args").read_text().splitlines()
    # 2+1 GPUs: 3 ranks, node1's two first; the daemons' step asks for the other node's 1 GPU
    assert args[0] == "SLURM_TASKS_PER_NODE=2,1"
    assert args[1:] == ["-np", "3", "--mca", "plm_slurm_args", "--gpus=1", "--bind-to", "none", "--map-by", "slot",
                        "--tag-output", "sh", f"{run}/mpi_shim.sh", "python3", "train.py", "--lr", "1 2"]  # fmt: skip
    assert "nodeops: mpirun: 3 rank(s) on 2 node(s) (ranks per node: 2,1)" in out
    assert (run / "logs" / "node1.log").read_text() == "[rank0]:hello from 0\n[rank0]:bye 0\n[rank1]:part\n"
    assert (run / "logs" / "node2.log").read_text() == "[rank2]:hello from 2\n"
    assert "nodeops: mpirun exited 0" in out and not (run / "mpi.fifo").exists()
    assert json.loads((run / "result.json").read_text())["exit"] == 0


def test_the_mpirun_batch_script_names_the_failed_rank_and_refuses_what_it_lacks(tmp_path: Path) -> None:
    rc, out = run_mpirun_job(tmp_path, mpi_exit=3)
    assert rc == 3, out
    assert "nodeops: mpirun: first failure: rank 2 on node2 (exit code 3)" in out
    assert SF.first_failure(out.splitlines()) == ("node2", 3)
    # a node that did not answer the counting step, or files launch did not ship: no rank starts
    for kwargs, said in [({"count": "node1 2\n"}, "node2 did not answer the srun step that counts each node's GPUs"),
                         ({"ship": False}, "mpi_split.py is missing (nodeops launch writes it")]:  # fmt: skip
        rc, out = run_mpirun_job(tmp_path, **kwargs)  # type: ignore[arg-type]
        assert rc == 1 and "nodeops: mpirun: " in out and said in out and "no rank was started" in out, out
        assert not (tmp_path / "run" / "mpirun.args").exists()
        assert json.loads((tmp_path / "run" / "result.json").read_text())["exit"] == 1


def test_the_deepspeed_batch_script_runs_deepspeeds_launcher_on_each_node_with_its_world(tmp_path: Path) -> None:
    """runner deepspeed: one srun task per node runs DeepSpeed's per-node launcher with the
    allocation's world_info (each node's GPU ids as Slurm gave them), the node's rank in it, and
    the .deepspeed_env lines exported (the workdir's after the home's, as DeepSpeed reads them)."""
    (tmp_path / ".deepspeed_env").write_text("DS_A=home\nDS_B=from home\n")
    (tmp_path / "work").mkdir()
    # evaluated on each node, as pdsh's remote shell does: $HOME there, an unset name empty; a
    # MASTER_ADDR here does not move DeepSpeed's rendezvous, and the stack hook stays on PYTHONPATH
    (tmp_path / "work" / ".deepspeed_env").write_text(
        "DS_A = work $HOME\nexport DS_C=$NOPE:c\nMASTER_ADDR=9.9.9.9\nPYTHONPATH=/mine\n"
    )
    rc, out = run_mpirun_job(tmp_path, count="node1 2 0,1\nnode2 1 3\n", runner="deepspeed")
    assert rc == 0, out
    run = tmp_path / "run"
    assert "nodeops: deepspeed: 3 rank(s) on 2 node(s) (ranks per node: 2,1)" in out
    for rank, node in enumerate(["node1", "node2"]):
        argv0, *args = (run / f"launch.{node}").read_text().splitlines()
        assert argv0 == str(tmp_path / "bin" / "python")  # the env's python, by its path
        assert args[:3] == ["-u", "-m", "deepspeed.launcher.launch"], args
        world = json.loads(base64.urlsafe_b64decode(args[3].removeprefix("--world_info=")))
        assert world == {"node1": [0, 1], "node2": [3]}  # node order is rank order; node2's GPU id kept
        assert args[4:7] == [f"--node_rank={rank}", "--master_addr=10.9.0.1", f"--master_port={20000 + 42}"]
        # the user's arguments intact; $HOME expanded, as the shell pdsh runs expands it
        assert args[7:] == ["train.py", "--lr", "1 2", f"DS_A=work {tmp_path}", "DS_B=from home", "DS_C=:c",
                            f"PYTHONPATH={run}/hook:/mine"], args  # fmt: skip
        assert (run / "logs" / f"{node}.log").read_text() == f"started on {node}\n"
    assert "nodeops: srun exited 0" in out
    # a line DeepSpeed's runner would stop on ends the job before any node starts
    (tmp_path / "work" / ".deepspeed_env").write_text("DS_A=1\n\n")
    for f in run.glob("launch.*"):
        f.unlink()
    rc, out = run_mpirun_job(tmp_path, count="node1 2 0,1\nnode2 1 3\n", runner="deepspeed")
    assert rc == 1 and "/.deepspeed_env line 2: '' has no '='" in out and "no rank was started" in out, out
    assert not list(run.glob("launch.*"))


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.from_regex(r"DS_[A-Za-z0-9_]{1,8}", fullmatch=True),
                       st.text(st.characters(blacklist_characters='"`\\$', blacklist_categories=("Cs", "Cc")),
                               max_size=20).map(str.strip), max_size=4))  # fmt: skip
def test_the_deepspeed_env_boot_exports_what_deepspeeds_runner_sends(env: dict[str, str]) -> None:
    """ENV_FILE_BOOT's lines are the fragments DeepSpeed's pdsh runner sends each node
    (deepspeed.export_fragment), and bash's eval of them gives each value back, for the values
    DeepSpeed can carry (deepspeed.env_file_problem)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, ".deepspeed_env").write_text(ds.render_env_file(env), encoding="utf-8")
        boot = [sys.executable, "-I", "-c", ds.ENV_FILE_BOOT]
        lines = subprocess.run(boot, cwd=d, capture_output=True, text=True, check=True,
                               env={"HOME": "/nonexistent", "PYTHONIOENCODING": "utf-8"}).stdout  # fmt: skip
    exports = lines.split("\n")[:-1] if lines else []
    assert [e + "; " for e in exports] == [ds.export_fragment(k, v) for k, v in env.items()]
    got = subprocess.run(["bash", "-c", 'eval "$1"; shift; for k; do printf "%s\\0" "${!k}"; done', "-", lines, *env],
                         capture_output=True, text=True, check=True, env={"LC_ALL": "C.UTF-8"}).stdout  # fmt: skip
    assert got.split("\0")[:-1] == list(env.values())


def test_a_deepspeed_node_that_srun_stopped_while_it_ended_its_failed_rank_is_blamed_with_the_ranks_code() -> None:
    """As seen on the sandbox: node2's rank failed by itself, but node1's launcher (its ranks lost
    node2) exited first, so srun's SIGTERM reached node2's launcher while it was ending: 143."""
    batch = [f"srun: error: node{i + 1}: task {i}: Exited with exit code {c}" for i, c in enumerate((1, 143, 1))]
    lost = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.220.0.12]:20701"
    tails = {
        "node1": [lost, "[2026-11-25 05:59:52,092] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 1420"],
        "node2": [
            "rank 2: failing on purpose at step 3",
            "[2026-11-25 06:03:06,212] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 't.py'] exits "
            "with return code = 1",
        ],
        "node3": [lost],
    }
    assert SF.first_failure(batch, tails) == ("node2", 1)
    own, _ = failures.failure_lines(tails["node2"])
    assert own == ["rank 2: failing on purpose at step 3"]  # the launcher's own log lines left out


class Said:
    """A sink that keeps what it was told."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.outs: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)

    def out(self, text: str) -> None:
        self.outs.append(text)

    def line(self, host: str, text: str) -> None:
        self.outs.append(f"{host} {text}")

    def report(self, report: object) -> None:
        self.notes.append(str(report))


# attempts.json after a lost node (the batch node's rules, each attempt's timeline in epoch seconds)
RECOVERED = {"total": 2, "attempts": [
    {"attempt": 1, "hosts": ["node1", "node2"], "started": 1005.0, "ended": 1063.0, "outcome": "failed",
     "kind": "lost", "culprit": "node2", "why": "its task has sent no heartbeat for 3.0s", "excluded": ["node2"],
     "decision": "node2 excluded; spare node3 takes its place", "preflight_done": 1063.1,
     "times": {"began": 1000.0, "ranks_up": 1020.0, "last_progress": 1057.0, "failed": 1060.0, "stop_sent": 1060.0,
               "ended": 1062.5}},
    {"attempt": 2, "hosts": ["node1", "node3"], "started": 1063.2, "ended": 1120.0, "outcome": "ok",
     "times": {"began": 1063.2, "ranks_up": 1071.0, "last_progress": 1119.0, "ended": 1120.0}},
], "done": True}  # fmt: skip


def test_a_slurm_jobs_timeline_is_in_the_supervisors_form() -> None:
    # launch.restarts: every attempt with its times, as an ssh supervisor's result has them
    res = {"exit": 0, "requeued": False, "times": {"began": 1063.2}}
    st = slurm.Poll("COMPLETED", "", "0:0", "node[1-3]", result=res, recovery=RECOVERED)
    got = slurm.timeline_result(st)
    assert got == {"attempts": RECOVERED["attempts"]}
    lines = store.timeline_lines(got)
    assert lines == [
        "attempt 1 -> 2: lost on node2 at " + time.strftime("%H:%M:%S", time.localtime(1057.0))
        + "; detected +3.0 s; stopped +5.5 s; preflight +6.1 s; started +6.2 s; training again +14.0 s",
        "goodput 72% of 120.0 s: lost 20.0 s to start-up, 5.5 s to faults, 8.5 s to restarts",
    ]  # fmt: skip
    # one step, no restarts: its times in result.json, and the fault the batch node named (its lost node)
    lost = {"exit": 1, "requeued": False, "times": RECOVERED["attempts"][0]["times"],
            "lost": {"node": "node2", "why": "its task has sent no heartbeat for 5.0s"}}  # fmt: skip
    one = slurm.timeline_result(slurm.Poll("FAILED", "", "1:0", "node[1-2]", result=lost))
    assert one["first_failure"] == {"host": "node2", "code": None, "kind": "lost",
                                    "why": "its task has sent no heartbeat for 5.0s"}  # fmt: skip
    assert store.timeline_lines(one)[0].startswith("attempt 1: lost on node2 at ")
    # a script's failure: the node the logs named, its kind from its code
    failed = {"exit": 3, "requeued": False, "times": {"began": 1000.0, "ranks_up": 1010.0, "failed": 1030.0,
                                                      "stop_sent": 1030.0, "ended": 1031.0}}  # fmt: skip
    got = slurm.timeline_result(slurm.Poll("FAILED", "", "3:0", "n", result=failed), {"host": "node1", "code": 3})
    assert got["first_failure"]["kind"] == "script"
    assert store.timeline_lines(got)[0].endswith("script on node1 at " + time.strftime("%H:%M:%S",
                                                 time.localtime(1030.0)) + "; stopped +1.0 s")  # fmt: skip
    # no timeline recorded (an older release's job, runner mpirun, a preflight that failed): none shown
    assert slurm.timeline_result(slurm.Poll("FAILED", "", "1:0", "n", result={"exit": 1})) == {}
    assert store.timeline_lines({}) == []


def test_status_and_runs_show_a_finished_slurm_runs_timeline_and_goodput(
    fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "nh"))
    d = store.jobs_dir() / "20261123-010203-abcd"
    d.mkdir(parents=True)
    job = store.Job(run_id=d.name, dir=d, hosts=["localhost"], argv=["t.py"], runner="torchrun", chief="localhost",
                    backend="slurm", handle={"job_id": "4242"})  # fmt: skip
    job.save()
    # the run dir on the login node (here), as the batch node left it
    rdir = fake_slurm / "home" / ".nodeops" / "runs" / d.name
    (rdir / "logs").mkdir(parents=True)
    res = {"exit": 0, "restart": 0, "signal": "", "requeued": False, "hang": False,
           "times": RECOVERED["attempts"][1]["times"]}  # fmt: skip
    (rdir / "result.json").write_text(json.dumps(res))
    (rdir / SF.ATTEMPTS).write_text(json.dumps(RECOVERED))
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/sh\necho 'COMPLETED|None|node[1-3]'\n")
    said = Said()
    slurm_backend.SlurmBackend().status(job, said)
    assert said.outs[0].startswith("job 4242       COMPLETED")
    assert said.outs[-2].startswith("  attempt 1 -> 2: lost on node2 at ") and "detected +3.0 s" in said.outs[-2]
    assert said.outs[-1] == "  goodput 72% of 120.0 s: lost 20.0 s to start-up, 5.5 s to faults, 8.5 s to restarts"
    # runs: Slurm says it is over, and nobody followed it: its verdict is kept, with the goodput
    [run] = runs.local_runs()
    runs.refresh([run])
    good = {
        "goodput": 0.7167,
        "wall": 120.0,
        "training": 86.0,
        "startup": 20.0,
        "faults": 5.5,
        "restarts": 8.5,
        "stalls": 0,
    }
    assert (run.state, run.verdict, run.goodput) == ("ok", True, good)
    assert [a["attempt"] for a in run.attempts] == [1, 2]
    [again] = runs.local_runs()  # the next listing reads the kept verdict: no Slurm asked
    assert (again.state, again.goodput) == ("ok", run.goodput)


def test_a_slurm_runs_stalls_are_on_its_timeline_live_and_after() -> None:
    t0 = 1_800_000_000.0
    stall = {"at": t0 + 6.1, "since": t0, "line": "rank 2 (node3) has made no progress for 6s, in fetch (t.py:3)",
             "ended": t0 + 30, "lasted": 30.0}  # fmt: skip
    live = slurm.Poll(state="RUNNING", reason="", exit="0:0", nodes="node[1-3]", stalls=[stall])
    (line,) = store.timeline_lines(slurm.timeline_result(live))  # no training step's times yet: the stall only
    assert line.startswith("stall: last progress at ") and "reported +6.1 s; training again +30.0 s" in line
    times = {"began": t0 - 20, "ranks_up": t0 - 10, "ended": t0 + 70}
    done = dataclasses.replace(live, state="COMPLETED", result={"exit": 0, "times": times})
    lines = store.timeline_lines(slurm.timeline_result(done))
    assert lines[0] == line and lines[-1].endswith("lost 10.0 s to start-up, 30.0 s to stalls"), lines
