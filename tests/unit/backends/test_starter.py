"""Run-dir files and the ssh bundle that starts a job (run here with bash, no ssh)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeops.backends import starter
from nodeops.launch import launchers
from nodeops.node import protocol as P
from nodeops.node import stacks as S
from nodeops.spec.load import load_spec_text
from nodeops.spec.model import LoadedSpec

SPEC = """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0]}
  - {address: 10.0.0.2, cpus: [0]}
python: {venv: ~/.venvs/t}
"""


def files_for(spec_text: str, argv: list[str]) -> tuple[LoadedSpec, dict[str, list[starter.RunFile]]]:
    loaded = load_spec_text(spec_text)
    plan = launchers.plan(loaded.spec, argv, "20261122-101500-ab12", shim_path="@@HOME@@/shim")
    watch = {"run_id": "r", "hosts": [{"name": h.host} for h in plan], "pdsh": False}
    return loaded, starter.host_files(loaded, plan, "20261122-101500-ab12", watch)


def test_shell_quote_expands_only_the_home_token() -> None:
    assert starter.shell_quote("@@HOME@@/a b") == "\"$HOME\"'/a b'"
    assert starter.shell_quote("$(x)") == "'$(x)'"
    assert starter.shell_quote("") == "''"
    out = subprocess.run(["bash", "-c", "echo " + starter.shell_quote("@@HOME@@/x y")], env={"HOME": "/h"},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out == "/h/x y\n"


def test_every_host_gets_its_agent_and_only_the_chief_the_supervisor() -> None:
    _, files = files_for(SPEC, ["train.py"])
    names = {h: [f.name for f in fs] for h, fs in files.items()}
    common = {"follow.sh", "kill.sh", "status.sh", "job.sh", "start.sh", "hook/sitecustomize.py", *starter.SHIPPED}
    assert set(names["10.0.0.1"]) == common | {"supervisor.py", "stall.py", "run.json"}
    assert set(names["10.0.0.2"]) == common
    # the ranks' hook is shipped as stacks.py would write it (start.sh then runs no python3 for it)
    assert next(f for f in files["10.0.0.2"] if f.name == "hook/sitecustomize.py").content == S.HOOK
    job = next(f for f in files["10.0.0.2"] if f.name == "job.sh").content
    assert "export NODE_RANK=1" in job
    assert 'export NODEOPS_RUN_DIR="$HOME"/.nodeops/runs/20261122-101500-ab12' in job
    assert 'source "$HOME"/.venvs/t/bin/activate' in job


def shipped_with_start(run_id: str) -> list[starter.RunFile]:
    """A non-chief host's start.sh, the ranks' hook and the agent's files, as launch ships them."""
    loaded = load_spec_text(SPEC)
    plan = launchers.plan(loaded.spec, ["x"], run_id)
    return [f for f in starter.host_files(loaded, plan, run_id, {"hosts": []})["10.0.0.2"]
            if f.name in ("start.sh", "hook/sitecustomize.py", *starter.SHIPPED)]  # fmt: skip


def test_bundle_writes_the_files_and_starts_the_job_in_its_own_group(tmp_path: Path) -> None:
    """The bundle that ssh pipes to `bash -s`, run locally with HOME pointing to a temp dir."""
    job = "#!/usr/bin/env bash\necho hello from $NODEOPS_TEST\nexit 3\n"
    files = [starter.RunFile("job.sh", job, "0700"), starter.RunFile("shim.sh", 'exec "$@"\n', "0755")]
    script = starter.bundle("20261122-101500-ab12", [*files, *shipped_with_start("20261122-101500-ab12")])
    p = subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True, timeout=30, check=False,
                       env={**os.environ, "HOME": str(tmp_path), "NODEOPS_TEST": "t1"})  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert P.STARTED in p.stdout
    d = tmp_path / ".nodeops" / "runs" / "20261122-101500-ab12"
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    modes = {str(f.relative_to(d)): oct(f.stat().st_mode & 0o777) for f in d.rglob("*")
             if f.name in ("job.sh", "shim.sh", "agent.py", "hook", "sitecustomize.py")}  # fmt: skip
    assert modes == {"job.sh": "0o700", "shim.sh": "0o755", "agent.py": "0o600", "hook": "0o700",
                     "hook/sitecustomize.py": "0o600"}, modes  # (under umask 077)  # fmt: skip
    assert (d / "hook" / "sitecustomize.py").read_text() == S.HOOK
    deadline = time.monotonic() + 10
    while not (d / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (d / "exit_code").read_text().strip() == "3"
    assert (d / "host.log").read_text() == "hello from t1\n"
    assert int((d / "pgid").read_text()) > 1
    # run twice: the job is not started again
    again = subprocess.run(["bash", str(d / "start.sh")], capture_output=True, text=True, check=True,
                           env={**os.environ, "HOME": str(tmp_path)})  # fmt: skip
    assert P.STARTED in again.stdout and (d / "host.log").read_text() == "hello from t1\n"


def test_start_says_at_once_when_the_agent_fails_before_the_job_starts(tmp_path: Path) -> None:
    """`agent.py host --detach` returns when the job started or its agent died: a start whose
    agent cannot write host.log (here a directory) fails in well under start.sh's 15 s wait,
    naming the host and agent.log, and nothing of the run is left."""
    rid = "20261122-101500-ab13"
    shipped = shipped_with_start(rid)
    d = tmp_path / ".nodeops" / "runs" / rid
    (d / "host.log").mkdir(parents=True)
    script = starter.bundle(rid, [starter.RunFile("job.sh", "sleep 30\n", "0700"), *shipped])
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True, timeout=30, check=False,
                       env={**os.environ, "HOME": str(tmp_path)})  # fmt: skip
    took = time.monotonic() - t0
    assert p.returncode == 1 and P.STARTED not in p.stdout
    assert "the job on 10.0.0.2 did not start" in p.stderr and "agent.log" in p.stderr, p.stderr
    assert took < 5, took
    assert "IsADirectoryError" in (d / "agent.log").read_text()
    assert not (d / "pgid").exists()
    assert not S.tagged_pids(rid)


SPARE_SPEC = """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0]}
  - {address: 10.0.0.2, cpus: [0]}
  - {address: 10.0.0.3, cpus: [0], spare: true}
python: {venv: ~/.venvs/t}
workdir: {path: WORKDIR}
launch: {restarts: 1}
"""
# the venv's python3, standing in: it says how it was called, then takes its time (an import)
FAKE_PYTHON = '#!/bin/bash\necho "$@" > "$HOME/warm-args"\necho "nice $(nice)" >> "$HOME/warm-args"\nexec sleep 60\n'


def test_a_spare_warms_its_env_once_and_its_preflight_ends_the_warm_up(tmp_path: Path) -> None:
    """A spare imports what every torchrun rank will (starter.WARM_MODULES) once at launch, at low
    priority, as a process of the run (a stop ends it); the spare's preflight ends it first."""
    work = tmp_path / "work"
    work.mkdir()
    _, files = files_for(SPARE_SPEC.replace("WORKDIR", str(work)), ["train.py"])
    spare = next(h for h, fs in files.items() if any(f.name == P.SPARE_JOB for f in fs))
    assert not any(f.name == P.SPARE_JOB for h, fs in files.items() if h != spare for f in fs)
    fake_bin, venv = tmp_path / "fake-bin", tmp_path / ".venvs" / "t" / "bin"
    for d in (fake_bin, venv):
        d.mkdir(parents=True)
    (fake_bin / "python3").write_text(FAKE_PYTHON)
    (fake_bin / "python3").chmod(0o755)
    (venv / "activate").write_text(f'PATH="{fake_bin}:$PATH"\n')
    env = {**os.environ, "HOME": str(tmp_path)}
    p = subprocess.run(["bash", "-s"], input=starter.bundle("20261122-101500-ab12", files[spare]), env=env,
                       capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert p.returncode == 0 and P.STARTED in p.stdout, p.stderr
    d = tmp_path / ".nodeops" / "runs" / "20261122-101500-ab12"
    deadline = time.monotonic() + 10

    def said_so_far() -> str:  # the fake writes its arguments, then its nice level: both lines
        return (tmp_path / "warm-args").read_text() if (tmp_path / "warm-args").exists() else ""

    while "\nnice " not in said_so_far() and time.monotonic() < deadline:
        time.sleep(0.05)
    said = said_so_far()  # (the program has lines of its own)
    assert said.startswith("-c import importlib") and said.endswith(f" {' '.join(starter.WARM_MODULES)}\nnice 19\n")
    tag = f"{P.TAG_VAR}=20261122-101500-ab12"
    warm = [pid for pid in os.listdir("/proc") if pid.isdigit() and _environ_has(pid, tag)]
    assert warm, "the warm-up does not carry the run's tag"
    # start.sh again (safe to run twice) does not warm again; the preflight ends the warm-up
    subprocess.run(["bash", str(d / "start.sh")], env=env, capture_output=True, check=True)
    pre = subprocess.run([sys.executable, str(d / "agent.py"), "preflight"], env=env, capture_output=True,
                         text=True, timeout=30, check=False)  # fmt: skip
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _environ_has(pid, tag)]
    assert "still alive" not in pre.stdout, pre.stdout


def _environ_has(pid: str, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def follow_script(tmp_path: Path) -> Path:
    _, files = files_for(SPEC, ["train.py"])
    (f,) = [f for f in files["10.0.0.1"] if f.name == "follow.sh"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "follow.sh").write_text(f.content)
    (run / P.LOG).write_text("first line\n")
    (run / P.PGID).write_text("1")
    return run


def fake_agent(run: Path, seconds: float) -> subprocess.Popen[bytes]:
    """A process named like the host agent that writes agent.pid and lives ``seconds``."""
    code = f"import os, time; open('agent.pid', 'w').write(str(os.getpid())); time.sleep({seconds})"
    p = subprocess.Popen([sys.executable, "-c", code, "agent.py"], cwd=run)
    while not (run / P.AGENT_PID).exists():
        time.sleep(0.02)
    return p


def children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def family(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on."""
    return [p for kid in children(pid) for p in (kid, *family(kid))]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(pid: int) -> list[str]:
    """The command lines of ``pid``'s children, theirs, and so on."""
    return [cmdline(p) for p in family(pid)]


def zombie(pid: int) -> bool:
    """Ended (a zombie, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.fixture(params=["pidfd", "no pidfd"])
def follow_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """follow.sh's waiter sleeps on the agent's pidfd through python3; where python3 has none (Linux
    < 5.3, Python < 3.9: a python3 that exits 3 here) it looks every 0.2 s with bash builtins."""
    if request.param == "pidfd":
        return dict(os.environ)
    fake = tmp_path / "no-pidfd"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 3\n")
    (fake / "python3").chmod(0o755)
    return dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")


def test_follow_streams_the_log_and_ends_with_the_job_never_later(tmp_path: Path, follow_env: dict[str, str]) -> None:
    run = follow_script(tmp_path)
    agent = fake_agent(run, 30)  # an agent that lingers: exit_code ends the stream anyway
    try:
        follow = subprocess.Popen(["bash", str(run / "follow.sh")], stdout=subprocess.PIPE, text=True, env=follow_env)
        want = 0 if "no-pidfd" in follow_env["PATH"] else 1
        time.sleep(0.5)
        waiters = [c for c in descendants(follow.pid) if "pidfd_open" in c]
        deadline = time.monotonic() + 10  # a loaded machine may take longer than 0.5 s to start it
        while len(waiters) < want and time.monotonic() < deadline:
            time.sleep(0.1)
            waiters = [c for c in descendants(follow.pid) if "pidfd_open" in c]
        assert len(waiters) == want, waiters
        with (run / P.LOG).open("a") as f:
            f.write("second line, no newline")
        time.sleep(0.3)
        t0 = time.monotonic()
        (run / P.EXIT).write_text("0")
        out, _ = follow.communicate(timeout=10)
        assert time.monotonic() - t0 < 8  # not the agent's 30 s
        assert out == f"first line\nsecond line, no newline\n{P.EXIT_MARK}0\n"
    finally:
        agent.kill()
        agent.wait()


def test_follow_ends_when_the_agent_dies_or_is_not_the_agent(tmp_path: Path, follow_env: dict[str, str]) -> None:
    run = follow_script(tmp_path)
    agent = fake_agent(run, 1)
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(run / "follow.sh")], capture_output=True, text=True, timeout=10, env=follow_env
    ).stdout
    agent.wait()
    assert out == f"first line\n{P.EXIT_MARK}killed\n"  # no exit_code: it did not end by itself
    assert 0.5 < time.monotonic() - t0 < 5
    # a pid that is not the agent's (reused by another process): the log once, at once
    other = subprocess.Popen(["sleep", "30"])
    try:
        (run / P.AGENT_PID).write_text(str(other.pid))
        t0 = time.monotonic()
        out = subprocess.run(
            ["bash", str(run / "follow.sh")], capture_output=True, text=True, timeout=10, env=follow_env
        ).stdout
        assert out == f"first line\n{P.EXIT_MARK}killed\n"
        assert time.monotonic() - t0 < 8  # not the agent's 30 s
    finally:
        other.kill()
        other.wait()


def test_follow_ends_when_its_reader_is_gone_though_the_job_goes_on(tmp_path: Path) -> None:
    """An interrupted `nodeops logs -f`: ssh closes the stream's reader. tail sees it and ends, and
    follow.sh with it (coreutils >= 8.28); the waiter sees it too (an error on its fd 4) and does
    not linger until the job ends, as it did while it looked every 0.2 s."""
    run = follow_script(tmp_path)
    agent = fake_agent(run, 30)
    try:
        follow = subprocess.Popen(["bash", str(run / "follow.sh")], stdout=subprocess.PIPE)
        assert follow.stdout is not None
        assert follow.stdout.readline() == b"first line\n"
        deadline = time.monotonic() + 5
        while not [c for c in descendants(follow.pid) if c.startswith("tail ")]:  # the waiter is started first
            assert time.monotonic() < deadline, descendants(follow.pid)
            time.sleep(0.05)
        left = family(follow.pid)
        follow.stdout.close()
        t0 = time.monotonic()
        follow.wait(timeout=10)
        assert time.monotonic() - t0 < 5  # not the agent's 30 s
        deadline = time.monotonic() + 5
        while alive := [p for p in left if not zombie(p)]:
            assert time.monotonic() < deadline, f"follow.sh's children outlived it: {alive}"
            time.sleep(0.05)
        assert agent.poll() is None  # the job's side is untouched
    finally:
        agent.kill()
        agent.wait()


def test_follow_and_its_waiter_end_when_tail_is_killed(tmp_path: Path) -> None:
    """A tail killed (by an operator, the OOM killer): follow.sh prints its mark and ends, and the
    waiter, which holds the stream too, ends with it rather than with the job."""
    run = follow_script(tmp_path)
    agent = fake_agent(run, 30)
    try:
        follow = subprocess.Popen(["bash", str(run / "follow.sh")], stdout=subprocess.PIPE)
        deadline = time.monotonic() + 5
        while not (tails := [k for k in children(follow.pid) if cmdline(k).startswith("tail ")]):
            assert time.monotonic() < deadline, descendants(follow.pid)
            time.sleep(0.05)
        waiters = [p for p in family(follow.pid) if p != tails[0]]
        os.kill(tails[0], 9)
        out, _ = follow.communicate(timeout=5)  # EOF: nothing holds the stream any more
        assert out.endswith(f"{P.EXIT_MARK}killed\n".encode())
        deadline = time.monotonic() + 5
        while alive := [p for p in waiters if not zombie(p)]:
            assert time.monotonic() < deadline, f"the waiter outlived follow.sh: {alive}"
            time.sleep(0.05)
        assert agent.poll() is None
    finally:
        agent.kill()
        agent.wait()
