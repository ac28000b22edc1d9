"""`nodeops stop` over ssh: what it takes from the supervisor's verdict, and the chief-side wait."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from nodeops.backends.ssh import run as ssh_run


def verdict(**hosts: dict[str, object]) -> dict[str, object]:
    return {"outcome": "stopped", "stop_confirmed": True, "hosts": hosts}


def test_only_hosts_whose_guard_confirmed_nothing_left_skip_the_kill_round() -> None:
    got = ssh_run.confirmed_stopped(verdict(
        node1={"ended": "killed", "left": 0, "lost": ""},
        node2={"ended": "0", "left": 0, "lost": ""},  # its job had exited 0; the stop found nothing
        node3={"ended": "killed", "left": 2, "lost": ""},  # processes survived: kill.sh goes there
        node4={"ended": "lost", "left": None, "lost": "ssh: connection closed"},
        node5={"ended": "killed", "left": None, "lost": ""},  # no confirmation came
        node6={"ended": None, "left": None, "lost": ""},
        node7="not a host record",  # type: ignore[arg-type]
    ))  # fmt: skip
    assert got == {"node1": "killed", "node2": "exited 0"}
    assert ssh_run.confirmed_stopped({"outcome": "stopped"}) == {}
    # only the supervisor's own stop confirms: not a carried-over verdict, a failure, or none
    one = {"node1": {"ended": "killed", "left": 0, "lost": ""}}
    assert ssh_run.confirmed_stopped({"outcome": "stopped", "stop_confirmed": False, "hosts": one}) == {}
    assert ssh_run.confirmed_stopped({"outcome": "failed", "stop_confirmed": True, "hosts": one}) == {}
    assert ssh_run.confirmed_stopped(None) == {}


def test_the_chief_side_wait_looks_once_without_sleeping_then_prints_the_file_once_it_is_there(tmp_path: Path) -> None:
    f = tmp_path / "dir with space" / "result.json"
    f.parent.mkdir()
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", ssh_run.cat_when_there(str(f), 0)], capture_output=True, text=True, check=False)
    assert (p.returncode, p.stdout) == (0, "")
    assert time.monotonic() - t0 < 3
    script = ssh_run.cat_when_there(str(f), 0)
    assert script.index("exit 0") < script.index("sleep")  # the only look ends before any sleep

    t0 = time.monotonic()
    threading.Timer(0.3, lambda: f.write_text('{"outcome": "stopped"}')).start()
    p = subprocess.run(["bash", "-c", ssh_run.cat_when_there(str(f), 5)], capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    assert (p.returncode, p.stdout) == (0, '{"outcome": "stopped"}')
    assert 0.25 < took < 3

    f.unlink()
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", ssh_run.cat_when_there(str(f), 0.3)], capture_output=True, text=True, check=False)
    assert (p.returncode, p.stdout) == (0, "")
    assert 0.25 < time.monotonic() - t0 < 3  # it waited its time, then gave up
