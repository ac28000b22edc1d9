"""Automatic restarts (launch.restarts): the rules (recovery.py, pure), and the chief's supervisor
running them for real on this machine, as in test_supervisor.py: each "host" is a run dir with
its own agent and bash job (its own run id, so one host's process scans never reach another's),
started by the real start.sh; the supervisor restarts them through agent.py preflight/begin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest

from nodeops.backends import store
from nodeops.backends.starter import markers, role_dir
from nodeops.node import protocol as P
from nodeops.node import recovery as R

from .test_supervisor import nothing_outlives_the_test, ours, ship, wait_clean  # noqa: F401 (an autouse fixture)

CHIEF, H2, H3, SPARE = ({"name": n, "nproc": 1} for n in ("h1", "h2", "h3", "h4"))


# --------------------------------------------------------------------------- the rules
@pytest.mark.parametrize(("code", "kind"), [(1, "script"), ("1", "script"), (-9, "signal"), (137, "signal"),
                                            ("-6", "signal"), ("lost", "lost"), (None, "lost")])  # fmt: skip
def test_an_exit_code_says_signal_or_the_scripts_own_error(code: object, kind: str) -> None:
    assert R.kind_of_exit(code) == kind


@pytest.mark.parametrize(("code", "peer", "raised", "kind"), [
    ("1", False, False, "script"), ("-6", False, True, "script"), ("-6", False, False, "signal"),
    ("-9", True, True, "peer"), ("1", True, False, "peer"), ("", False, True, "script"), ("134", False, True, "script"),
])  # fmt: skip
def test_a_worker_that_died_of_a_signal_after_raising_is_the_scripts_error(code: str, peer: bool, raised: bool,
                                                                           kind: str) -> None:  # fmt: skip
    assert R.kind_of_worker(code, peer, raised) == kind


def test_infra_restarts_infrastructure_faults_only_and_any_restarts_all() -> None:
    for kind in R.INFRA:
        assert R.should_restart(kind, "infra", 1, 2) == (True, "")
    again, why = R.should_restart("script", "infra", 1, 2)
    assert not again and "script's own error" in why
    assert R.should_restart("script", "any", 2, 2) == (True, "")
    assert R.should_restart("script", "any", 3, 2) == (False, "no restart left (2 used)")
    assert R.should_restart("lost", "any", 1, 0) == (False, "")


def test_a_job_that_finished_its_work_is_never_run_again() -> None:
    again, why = R.should_restart("teardown", "any", 1, 2)
    assert not again and "every rank had finished its work" in why
    done = [(2, 2), (2, 2)]
    assert R.finished_then_crashed("signal", done) and R.finished_then_crashed("peer", done)
    assert not R.finished_then_crashed("lost", done)  # a lost host is no teardown crash
    assert not R.finished_then_crashed("signal", [(2, 2), (1, 2)])  # a rank still worked
    assert not R.finished_then_crashed("signal", [(2, 2), None])  # a host that did not say (mpirun's)
    assert not R.finished_then_crashed("signal", [(0, 0)])  # no rank with the hook: nothing is known


def test_the_same_failure_after_its_host_was_replaced_is_a_loop() -> None:
    sig = R.signature("signal", 1, -9, "torchrun reported a failed worker (exit code -9)")
    assert sig == R.signature("signal", 1, 137, "exited 137") == ["signal", 1, "signal 9", None]  # however reported
    hang = R.signature("hang", 2, None, "no progress for 41s; rank 2 stuck in fetch (t.py:3)")
    assert hang == R.signature("hang", 2, None, "no progress for 43s; rank 2 stuck in fetch (t.py:3)")
    first = {"attempt": 1, "culprit": "node2", "signature": sig, "excluded": ["node2"]}
    assert R.loop([], sig, "node2") == ""  # the first time
    said = R.loop([first], sig, "node4")
    assert said == ("the same failure twice (signal at node rank 1: signal 9; on node2 then node4): not a node "
                    "fault; not restarting (node2 excluded for it)")  # fmt: skip
    assert R.loop([first], sig, "node2") == ""  # the same host again (the chief, or not excluded): no swap was tried
    assert R.loop([first], R.signature("signal", 2, -9, ""), "node4") == ""  # another rank: another failure
    lost = R.signature("lost", 1, None, "its guard was lost")
    assert R.loop([{**first, "signature": lost}], lost, "node4") == ""  # a lost machine is the machine's fault
    assert R.loop([first], sig, None) == ""
    # the step its host last printed: the same failure at the same step is a loop, at another step not
    at5 = R.signature("signal", 1, -9, "", step=5)
    said = R.loop([{**first, "signature": at5}], R.signature("signal", 1, 137, "", step=5), "node4")
    assert said.startswith("the same failure twice (signal at node rank 1: signal 9 at step 5; on node2 then node4)")
    assert R.loop([{**first, "signature": at5}], R.signature("signal", 1, -9, "", step=9), "node4") == ""


def test_a_fault_on_the_timeline_and_the_runs_goodput() -> None:
    t0 = 1_800_000_000.0
    first = {"attempt": 1, "kind": "lost", "culprit": "node3", "preflight_done": t0 + 104.2,
             "times": {"began": t0, "ranks_up": t0 + 20, "last_progress": t0 + 100, "failed": t0 + 102.1,
                       "stop_sent": t0 + 102.2, "ended": t0 + 103.0}}  # fmt: skip
    second = {"attempt": 2, "started": t0 + 105.0, "times": {"began": t0 + 105.0, "ranks_up": t0 + 121.3,
                                                              "ended": t0 + 221.3}}  # fmt: skip
    line = R.incident(first, second)
    at = time.strftime("%H:%M:%S", time.localtime(t0 + 100))
    assert line == (f"attempt 1 -> 2: lost on node3 at {at}; detected +2.1 s; stopped +3.0 s; preflight +4.2 s; "
                    "started +5.0 s; training again +21.3 s")  # fmt: skip
    assert R.incident(second, None) == ""  # no fault
    g = R.goodput([first, second])
    # training: 20 -> 100 (the fault: the lost host's last progress) and 121.3 -> 221.3: 180 s of 221.3
    assert g == {"goodput": round(180 / 221.3, 4), "wall": 221.3, "training": 180.0, "startup": 20.0,
                 "faults": 3.0, "restarts": 18.3, "stalls": 0.0}  # fmt: skip
    assert R.goodput_line(g) == "goodput 81% of 221.3 s: lost 20.0 s to start-up, 3.0 s to faults, 18.3 s to restarts"
    # a stall the stall watch reported (30 s without progress, then training again) is time lost too
    stalled = R.goodput([first, second], [{"since": t0 + 150, "ended": t0 + 180}])
    assert stalled is not None and (stalled["training"], stalled["stalls"]) == (150.0, 30.0)
    assert R.goodput_line(stalled).endswith("18.3 s to restarts, 30.0 s to stalls")
    assert R.goodput([{"attempt": 1}]) is None  # an older release's record: no timeline


def test_a_spare_takes_the_culprits_node_rank() -> None:
    hosts, spare, said = R.next_hosts([CHIEF, H2, H3], [SPARE], "h2", True, 3)
    assert [h["name"] for h in hosts or []] == ["h1", "h4", "h3"] and spare is SPARE
    assert said == "h2 excluded; spare h4 takes its node rank 1"


def test_without_a_spare_the_run_shrinks_down_to_min_nodes_and_no_further() -> None:
    hosts, spare, said = R.next_hosts([CHIEF, H2, H3], [], "h3", True, 2)
    assert [h["name"] for h in hosts or []] == ["h1", "h2"] and spare is None
    assert "no spare left: going on with 2 node(s) (min_nodes 2)" in said
    hosts, _, said = R.next_hosts([CHIEF, H2], [], "h2", True, 2)
    assert hosts is None and "1 node(s) would be fewer than min_nodes 2" in said


def test_the_chief_and_a_scripts_error_exclude_nobody() -> None:
    hosts, _, said = R.next_hosts([CHIEF, H2], [SPARE], "h1", True, 2)
    assert hosts == [CHIEF, H2] and "h1 is the chief, which cannot be excluded" in said
    hosts, spare, said = R.next_hosts([CHIEF, H2], [SPARE], "h2", False, 2)
    assert hosts == [CHIEF, H2] and spare is None and said == "on the same nodes"


def test_the_back_off_doubles_up_to_a_minute() -> None:
    assert [R.backoff(3, k) for k in (1, 2, 3, 6, 7)] == [3, 6, 12, 60, 60]
    assert R.backoff(0, 4) == 0


def test_attempt_env_gives_node_rank_world_size_and_restart_count() -> None:
    text = R.attempt_env([CHIEF, {"name": "h4", "nproc": 2}, H3], "h3", 1)
    env = dict(line.removeprefix("export ").split("=") for line in text.splitlines())
    assert env == {"NNODES": "3", "NODE_RANK": "2", "WORLD_SIZE": "4", "PET_NNODES": "3", "PET_NODE_RANK": "2",
                   "NODEOPS_RESTART_COUNT": "1", "NODEOPS_ATTEMPT": "2"}  # fmt: skip


def test_an_attempt_in_one_line() -> None:
    a = {"attempt": 1, "hosts": ["h1", "h2", "h3"], "outcome": "failed", "kind": "lost", "culprit": "h3",
         "why": "lost: ssh exited 255", "decision": "h3 excluded; spare h4 takes its node rank 2"}  # fmt: skip
    assert R.describe(a, 3) == ("attempt 1/3 on h1,h2,h3: failed (lost on h3: lost: ssh exited 255); h3 excluded; "
                                "spare h4 takes its node rank 2")  # fmt: skip
    assert R.describe({"attempt": 2, "hosts": ["h1"]}, 3) == "attempt 2/3 on h1: running"


# --------------------------------------------------------------------------- the supervisor
def make_run(tmp: Path, jobs: dict[str, str], spares: set[str], recovery: dict[str, object]) -> list[Path]:
    """Host dirs with the shipped files, the real start.sh, and each host's job (a spare's under
    its waiting name); run.json on the chief (the first)."""
    start = jinja2.Template((role_dir("templates") / "start.sh.j2").read_text(), keep_trailing_newline=True)
    dirs = []
    for i, (name, body) in enumerate(jobs.items()):
        # the run id found by tag in /proc: this worker's own (pytest-xdist runs tests side by side)
        d = tmp / name / f"20261124-{os.getpid() % 1_000_000:06d}-{i:04x}"
        d.mkdir(parents=True)
        ship(d)
        (d / "start.sh").write_text(start.render(run_id=d.name, host=name, **markers()))
        (d / (P.SPARE_JOB if name in spares else P.JOB)).write_text(body)
        dirs.append(d)
    hosts = [{"name": n, "local": True, "dir": str(d), "job": n not in spares, "spare": n in spares, "nproc": 1}
             for n, d in zip(jobs, dirs, strict=True)]  # fmt: skip
    (dirs[0] / P.RUN_CONFIG).write_text(json.dumps({"run_id": dirs[0].name, "agent_final": False, "pdsh": False,
                                                    "hosts": hosts, "recovery": recovery}))  # fmt: skip
    return dirs


def launch(dirs: list[Path], spares: set[str]) -> subprocess.Popen[bytes]:
    """What the controller does: start.sh on every host (spares start nothing), then the supervisor."""
    for d in dirs:
        p = subprocess.run(["bash", str(d / "start.sh")], capture_output=True, text=True, timeout=30, check=False)
        assert P.STARTED in p.stdout, p.stderr
    return subprocess.Popen([sys.executable, str(dirs[0] / "supervisor.py")], start_new_session=True)


def verdict(dirs: list[Path], sup: subprocess.Popen[bytes], timeout: float = 60) -> dict[str, object]:
    sup.wait(timeout=timeout)
    return dict(json.loads((dirs[0] / P.RESULT).read_text()))


READY = '[ "${1:-}" = --preflight ] && exit 0\n'  # job.sh --preflight, as the real one answers it
# A job that fails its first attempt the way `first` says and succeeds from the second on.
FLAKY = """[ "${{1:-}}" = --preflight ] && exit 0
. ./attempt.env 2>/dev/null
echo "attempt ${{NODEOPS_ATTEMPT:-1}} node rank ${{NODE_RANK:-?}} of ${{NNODES:-?}}"
if [ "${{NODEOPS_ATTEMPT:-1}}" = 1 ]; then {first}; fi
sleep 0.3
"""
STEADY = FLAKY.format(first="sleep 3")  # the others: alive until the supervisor stops them


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_the_spare_and_the_run_finishes(tmp_path: Path) -> None:
    jobs = {"h1": STEADY, "h2": FLAKY.format(first="sleep 0.5; kill -9 $$"), "h3": STEADY, "h4": STEADY}
    dirs = make_run(tmp_path, jobs, {"h4"}, {"restarts": 2, "restart_on": "infra", "min_nodes": 3, "backoff": 0.5})
    res = verdict(dirs, launch(dirs, {"h4"}))
    assert res["outcome"] == "ok", res
    first, second = res["attempts"]  # type: ignore[misc]
    assert (first["kind"], first["culprit"], first["excluded"]) == ("signal", "h2", ["h2"]), first
    assert first["decision"] == "h2 excluded; spare h4 takes its node rank 1" and first["backoff"] == 0.5
    assert (second["hosts"], second["outcome"]) == (["h1", "h4", "h3"], "ok")
    # the spare ran as node rank 1 of 3, and its log starts with the attempt's marker
    log = (dirs[3] / P.LOG).read_text().splitlines()
    assert log[0].startswith("==> nodeops: attempt 2/3 on h1,h4,h3 (node rank 1); after attempt 1: signal on h2")
    assert log[1] == "attempt 2 node rank 1 of 3"
    # the chief kept its first attempt's files under attempts/1/ and ran the second as rank 0
    assert (dirs[0] / P.ATTEMPTS_DIR / "1" / P.LOG).read_text().startswith("attempt 1 node rank ? of ?")
    assert "attempt 2 node rank 0 of 3" in (dirs[0] / P.LOG).read_text()
    assert not (dirs[1] / P.ATTEMPTS_DIR).exists() and (dirs[1] / P.EXIT).read_text().strip() == "137"
    assert json.loads((dirs[0] / P.ATTEMPTS).read_text())["done"] is True
    # the fault on the run's timeline: when it was reported, stopped, the spare ready and started
    incidents, good = store.timeline(res)
    assert len(incidents) == 1 and incidents[0].startswith("attempt 1 -> 2: signal on h2 at "), incidents
    assert all(f"; {m} +" in incidents[0] for m in ("stopped", "preflight", "started")), incidents
    assert "detected" not in incidents[0]  # a reported failure is detected when it happens
    assert good is not None and 0 <= good["goodput"] < 1 and good["faults"] >= 0, good
    assert wait_clean(dirs) == []


@pytest.mark.slow
def test_the_same_failure_on_the_spare_stops_the_restarts_and_names_the_host_excluded_for_it(tmp_path: Path) -> None:
    # whatever runs as node rank 1 dies of SIGKILL (a bad shard, a poisoned checkpoint): no node swap helps
    rank1 = READY + "sleep 0.3; kill -9 $$\n"
    others = READY + "exec sleep 30\n"
    jobs = {"h1": others, "h2": rank1, "h3": others, "h4": rank1, "h5": rank1}
    dirs = make_run(tmp_path, jobs, {"h4", "h5"}, {"restarts": 3, "restart_on": "infra", "min_nodes": 3, "backoff": 0})
    res = verdict(dirs, launch(dirs, {"h4", "h5"}))
    assert res["outcome"] == "failed", res
    first, second = res["attempts"]  # type: ignore[misc]
    assert (first["culprit"], first["excluded"], second["culprit"]) == ("h2", ["h2"], "h4"), res["attempts"]
    assert second["decision"] == (
        "no restart: the same failure twice (signal at node rank 1: signal 9; on h2 "
        "then h4): not a node fault; not restarting (h2 excluded for it)"
    ), second
    assert not (dirs[4] / P.JOB).exists()  # the second spare was never used
    assert wait_clean(dirs) == []


@pytest.mark.slow
def test_a_scripts_own_error_is_not_restarted_under_infra(tmp_path: Path) -> None:
    jobs = {"h1": STEADY, "h2": FLAKY.format(first="exit 1"), "h3": STEADY}
    dirs = make_run(tmp_path, jobs, {"h3"}, {"restarts": 2, "restart_on": "infra", "min_nodes": 2, "backoff": 0})
    res = verdict(dirs, launch(dirs, {"h3"}))
    assert res["outcome"] == "failed" and res["first_failure"]["host"] == "h2"  # type: ignore[index]
    (only,) = res["attempts"]  # type: ignore[misc]
    assert only["kind"] == "script" and only["decision"].startswith("no restart: the script's own error")
    assert not (dirs[2] / P.JOB).exists() and not (dirs[2] / P.PGID).exists()  # the spare never ran
    assert wait_clean(dirs) == []


@pytest.mark.slow
def test_restart_on_any_stops_after_the_last_restart_and_keeps_every_attempt(tmp_path: Path) -> None:
    always = READY + ". ./attempt.env 2>/dev/null; echo attempt ${NODEOPS_ATTEMPT:-1}; sleep 0.3; exit 3\n"
    dirs = make_run(tmp_path, {"h1": READY + "exec sleep 30\n", "h2": always}, set(),
                    {"restarts": 2, "restart_on": "any", "min_nodes": 2, "backoff": 0.2})  # fmt: skip
    res = verdict(dirs, launch(dirs, set()))
    assert res["outcome"] == "failed"
    attempts = res["attempts"]
    assert [a["outcome"] for a in attempts] == ["failed"] * 3  # type: ignore[union-attr]
    assert [a["culprit"] for a in attempts] == ["h2"] * 3  # type: ignore[union-attr]
    assert [a.get("excluded") for a in attempts[:2]] == [[], []]  # type: ignore[index]
    assert attempts[2]["decision"] == "no restart: no restart left (2 used)"  # type: ignore[index]
    assert [a.get("backoff") for a in attempts[:2]] == [0.2, 0.4]  # type: ignore[index]
    logs = [(dirs[1] / P.ATTEMPTS_DIR / n / P.LOG).read_text().splitlines()[-1] for n in ("1", "2")]
    assert logs == ["attempt 1", "attempt 2"] and (dirs[1] / P.LOG).read_text().splitlines()[-1] == "attempt 3"
    assert wait_clean(dirs) == []


@pytest.mark.slow
def test_a_stop_during_the_back_off_starts_nothing(tmp_path: Path) -> None:
    jobs = {"h1": STEADY, "h2": FLAKY.format(first="sleep 0.3; kill -9 $$"), "h3": STEADY}
    dirs = make_run(tmp_path, jobs, {"h3"}, {"restarts": 1, "restart_on": "infra", "min_nodes": 2, "backoff": 30})
    sup = launch(dirs, {"h3"})
    deadline = time.monotonic() + 30
    attempts = dirs[0] / P.ATTEMPTS
    while time.monotonic() < deadline and not (attempts.exists() and "backoff" in attempts.read_text()):
        time.sleep(0.1)
    (dirs[0] / P.STOP_REQUEST).touch()
    t0 = time.monotonic()
    res = verdict(dirs, sup, timeout=10)
    assert time.monotonic() - t0 < 5
    assert res["outcome"] == "stopped" and res["first_failure"] is None, res
    (only,) = res["attempts"]  # type: ignore[misc]
    assert only["decision"].endswith("; stopped during the back-off")
    assert not (dirs[2] / P.PGID).exists() and not (dirs[2] / P.ATTEMPT_ENV).exists()  # the spare: untouched
    assert not (dirs[0] / P.ATTEMPTS_DIR).exists()
    assert wait_clean(dirs) == [] and ours(dirs) == []


def test_the_first_attempt_gets_its_ranks_from_the_plan_and_a_spare_gets_none() -> None:
    """With restarts on, torchrun's node count and rank come from the env (PET_*), never argv, so
    a later attempt.env can change them; the first attempt's are in the plan's env."""
    from nodeops.launch import launchers
    from nodeops.spec.loading import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "recovery.happy.yaml").spec
    plan = {h.host: h for h in launchers.plan(spec, ["t.py"], "20261124-000000-ab12")}
    assert [(h, p.node_rank) for h, p in plan.items()] == [("10.0.0.1", 0), ("10.0.0.2", 1), ("10.0.0.3", 2),
                                                           ("10.0.0.4", -1)]  # fmt: skip
    for host, p in plan.items():
        assert "--nnodes" not in p.argv and "--node-rank" not in p.argv, p.argv
        if p.node_rank >= 0:
            assert {k: p.env[k] for k in ("NNODES", "NODE_RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK",
                                          "NODEOPS_RESTART_COUNT")} == {
                "NNODES": "3", "NODE_RANK": str(p.node_rank), "WORLD_SIZE": "3", "PET_NNODES": "3",
                "PET_NODE_RANK": str(p.node_rank), "NODEOPS_RESTART_COUNT": "0"}, host  # fmt: skip
        else:
            assert not {"NNODES", "NODE_RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK"} & set(p.env), p.env
