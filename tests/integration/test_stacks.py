"""`nodeops stacks` and the hang watchdog on the 3-node sandbox: real torchrun ranks (gloo, CPU)
blocked for real, their stacks read by py-spy (ptrace) or by the signal hook (faulthandler)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from nodeops.backends import store
from nodeops.sandbox import cluster as sandbox

from .conftest import one_group_stacks
from .test_launch import CLEAN, _cli, controller_leftovers, launch, no_leftovers_within, variant_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _detach(project: Path, *args: str) -> str:
    p = launch(project / "cluster.yaml", "--detach", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def _wait_running(run_id: str, ranks: int = 3, seconds: float = 120) -> None:
    """Until every rank has printed its first line (the job's Python is up everywhere)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        logs = _cli("logs", run_id).stdout
        if len(re.findall(r"\]:rank \d/\d on ", logs)) >= ranks and "step 1 " in logs:
            return
        time.sleep(1)
    raise AssertionError(f"run {run_id} did not start every rank:\n{_cli('logs', run_id).stdout[-2000:]}")


def test_hang_watchdog_names_the_stuck_rank_and_stops_the_run(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    t0 = time.monotonic()
    p = launch(project / "cluster.yaml", "--hang-timeout", "20", "--", "ddp_train.py", "--steps", "1000",
               "--sleep", "0.2", "--hang-rank", "2", "--hang-step", "3", timeout=400)  # fmt: skip
    took = time.monotonic() - t0
    assert p.returncode == 124, p.stderr[-3000:]
    assert re.search(r"HUNG: no rank showed progress for \d+s \(hang timeout 20s\)", p.stderr), p.stderr[-3000:]
    # the stuck rank, its host and its function; the others wait in all_reduce
    assert re.search(r"stuck: rank 2 \(node3\): stuck_forever \(ddp_train\.py:\d+\)", p.stderr), p.stderr[-3000:]
    assert re.search(r"the others: ranks 0-1 \(node1, node2\): all_reduce \(", p.stderr), p.stderr[-3000:]
    assert "every rank's stack: " in p.stderr
    # the stall watch named it first, live, within seconds (0.2 s steps), without stopping the run
    stall = re.search(r"==> stall: rank 2 \(node3\) has made no progress for (\d+)s, in stuck_forever "
                      r"\(ddp_train\.py:\d+\); ranks 0-1 wait in all_reduce \(", p.stderr)  # fmt: skip
    assert stall is not None and int(stall.group(1)) <= 15, p.stderr[-3000:]
    assert p.stderr.index("==> stall:") < p.stderr.index("HUNG:")
    run_id = re.search(r"==> run (\S+): starting", p.stderr).group(1)  # type: ignore[union-attr]
    hang = json.loads((store.jobs_dir() / run_id / "stacks" / "hang.json").read_text())
    assert sorted(d["rank"] for d in hang["dumps"]) == [0, 1, 2]
    assert all(d["method"] in ("py-spy", "signal") for d in hang["dumps"]), hang["dumps"]
    assert no_leftovers_within(sandbox_cluster, 10) == CLEAN
    assert controller_leftovers(run_id) == []
    runs = {r["run_id"]: r for r in json.loads(_cli("runs", "--json").stdout)}
    assert (runs[run_id]["state"], runs[run_id]["exit_code"]) == ("hung", 124)
    print(f"hang watchdog: launch returned after {took:.0f}s; methods "
          f"{sorted({d['method'] for d in hang['dumps']})}")  # fmt: skip


def test_detached_hang_is_judged_on_the_chief_and_status_says_hung(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    run_id = _detach(project, "--hang-timeout", "15s", "--", "ddp_train.py", "--steps", "1000", "--sleep", "0.2",
                     "--hang-rank", "0", "--hang-step", "2")  # fmt: skip
    deadline = time.monotonic() + 150
    st = _cli("status", run_id)
    while time.monotonic() < deadline and "hung" not in st.stderr + st.stdout:
        time.sleep(3)
        st = _cli("status", run_id)
    assert "hung: no progress for" in st.stderr, st.stdout + st.stderr
    assert re.search(r"stuck: rank 0 \(node1\): stuck_forever", st.stderr), st.stderr
    assert re.search(
        r"stall: last progress at [\d:]+; reported \+[\d.]+ s; .*: rank 0 \(node1\) has made", st.stderr
    ), st.stderr
    assert (store.jobs_dir() / run_id / "stacks" / "hang.json").is_file()
    assert no_leftovers_within(sandbox_cluster, 15) == CLEAN


def in_main(frame: dict[str, object]) -> bool:
    """The innermost frame is main of ddp_train.py (its sleep between steps); {} (no frame) is not."""
    return (frame.get("func"), Path(str(frame.get("file", ""))).name) == ("main", "ddp_train.py")


def test_stacks_of_a_healthy_run_then_of_a_finished_one(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    run_id = _detach(project, "--", "ddp_train.py", "--steps", "1000", "--sleep", "1.0")
    try:
        _wait_running(run_id)
        answers = {}
        for method in ("auto", "signal"):  # signal: the no-ptrace path, forced
            # The ranks spend ~all their time in the same sleep: one group there, nearly always. A
            # look can catch them all in a step's backward instead (one group too, seen on a loaded
            # machine), so it looks again until they are in the sleep.
            for _ in range(5):
                p = _cli("stacks", run_id, "--json", "--method", method)
                assert p.returncode == 0, p.stderr
                doc = json.loads(p.stdout)
                assert sorted(int(r) for r in doc["methods"]) == [0, 1, 2], doc["methods"]
                assert {m["host"] for m in doc["methods"].values()} == {"node1", "node2", "node3"}
                assert len(doc["files"]) == 3 and all(Path(f).is_file() for f in doc["files"])
                if len(doc["groups"]) == 1 and in_main((doc["groups"][0]["frames"] or [{}])[0]):
                    break
            assert len(doc["groups"]) == 1, doc["groups"]
            if method == "signal":
                assert {m["method"] for m in doc["methods"].values()} == {"signal"}
            answers[method] = doc["groups"][0]["frames"][0]
        # the same answer either way: the rank's innermost frame is main's sleep (ddp_train.py)
        for frame in answers.values():
            assert (frame["func"], Path(frame["file"]).name) == ("main", "ddp_train.py"), answers
        assert answers["auto"]["line"] == answers["signal"]["line"], answers
        human = one_group_stacks(lambda: _cli("stacks", run_id), "0-2")
        assert "method: " in human and "raw dumps: " in human
    finally:
        _cli("stop", run_id)
    assert no_leftovers_within(sandbox_cluster, 10) == CLEAN
    assert controller_leftovers(run_id) == []  # no ssh of `stacks` (or of anything else) lingers here
    done = _cli("stacks", run_id)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"run {run_id} has no live rank" in done.stderr, done.stderr


def test_a_quiet_run_that_touches_its_progress_file_is_not_stopped(project: Path, first_run: object) -> None:
    p = launch(project / "cluster.yaml", "--hang-timeout", "8", "--", "ddp_train.py", "--steps", "4",
               "--quiet-step", "1", "--quiet-for", "20")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "HUNG" not in p.stderr and "every host exited 0" in p.stderr


# What PyTorch does when a collective times out with the flight recorder on: each rank writes
# its trace to $TORCH_FR_DUMP_TEMP_FILE<rank>. Written here by hand: gloo has no flight recorder,
# and a real NCCL timeout needs GPUs (untested live; see tests/unit/node/test_flight_recorder.py).
FLIGHT_RANK = """\
import os, sys, time
rank = os.environ["RANK"]
with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + rank, "w") as f:
    # torch 2.13 on the nodes: only the TORCH_FR_* names are set (2.8 and later read them)
    old = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "unset")
    f.write("trace of rank " + rank + " size " + os.environ["TORCH_FR_BUFFER_SIZE"] + " old " + old)
time.sleep(2)
if rank == "1":
    sys.exit(3)
time.sleep(300)
"""


def test_a_failed_runs_flight_recorder_dumps_are_collected(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object, tmp_path: Path
) -> None:
    spec = variant_spec(project, tmp_path / "flight.yaml", extra="launch: {flight_recorder: true}\n")
    # torchrun --no-python: the ranks run python3 -c (nothing to add to the synced workdir)
    p = launch(spec, "--", "--no-python", "python3", "-c", FLIGHT_RANK)
    assert p.returncode == 1, p.stderr[-3000:]  # torchrun exits 1 when a worker fails
    m = re.search(r"NCCL flight recorder dumps \(3 from ([^)]*)\): (\S+)", p.stderr)
    assert m, p.stderr[-3000:]
    assert sorted(m.group(1).split(", ")) == ["node1", "node2", "node3"]
    got = {f.parent.name + "/" + f.name: f.read_text() for f in Path(m.group(2)).glob("*/*")}
    assert got == {f"node{r + 1}/rank_{r}": f"trace of rank {r} size 2000 old unset" for r in range(3)}, got
    assert no_leftovers_within(sandbox_cluster, 10) == CLEAN
