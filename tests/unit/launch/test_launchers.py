"""Launch commands per host, and the job script that carries user arguments literally."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nodeops.backends import starter
from nodeops.launch import launchers
from nodeops.node import mpi_split
from nodeops.spec.load import load_spec_text

SPEC = """
nodes:
  - {address: 10.0.0.1, chief: true, gpus: [0, 1]}
  - {address: 10.0.0.2, gpus: [0, 1]}
  - {address: 10.0.0.3, gpus: [0, 1]}
"""
HETERO = """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0], nproc: 2}
  - {address: 10.0.0.2, cpus: [0]}
  - {address: 10.0.0.3, cpus: [0]}
launch: {runner: torchrun, max_restarts: 3}
"""


def test_torchrun_static_gives_each_host_its_rank() -> None:
    plan = launchers.plan(load_spec_text(SPEC).spec, ["train.py", "--lr", "1e-3"], "r1")
    assert [h.node_rank for h in plan] == [0, 1, 2]
    for h in plan:
        assert h.argv[:3] == ["python3", "-m", "torch.distributed.run"]
        assert h.argv[h.argv.index("--node-rank") + 1] == str(h.node_rank)
        assert h.argv[h.argv.index("--master-addr") + 1] == "10.0.0.1"
        assert h.argv[-3:] == ["train.py", "--lr", "1e-3"]
        assert h.env["NODE_RANK"] == str(h.node_rank) and h.env["NNODES"] == "3" and h.env["WORLD_SIZE"] == "6"
        assert h.env["MASTER_ADDR"] == "10.0.0.1" and h.env["NODEOPS_RUN_ID"] == "r1"


def test_heterogeneous_nproc_uses_c10d_and_max_restarts() -> None:
    plan = launchers.plan(load_spec_text(HETERO).spec, ["t.py"], "run-7")
    assert [h.nproc for h in plan] == [2, 1, 1]
    for h in plan:
        assert "--node-rank" not in h.argv
        assert h.argv[h.argv.index("--rdzv-backend") + 1] == "c10d"
        assert h.argv[h.argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
        assert h.argv[h.argv.index("--rdzv-id") + 1] == "run-7"
        assert h.argv[h.argv.index("--max-restarts") + 1] == "3"
    assert plan[0].env["WORLD_SIZE"] == "4"


def test_mpirun_runs_once_from_the_chief_with_env_by_name() -> None:
    spec = load_spec_text(SPEC + "launch: {runner: mpirun}\n").spec
    plan = launchers.plan(spec, ["train.py"], "r", socket_ifname="eth0", env_names=["HF_TOKEN"], shim_path="/s/shim")
    assert plan[1].argv == [] and plan[2].argv == []
    argv = plan[0].argv
    assert argv[:5] == ["mpirun", "-np", "6", "-H", "10.0.0.1:2,10.0.0.2:2,10.0.0.3:2"]
    assert argv[5:10] == ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"PATH", "MASTER_ADDR", "MASTER_PORT", "NODEOPS_RUN_ID", "HF_TOKEN"} <= forwarded
    assert "NODE_RANK" not in forwarded  # the chief's value would be wrong on the other nodes
    assert launchers.rank_hosts(spec) == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3"]
    assert argv[argv.index("btl_tcp_if_include") + 1] == "eth0"
    assert argv[argv.index("-x", argv.index("HF_TOKEN") - 1) + 1] == "HF_TOKEN"
    assert not any("=" in a for a in argv), "values never go on mpirun's command line"
    assert argv[-3:] == ["/s/shim", "python3", "train.py"]


def test_deepspeed_runs_from_the_chief_with_the_hostfile() -> None:
    spec = load_spec_text(SPEC + "launch: {runner: deepspeed, master_port: 29600}\n").spec
    plan = launchers.plan(spec, ["train.py", "--deepspeed"], "r", hostfile_path="/h/hostfile")
    assert plan[0].argv == ["deepspeed", "--hostfile", "/h/hostfile", "--master_addr", "10.0.0.1",
                            "--master_port", "29600", "train.py", "--deepspeed"]  # fmt: skip
    assert [h.argv for h in plan[1:]] == [[], []]


def test_script_mode_exposes_the_runner_prefix() -> None:
    plan = launchers.plan(load_spec_text(SPEC).spec, ["--epochs", "2"], "r", script="run.sh")
    assert plan[1].argv == ["bash", "run.sh", "--epochs", "2"]
    assert plan[1].env["NODEOPS_RUNNER"].startswith("python3 -m torch.distributed.run --nnodes 3")
    assert "--node-rank 1" in plan[1].env["NODEOPS_RUNNER"]


def test_mpi_shim_maps_ranks(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.write_text(launchers.mpi_shim())
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PATH": "/usr/bin:/bin"}  # fmt: skip
    out = subprocess.run(["sh", str(shim), "sh", "-c", 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE"'],
                         env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.split() == ["3", "4", "1", "2"]


def test_mpi_shim_marks_a_failed_ranks_exit_and_waits_for_a_signalled_rank(tmp_path: Path) -> None:
    """The shim runs the rank as a child: a non-zero exit gets its mark on stderr (mpi_split.EXITED)
    and the rank's code; no shell words about a signal ("Aborted"), and a rank a signal ended
    ends the shim by the same signal (mpirun reports it as before). Open MPI signals the whole
    group: the shim waits for the rank (which may handle the signal and go on), not dies first,
    and its mark says a signal came from outside."""
    shim = tmp_path / "shim"
    shim.write_text(launchers.mpi_shim())
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NODEOPS_RUN_ID": "r"}

    def run(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(shim), "sh", "-c", script], env=env, capture_output=True, text=True,
                              cwd=tmp_path, check=False)  # fmt: skip

    ok = run("echo out; echo err >&2")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "out\n", "err\n")
    bad = run("echo err >&2; exit 3")
    text, mark = mpi_split.exited(bad.stderr.splitlines()[-1])
    assert bad.returncode == 3 and bad.stderr.splitlines()[:-1] == ["err"] and text == "" and mark is not None
    assert (mark.code, mark.signalled) == (3, False) and abs(mark.at - time.time()) < 60
    aborted = run("kill -ABRT $$")
    assert aborted.returncode == -signal.SIGABRT  # the shim itself ended by the rank's signal
    mark = mpi_split.exited(aborted.stderr.splitlines()[-1])[1]
    assert mark is not None and mark.code == 134 and aborted.stderr.splitlines()[:-1] == []
    assert not list(tmp_path.glob("core*"))  # and left no core file of its own in the cwd
    handler = "trap 'echo got TERM; sleep 0.3; echo still here; exit 3' TERM; echo ready; while :; do sleep 0.1; done"
    p = subprocess.Popen(["sh", str(shim), "sh", "-c", handler], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    os.killpg(p.pid, signal.SIGTERM)  # as Open MPI's daemon does
    out, err = p.communicate(timeout=10)
    assert (p.returncode, out) == (3, "got TERM\nstill here\n")
    mark = mpi_split.exited(err.splitlines()[-1])[1]
    assert mark is not None and (mark.code, mark.signalled) == (3, True)


def test_stacks_finds_the_rank_under_the_mpi_shim_not_the_shim(tmp_path: Path) -> None:
    """`nodeops stacks` and the hang watchdog pick each rank by RANK in its environment; the shim's
    shell may carry RANK too (a spec's env forwarded by mpirun -x): its child is the rank."""
    from nodeops.node import stacks as S

    shim = tmp_path / S.SHIM
    shim.write_text(launchers.mpi_shim())
    run_id = f"shim-{os.getpid()}"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NODEOPS_RUN_ID": run_id, "RANK": "5",
           "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"}  # fmt: skip
    p = subprocess.Popen(["sh", str(shim), sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                         env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline() == "\n"
        pids = S.tagged_pids(run_id)
        assert p.pid in pids and len(pids) == 2  # the shim and the rank
        (rank, pid), *more = S.ranks(pids)
        assert (rank, more) == (5, []) and pid != p.pid and S.parent(pid) == p.pid
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def render_job(argv: list[str], env: dict[str, str], workdir: str, **kw: Any) -> str:
    """The real template, rendered by starter with the production quoting (what both transports ship)."""
    return starter.render_job(run_id="r", host="h", workdir=workdir, env=env, argv=argv, **kw)


ARGS = st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40),
                max_size=6)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(args=ARGS, value=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30))
def test_user_arguments_reach_sys_argv_literally(tmp_path_factory: object, args: list[str], value: str) -> None:
    probe = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['NODEOPS_PROBE']]))"
    script = render_job([sys.executable, "-c", probe, *args], {"NODEOPS_PROBE": value}, "/")
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    assert p.returncode == 0, (script, p.stderr)
    assert json.loads(p.stdout) == [args, value]


def test_tricky_arguments_explicitly() -> None:
    args = ["--prompt", "I am 6' tall", 'I am 72" tall', "$(touch /tmp/pwned)", "a; rm -rf /", "line1\nline2", "", "*"]
    probe = "import json, sys; print(json.dumps(sys.argv[1:]))"
    p = subprocess.run(["bash", "-c", render_job([sys.executable, "-c", probe, *args], {}, "/")],
                       capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(p.stdout) == args
    assert not Path("/tmp/pwned").exists()


def test_shared_envs_expand_once_against_the_login_env_and_secrets_skip_deepspeed(tmp_path: Path) -> None:
    """AutoDist's example arrives expanded (once, even though env.sh also sets it), command
    substitution never runs, and under DeepSpeed's runner no secret is left in the environment."""
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(
        'export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"\nexport MLFLOW_TRACKING_PASSWORD=s3cr3t\n'
    )
    names = ("LD_LIBRARY_PATH", "A", "MLFLOW_TRACKING_PASSWORD")
    probe = f"import json, os; print(json.dumps([os.environ.get(k) for k in {names!r}]))"
    shared = {"LD_LIBRARY_PATH": "$LD_LIBRARY_PATH:/usr/local/cuda/lib64", "A": "${HOME}/x $(touch /tmp/pwned-se)"}
    for runner, secret in (("torchrun", "s3cr3t"), ("deepspeed", None)):
        script = render_job([sys.executable, "-c", probe], {"NODEOPS_RUN_ID": "r", "NODEOPS_RUN_DIR": str(tmp_path)},
                            str(tmp_path), env_file=str(env_sh), shared_envs=shared, runner=runner,
                            secret_names=["MLFLOW_TRACKING_PASSWORD"])  # fmt: skip
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin", "HOME": "/home/u", "LD_LIBRARY_PATH": "/base"})  # fmt: skip
        assert json.loads(p.stdout.splitlines()[-1]) == [
            "/base:/usr/local/cuda/lib64", "/home/u/x $(touch /tmp/pwned-se)", secret
        ], runner  # fmt: skip
    assert not Path("/tmp/pwned-se").exists()


def test_a_workdir_with_command_substitution_never_runs_it(tmp_path: Path) -> None:
    p = subprocess.run(["bash", "-c", render_job(["true"], {}, f"{tmp_path}/$(touch {tmp_path}/ran)x")],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert p.returncode == 97 and "cannot cd to" in p.stderr
    assert not (tmp_path / "ran").exists()


def test_mpirun_failure_names_the_failing_ranks_own_host_and_lines() -> None:
    """mpirun runs on node1, but rank 2 on node3 failed: name node3 and rank 2's own lines."""
    from collections import deque

    from nodeops.node import failures

    root = failures.HostState("node1", exit_code=1)
    root.tail.extend([
        "[1,2]<stdout>:FAILING on purpose", "[1,0]<stdout>:step 3",
        "--------------------------------------------------------------------------",
        "mpirun detected that one or more processes exited with non-zero status, thus causing",
        "the job to be terminated. The first process to do so was:", "",
        "  Process name: [[48939,1],2]", "  Exit code:    1",
    ])  # fmt: skip
    rank_tails: dict[int, deque[str]] = {}
    for line in root.tail:
        for rank, text in mpi_split.pieces(line)[1]:
            rank_tails.setdefault(rank, deque()).append(text)
    blamed = failures.blame_mpi_rank(root, rank_tails, ["node1", "node2", "node3"])
    assert (blamed.host, blamed.exit_code, list(blamed.tail)) == ("node3 [rank2]", 1, ["FAILING on purpose"])
    assert failures.blame_mpi_rank(root, rank_tails, []) is root  # not an mpirun run: unchanged
    # mpirun named rank 0, whose peer closed the connection; rank 2 failed by itself first (its
    # shim's exit mark): rank 2 is blamed, with its code, and its lines without the mark
    root.tail.extend(["mpirun noticed that process rank 0 with PID 0 on node node1 exited on signal 6 (Aborted)."])
    root.tail.remove("  Process name: [[48939,1],2]")
    rank_tails = {0: deque(["Connection closed by peer [10.0.0.3]:1234", "@@nodeops-rank-exit 134 10.5 -"]),
                  2: deque(["FAILING on purpose", "@@nodeops-rank-exit 7 10.1 -"])}  # fmt: skip
    blamed = failures.blame_mpi_rank(root, rank_tails, ["node1", "node2", "node3"])
    assert (blamed.host, blamed.exit_code, list(blamed.tail)) == ("node3 [rank2]", 7, ["FAILING on purpose"])
