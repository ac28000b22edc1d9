"""`nodeops runs` / `nodeops clean`: the pure parts (durations, which runs are chosen, the exit
code a verdict stands for, playbook artifact dirs). The ssh parts run in
tests/integration/test_launch.py against the sandbox."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodeops import transport
from nodeops.backends import store
from nodeops.backends.slurm import job as slurm
from nodeops.backends.ssh import backend as ssh_backend
from nodeops.backends.ssh import run as ssh_run
from nodeops.lifecycle import runs as R
from nodeops.node import failures


def run(run_id: str, state: str, started: float) -> R.Run:
    return R.Run(store.Job(run_id=run_id, dir=Path("/nonexistent"), hosts=["h1"], argv=["t.py"], runner="torchrun",
                          started=started), state=state, verdict=state in ("ok", "failed", "stopped"))  # fmt: skip


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800),
                                               ("2w", 1209600), ("1.5h", 5400)])  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert R.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["7", "d", "-1d", "7 days", "1y", ""])
def test_bad_durations_are_usage_errors(text: str) -> None:
    with pytest.raises(R.UsageError, match="give a number and a unit"):
        R.parse_duration(text)


def test_choose_never_picks_a_running_or_unknown_run_and_honours_keep_and_age() -> None:
    now = 1_000_000.0
    runs = [run("r5", "running", now - 10), run("r4", "ok", now - 100), run("r3", "failed", now - 4000),
            run("r2", "unreachable", now - 5000), run("r1", "stopped", now - 90000),
            run("r0", "gone", now - 99999)]  # fmt: skip
    ids = lambda rs: [r.job.run_id for r in rs]  # noqa: E731
    assert ids(R.choose(runs, older_than=None, keep=None, now=now)) == ["r4", "r3", "r1", "r0"]
    assert ids(R.choose(runs, older_than=None, keep=2, now=now)) == ["r3", "r1", "r0"]  # r5 (running) counts
    assert ids(R.choose(runs, older_than=3600, keep=None, now=now)) == ["r3", "r1", "r0"]
    assert ids(R.choose(runs, older_than=86400, keep=3, now=now)) == ["r1", "r0"]
    assert ids(R.choose(runs, older_than=None, keep=0, now=now, states=("unreachable",))) == ["r2"]
    # no verdict (a launch still starting looks like this to the chief): never while young
    young = [run("g1", "gone", now - 30), run("g0", "gone", now - R.INFERRED_MIN_AGE - 1)]
    assert ids(R.choose(young, older_than=None, keep=None, now=now)) == ["g0"]


@pytest.mark.parametrize(
    ("verdict", "code"),
    [({"outcome": "ok"}, 0), ({"outcome": "stopped"}, 130), ({"outcome": "error"}, None),
     ({"outcome": "failed", "first_failure": {"host": "n3", "code": 3}}, 3),
     ({"outcome": "failed", "first_failure": {"host": "n3", "code": 2}}, 1),  # 2 is nodeops' own
     ({"outcome": "failed", "first_failure": {"host": "n3", "code": None}}, 1)],
)  # fmt: skip
def test_exit_code_of_a_verdict_is_what_launch_gives(verdict: dict[str, object], code: int | None) -> None:
    assert store.supervisor_verdict(verdict).exit_code == code


def test_one_exit_code_rule_for_every_backend() -> None:
    """ssh's follower, the supervisor's verdict and Slurm's poll give a failure's code through
    the same rule: a rank's own code, except 2 and 130 (nodeops' own) and impossible codes."""
    for raw, want in ((3, 3), (2, 1), (130, 1), (255, 255), (256, 1), (-9, 1), (None, 1)):
        assert failures.exit_code_for("failed", raw) == want
        assert (
            store.supervisor_verdict({"outcome": "failed", "first_failure": {"host": "h", "code": raw}}).exit_code
            == want
        )
        host = failures.HostState("h", exit_code=raw if isinstance(raw, int) else -1)
        if isinstance(raw, int) and raw > 0:
            assert ssh_run.JobResult("r", {"h": host}, host, False, None).exit_code == want
        if isinstance(raw, int) and 0 <= raw < 256:
            poll = slurm.Poll("FAILED", "", f"{raw}:0", "n1")
            assert slurm.exit_code(poll) == want
    assert failures.exit_code_for("ok") == 0 and failures.exit_code_for("stopped") == 130
    assert slurm.exit_code(slurm.Poll("CANCELLED", "", "0:15", "n1")) == 130
    assert slurm.exit_code(slurm.Poll("COMPLETED", "", "0:0", "n1")) == 0
    assert ssh_run.JobResult("r", {}, None, True, None).exit_code == 130


def test_records_of_earlier_releases_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm run's record from before the handle (slurm_* fields) and an ssh run's result.json
    in the old {"supervisor": ...} shape still load; the new shape round-trips."""
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path))
    d = store.jobs_dir() / "20261101-101500-ab12"
    d.mkdir()
    (d / "job.json").write_text(json.dumps({
        "run_id": d.name, "hosts": ["login"], "argv": ["t.py"], "runner": "torchrun", "chief": "login",
        "backend": "slurm", "slurm_job": "4242", "slurm_login": "login", "slurm_state": "COMPLETED"}))  # fmt: skip
    job = store.find(d.name)
    assert job.handle == {"job_id": "4242", "login": "login", "state": "COMPLETED"}
    job.with_handle(state="FAILED").save()
    again = store.find(d.name)
    assert again.handle["state"] == "FAILED" and "slurm_job" not in json.loads((d / "job.json").read_text())
    supervisor = {"outcome": "failed", "teardown_seconds": 1.5, "first_failure": {"host": "n1", "code": 3, "why": "x"}}
    (d / "result.json").write_text(
        json.dumps({"hosts": {"n1": {"exit_code": 3, "lost": ""}}, "supervisor": supervisor})
    )
    old = store.read_verdict(d)
    assert old is not None and (old.outcome, old.exit_code, old.hosts["n1"]["exit_code"]) == ("failed", 3, 3)
    assert old.detail.startswith("failed: first failure on n1 (x)")
    old.save(d)
    assert store.read_verdict(d) == old and json.loads((d / "result.json").read_text())["version"] == 2
    (d / "result.json").write_text('{"slurm": {"state": "COMPLETED", "exit": "0:0", "result": null}}')
    assert store.read_verdict(d) is None  # never read back then either: Slurm is asked
    (d / "result.json").write_text("not json")
    assert store.read_verdict(d) is None
    for damaged in ({"version": 2, "outcome": None, "detail": "x", "exit_code": 1},
                    {"version": 2, "outcome": "ok", "detail": "x", "exit_code": "0"},
                    {"supervisor": {"outcome": "failed", "first_failure": {"code": 3}}},
                    {"supervisor": {"outcome": "failed", "first_failure": "node1"}}):  # fmt: skip
        (d / "result.json").write_text(json.dumps(damaged))
        assert store.read_verdict(d) is None, damaged  # `runs` asks the chief instead of crashing
    (d / "job.json").write_text(json.dumps({**json.loads((d / "job.json").read_text()), "handle": ["4242"]}))
    with pytest.raises(store.JobError, match="its handle is not a mapping"):
        store.find(d.name)


def test_artifact_dirs_running_while_their_nodeops_lives(tmp_path: Path) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() - 7200))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name, pid in (("setup", alive.pid), ("check", 2**22 + 7)):  # the second pid is never a live one
            d = tmp_path / f"{name}-{stamp}-abcdef"
            d.mkdir()
            (d / "nodeops.pid").write_text(f"{pid}\n")
        (tmp_path / "not-ours").mkdir()
        found = {a.path.name.split("-")[0]: a for a in R.artifact_dirs(tmp_path)}
        assert set(found) == {"setup", "check"}
        assert found["setup"].running and not found["check"].running
        chosen = R.choose_artifacts(list(found.values()), older_than=3600, keep=None)
        assert [a.path.name.split("-")[0] for a in chosen] == ["check"]
        assert R.choose_artifacts(list(found.values()), older_than=3 * 3600, keep=None) == []
    finally:
        alive.kill()
        alive.wait()


def test_clean_without_a_criterion_is_usage_and_removes_nothing(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "nodeops", "clean"], capture_output=True, text=True, check=False,
                       env={**os.environ, "NODEOPS_HOME": str(tmp_path)})  # fmt: skip
    assert r.returncode == 2 and "--older-than AGE, --keep N or --all" in r.stderr, r.stderr
    bad = subprocess.run([sys.executable, "-m", "nodeops", "clean", "--older-than", "7 days"], capture_output=True,
                         text=True, check=False, env={**os.environ, "NODEOPS_HOME": str(tmp_path)})  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: --older-than"), bad.stderr


def test_runs_on_a_fresh_controller_says_there_are_none(tmp_path: Path) -> None:
    env = {**os.environ, "NODEOPS_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "nodeops", "runs"], capture_output=True, text=True, check=False, env=env)
    assert r.returncode == 0 and "no runs launched from this machine yet" in r.stderr
    j = subprocess.run([sys.executable, "-m", "nodeops", "runs", "--json"], capture_output=True, text=True,
                       check=False, env=env)  # fmt: skip
    assert j.returncode == 0 and j.stdout.strip() == "[]"


def test_the_remote_remove_script_spares_a_live_run_and_removes_the_rest(tmp_path: Path) -> None:
    """The script `clean` runs on each host, run here in a real bash: a run with a live tagged
    process (even with no agent.py to ask) is kept; a finished one and a symlinked one go, and
    what the symlink points to stays."""
    from nodeops.node import protocol as P

    runs = tmp_path / P.RUNS_DIR
    runs.mkdir(parents=True)
    live, done, linked, absent = (f"20261122-0000{i}0-ab1{i}" for i in range(4))
    for rid in (live, done):
        (runs / rid).mkdir()
        (runs / rid / "host.log").write_text("x\n")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep\n")
    (runs / linked).symlink_to(outside)
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, "NODEOPS_RUN_ID": live})
    try:
        time.sleep(0.2)
        script = ssh_backend.in_home(R._REMOVE.replace("@RUNS@", P.RUNS_DIR))
        p = subprocess.run(["bash", "-c", script, "nodeops-clean", live, done, linked, absent], capture_output=True,
                           text=True, env={**os.environ, "HOME": str(tmp_path)}, timeout=30, check=False)  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    said = {ln.split()[1]: ln.split()[0] for ln in p.stdout.splitlines()}
    assert said == {live: "busy", done: "removed", linked: "removed", absent: "gone"}, p.stdout + p.stderr
    assert (runs / live).is_dir() and not (runs / done).exists() and not (runs / linked).is_symlink()
    assert (outside / "keep.txt").read_text() == "keep\n"


def test_damaged_records_are_skipped_not_fatal(tmp_path: Path) -> None:
    home = tmp_path / "home"
    jobs_dir = home / "jobs"
    for rid, body in (("20261122-000001-aaaa", "[]"), ("20261122-000002-bbbb", '{"run_id": "20261122-000002-bbbb"}'),
                      ("20261122-000003-cccc", json.dumps({"run_id": "20261122-000009-ffff", "hosts": ["h"],
                                                           "argv": [], "runner": "torchrun"}))):  # fmt: skip
        (jobs_dir / rid).mkdir(parents=True)
        (jobs_dir / rid / "job.json").write_text(body)
    r = subprocess.run([sys.executable, "-m", "nodeops", "runs", "--json"], capture_output=True, text=True,
                       check=False, env={**os.environ, "NODEOPS_HOME": str(home)})  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr


def test_the_chief_probe_says_verdict_gone_running_or_ended(tmp_path: Path) -> None:
    """The script `runs` sends to a chief, run here in a real bash with HOME at a temp dir."""
    from nodeops.node import protocol as P
    from nodeops.quoting import sh_word

    runs = tmp_path / P.RUNS_DIR
    ids = {k: f"20261122-00000{i}-cd0{i}" for i, k in enumerate(("verdict", "gone", "running", "ended"))}
    for k in ("verdict", "running", "ended"):
        (runs / ids[k]).mkdir(parents=True)
    (runs / ids["verdict"] / "result.json").write_text('{"outcome": "ok"}')
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, "NODEOPS_RUN_ID": ids["running"]})
    try:
        time.sleep(0.2)
        said = {}
        for k, rid in ids.items():
            script = ssh_backend._PROBE.replace("@ID@", sh_word(rid)).replace("@DIR@", sh_word(f"{P.RUNS_DIR}/{rid}"))
            p = subprocess.run(["bash", "-c", ssh_backend.in_home(script)], capture_output=True, text=True, timeout=30,
                               env={**os.environ, "HOME": str(tmp_path)}, check=False)  # fmt: skip
            said[k] = p.stdout.splitlines()[0] if p.stdout else p.stderr
    finally:
        proc.kill()
        proc.wait()
    assert said == {"verdict": "verdict", "gone": "gone", "running": "running", "ended": "ended"}


def test_runs_of_a_cluster_that_is_gone_cost_one_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records pile up of clusters since torn down: `stop` and `runs` ask each run's chief, and
    each ask waited for ssh's connection to fail (600 records: 10 rounds of 64). Now the newest
    run of each place is asked first, and where ssh's own words say it never reached the place,
    the place's other runs take that answer. Real ssh (counted by a wrapper on PATH): places a
    and b refuse the connection (a closed port); place c accepts it and closes it at once, which
    is not "never reached", so each of its runs is asked. Without the shortcut (`clean`), every
    run is asked."""
    ssh = shutil.which("ssh")
    if ssh is None:
        pytest.skip("no ssh client here")
    monkeypatch.setenv("NODEOPS_HOME", str(tmp_path / "home"))
    log = tmp_path / "ssh.log"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ssh").write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {ssh} "$@"\n')
    (tmp_path / "bin" / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    closed = [socket.socket(), socket.socket()]  # bound, never listening: connections are refused
    for sock in closed:
        sock.bind(("127.0.0.1", 0))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            conn.close()  # ssh: "Connection closed by remote host", exit 255: it was reached

    threading.Thread(target=serve, daemon=True).start()
    ports = {"a": closed[0].getsockname()[1], "b": closed[1].getsockname()[1], "c": srv.getsockname()[1]}
    ids: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    for i, place in enumerate("aaaaabbccc"):
        run_id = f"20261101-1015{i:02d}-ab{i:02d}"
        d = store.jobs_dir() / run_id
        d.mkdir()
        job = store.Job(run_id=run_id, dir=d, hosts=["node1"], argv=["t.py"], runner="torchrun", chief="node1",
                        started=time.time() - 100 + i)  # fmt: skip
        job.save()
        (d / "ssh_config").write_text(
            f"# the run record {run_id}\nHost node1\n    HostName 127.0.0.1\n    Port {ports[place]}\n"
            f"    BatchMode yes\n    UserKnownHostsFile {tmp_path / 'kh'}\n    StrictHostKeyChecking yes\n"
        )
        ids[place].append(run_id)

    def asked() -> dict[str, int]:
        said = log.read_text() if log.exists() else ""
        log.unlink(missing_ok=True)
        lines = said.splitlines()
        return {place: sum(1 for run_id in run_ids for ln in lines if f"/{run_id}/ssh_config" in ln)
                for place, run_ids in ids.items()}  # fmt: skip

    found = R.local_runs()
    assert len(found) == 10
    R.refresh(found, connect_timeout=3, shortcut=True)
    assert asked() == {"a": 1, "b": 1, "c": 3}
    by_id = {r.job.run_id: r for r in found}
    for place in "ab":
        newest, *rest = sorted(ids[place], reverse=True)  # the newest of each place was asked
        assert by_id[newest].state == "unreachable" and not by_id[newest].reached
        assert "Connection refused" in by_id[newest].detail and "not asked" not in by_id[newest].detail
        for run_id in rest:
            r = by_id[run_id]
            assert r.state == "unreachable" and not r.reached, (place, r)
            assert r.detail == f"{by_id[newest].detail} (not asked: ssh did not reach it for run {newest})"
    for run_id in ids["c"]:  # reached, and each asked: its own answer
        assert by_id[run_id].reached and "not asked" not in by_id[run_id].detail, by_id[run_id]
    found = R.local_runs()
    R.refresh(found, connect_timeout=3)  # `clean`'s: no shortcut
    assert asked() == {"a": 5, "b": 2, "c": 3}
    for sock in [*closed, srv]:
        sock.close()


@pytest.mark.parametrize(
    ("stderr", "unreached"),
    [("ssh: connect to host 10.0.0.9 port 22: Connection refused", True),
     ("Connection to 10.214.0.11 port 22 timed out", True),  # ConnectTimeout, as ssh 9.2 says it
     ("Connection timed out during banner exchange\nConnection to 10.214.0.11 port 22 timed out", True),
     ("ssh: connect to host 10.0.0.9 port 22: No route to host", True),
     ("ssh: Could not resolve hostname gone-1: Name or service not known", True),
     ("debian@10.0.0.9: Permission denied (publickey).", False),  # it answered
     ("Host key verification failed.", False),
     ("kex_exchange_identification: read: Connection reset by peer", False),  # MaxStartups: one of many
     ("Timeout, server 10.0.0.9 not responding.", False)],  # ServerAlive: it was reached
)  # fmt: skip
def test_which_ssh_failures_say_the_place_was_never_reached(stderr: str, unreached: bool) -> None:
    assert transport.not_reached(stderr) is unreached
