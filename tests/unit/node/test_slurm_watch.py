"""The Slurm hang watchdog (``watch.py``) and the per-node stack collector (``stacks.py RUN_DIR``)
with real rank processes on this machine: Python children with RANK and the run's id in their
environment and the stack hook on their PYTHONPATH, as torchrun's workers have them inside a
Slurm step.

Slurm is not here: ``srun`` is a stand-in on PATH that runs the command once, on "this node",
its output into ``--output`` with ``%N`` as the node's name. The real srun path (the batch
script, ``srun --overlap`` beside the training step) is tested on the Slurm sandbox
(tests/integration/test_slurm.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeops.backends.slurm import backend
from nodeops.node import slurm_watch as W
from nodeops.node import stacks as S
from nodeops.node import stall as ST

pytestmark = pytest.mark.slow

FAKE_SRUN = """#!/bin/bash
# a stand-in for srun: the options, then the command, run once here as node "nodeA"
out=/dev/stdout
while [ $# -gt 0 ]; do
  case $1 in
    --output=*) out=${1#--output=}; out=${out//%N/nodeA}; shift;;
    --*) shift;;
    *) break;;
  esac
done
exec "$@" > "$out"
"""

RANK = """
import time
def {func}():
    while True:
        time.sleep(0.2)
print("rank {rank} up", flush=True)
{func}()
"""

# (the ranks start a second after the step, as torchrun's do: the watch has looked by then, and
# their first lines are their first progress)
STEP = """trap 'kill $(jobs -p) 2>/dev/null; wait; exit 143' TERM
sleep 1
{ranks}
wait
"""


def run_dir(tmp: Path, timeout: float) -> Path:
    d = tmp / "20261124-101500-ab12"  # the run id is the dir's name, as ~/.nodeops/runs/RUN
    (d / "logs").mkdir(parents=True)
    (d / S.HOOK_DIR).mkdir()
    (d / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    (d / "stacks.py").write_text(Path(S.__file__).read_text())
    (d / "watch.py").write_text(Path(W.__file__).read_text())
    (d / "stall.py").write_text(Path(ST.__file__).read_text())
    (d / W.CONFIG).write_text(json.dumps({"hang_timeout": timeout}))
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    return d


def env_for(d: Path, tmp: Path) -> dict[str, str]:
    return {"PATH": f"{tmp / 'bin'}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", "NODEOPS_RUN_ID": d.name,
            "PYTHONPATH": str(d / S.HOOK_DIR), "NODEOPS_PROGRESS_FILE": str(d / "progress")}  # fmt: skip


def start_step(d: Path, tmp: Path, body: str) -> subprocess.Popen[bytes]:
    """The training step as srun would run it on one node: its output in logs/nodeA.log."""
    log = open(d / "logs" / "nodeA.log", "ab")  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(["bash", "-c", body], env=env_for(d, tmp), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    finally:
        log.close()


def ranks_body(funcs: list[str]) -> str:
    lines = [f"RANK={i} {sys.executable} -c {shlex.quote(RANK.format(func=f, rank=i))} &" for i, f in enumerate(funcs)]
    return STEP.replace("{ranks}", "\n".join(lines))


def alive_ranks(d: Path) -> list[int]:
    return S.tagged_pids(d.name)


def test_the_watchdog_names_the_stuck_rank_and_ends_the_step(tmp_path: Path) -> None:
    d = run_dir(tmp_path, 2)
    step = start_step(d, tmp_path, ranks_body(["wait_in_all_reduce", "wait_in_all_reduce", "stuck_forever"]))
    try:
        t0 = time.monotonic()
        w = subprocess.run([sys.executable, str(d / "watch.py"), str(d), str(step.pid), "nodeA"],
                           env=env_for(d, tmp_path), capture_output=True, text=True, timeout=90)  # fmt: skip
        took = time.monotonic() - t0
        assert w.returncode == 0, w.stderr
        assert step.wait(timeout=30) == 143  # SIGTERM reached the step, which ended its ranks
        hang = json.loads((d / W.HANG).read_text())
        assert hang["suspects"] == ["rank 2 (nodeA): stuck_forever (<string>:5) <- <module> (<string>:7)"], hang
        assert hang["host"] == "nodeA" and "rank 2 stuck in stuck_forever" in hang["why"], hang
        assert sorted(dump["rank"] for dump in hang["dumps"]) == [0, 1, 2]
        assert {dump["method"] for dump in hang["dumps"]} <= {"py-spy", "signal"}
        assert hang["silent_hosts"] == [] and hang["timeout"] == 2
        # what the batch log gets: the finding, the groups, and the stop
        assert "nodeops: hang: no progress for " in w.stdout, w.stdout
        assert "nodeops: hang: stuck: rank 2 (nodeA): stuck_forever" in w.stdout, w.stdout
        assert "nodeops: hang: the others: ranks 0-1 (nodeA): wait_in_all_reduce" in w.stdout, w.stdout
        assert "SIGTERM to its launcher, srun or mpirun, " in w.stdout
        assert took < 45, took
    finally:
        if step.poll() is None:
            os.killpg(step.pid, signal.SIGKILL)
            step.wait()
    deadline = time.monotonic() + 10
    while alive_ranks(d) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_ranks(d) == []


@pytest.mark.parametrize(
    "body",
    [
        'for i in $(seq 1 10); do touch "$NODEOPS_PROGRESS_FILE"; sleep 0.5; done\n',  # progress without output
        "sleep 6\n",  # silent from the start (imports, rendezvous): the 2 s count from the first progress
    ],
    ids=["progress-without-output", "not-started-yet"],
)
def test_a_quiet_step_is_not_called_hung_and_the_watchdog_ends_with_it(tmp_path: Path, body: str) -> None:
    d = run_dir(tmp_path, 2)
    step = start_step(d, tmp_path, body)
    w = subprocess.run([sys.executable, str(d / "watch.py"), str(d), str(step.pid), "nodeA"],
                       env=env_for(d, tmp_path), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert step.wait(timeout=10) == 0
    assert w.returncode == 0 and w.stdout == "", w.stdout + w.stderr
    assert not (d / W.HANG).exists()


# a rank that prints a step every 0.3 s for 3 s (the pace), then sits in FUNC
STEPPING = """
import time
def {func}():
    while True:
        time.sleep(0.2)
for i in range(10):
    print("rank {rank} step", i, flush=True)
    time.sleep(0.3)
{func}()
"""


def test_a_stall_is_reported_in_the_batch_log_and_the_step_goes_on(tmp_path: Path) -> None:
    d = run_dir(tmp_path, 60)  # the hard timeout far away: only the stall watch speaks
    lines = [f"RANK={i} {sys.executable} -c {shlex.quote(STEPPING.format(func=f, rank=i))} &"
             for i, f in enumerate(["wait_in_all_reduce", "wait_in_all_reduce", "fetch_batch"])]  # fmt: skip
    step = start_step(d, tmp_path, STEP.replace("{ranks}", "\n".join(lines)))
    w = subprocess.Popen([sys.executable, str(d / "watch.py"), str(d), str(step.pid), "nodeA"],
                         env=env_for(d, tmp_path), stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (d / W.STALLS).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (d / W.STALLS).exists(), "no stall reported within 60 s"
        assert step.poll() is None  # reported, not stopped
    finally:
        os.killpg(step.pid, signal.SIGKILL)
        step.wait()
        out, _ = w.communicate(timeout=30)
    (stall,) = json.loads((d / W.STALLS).read_text())
    assert stall["host"] == "nodeA" and stall["line"].startswith("rank 2 (nodeA) has made no progress for "), stall
    assert "in fetch_batch (<string>:5); ranks 0-1 are in wait_in_all_reduce (<string>:5)" in stall["line"], stall
    assert stall["at"] - stall["since"] < 15
    assert ST.NOTE_MARK + "stall: rank 2 (nodeA) has made no progress" in out, out
    assert not (d / W.HANG).exists()


def test_grown_names_the_nodes_whose_log_grew() -> None:
    seen = (("a.log", 1), ("b.log", 5), ("progress", 7))
    assert W.grown(seen, (("a.log", 2), ("b.log", 5), ("progress", 7))) == ["a"]
    assert W.grown(seen, (("a.log", 1), ("b.log", 5), ("progress", 9))) == ["a", "b"]  # the script's own mark


def test_started_means_every_nodes_log_grew() -> None:
    first = (("nodeA.log", 10), ("nodeB.log", 0))
    assert not W.started(first, (("nodeA.log", 20), ("nodeB.log", 0)), ["nodeA", "nodeB"])
    assert W.started(first, (("nodeA.log", 20), ("nodeB.log", 5)), ["nodeA", "nodeB"])
    assert not W.started(first, (*first, ("progress", 7)), ["nodeA", "nodeB"])  # the progress file is not a node
    assert W.started((), (("nodeC.log", 1),), [])  # without node names: any log


def test_no_config_no_watchdog(tmp_path: Path) -> None:
    d = run_dir(tmp_path, 2)
    (d / W.CONFIG).unlink()
    w = subprocess.run([sys.executable, str(d / "watch.py"), str(d), "1"], capture_output=True, text=True, timeout=30)
    assert w.returncode == 0 and "hang watchdog off" in w.stderr


def test_stacks_py_answers_for_this_nodes_ranks_only(tmp_path: Path) -> None:
    """What `nodeops stacks` runs in each srun task: the run's ranks here, else why none."""
    d = run_dir(tmp_path, 2)
    step = start_step(d, tmp_path, ranks_body(["main_loop"]))
    try:
        deadline = time.monotonic() + 20
        while b"rank 0 up" not in (d / "logs" / "nodeA.log").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)
        p = subprocess.run([sys.executable, str(d / "stacks.py"), str(d), "--method", "signal"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        dumps = [json.loads(line[len(S.MARK) :]) for line in p.stdout.splitlines() if line.startswith(S.MARK)]
        assert [(x["rank"], x["method"]) for x in dumps] == [(0, "signal")], p.stdout + p.stderr
        assert dumps[0]["frames"][0]["func"] == "main_loop"
    finally:
        os.killpg(step.pid, signal.SIGTERM)
        step.wait(timeout=20)
    other = tmp_path / "20261124-101500-ffff"
    other.mkdir()
    p = subprocess.run([sys.executable, str(d / "stacks.py"), str(other)], capture_output=True, text=True, timeout=30)
    assert p.stdout.startswith(S.NONE_MARK + "no rank of run 20261124-101500-ffff runs on "), p.stdout


def test_read_answers_skips_what_it_cannot_read(tmp_path: Path) -> None:
    out = tmp_path / "hang"
    out.mkdir()
    (out / "node1.out").write_text(S.MARK + json.dumps({"rank": 0, "frames": []}) + "\n" + S.MARK + "{cut\n")
    (out / "node2.out").write_text(S.NONE_MARK + "no rank here\n")
    (out / "node3.out").write_text("srun: error: something\n")
    (out / "stray.txt").write_text(S.MARK + json.dumps({"rank": 9}) + "\n")
    dumps, answered = W.read_answers(str(out))
    assert dumps == [{"rank": 0, "frames": [], "host": "node1"}]
    assert answered == {"node1", "node2"}


def test_nodeops_stacks_on_slurm_names_every_node_that_gave_no_answer() -> None:
    dump = S.MARK + json.dumps({"rank": 0, "frames": [], "method": "signal"})
    text = "\n".join(["@@nodes node1 node2 node3 ", "@@node node1", dump, "@@node node3",
                      S.NONE_MARK + "no rank of run R runs on node3",
                      "@@srun 124 srun: Job step aborted"])  # fmt: skip
    dumps, none = backend.parse_stacks(text, "job 7")
    assert [(d["rank"], d["host"]) for d in dumps] == [(0, "node1")]
    assert none == {"node2": "no answer (the stacks step (srun --overlap) exited 124: srun: Job step aborted)",
                    "node3": "no rank of run R runs on node3"}  # fmt: skip
    # nothing at all came back: srun's own failure is the answer
    assert backend.parse_stacks("@@srun 1 srun: error: Unable to create step", "job 7") == (
        [],
        {"job 7": "the stacks step (srun --overlap) exited 1: srun: error: Unable to create step"},
    )
