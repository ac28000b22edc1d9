"""The controller's own limits in a fan-out: open files (RLIMIT_NOFILE) and processes. The limits
are real: the fan-out cases run in a child Python whose hard limit is lowered first."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest

from nodeops.errors import ControllerLimitError
from nodeops.transport import FDS_PER_SSH, FDS_RESERVED, fds_for, limit_error, width_for_fds


def test_a_fan_out_that_fits_runs_every_host_at_once() -> None:
    assert width_for_fds(64, None, 1024) == 64
    assert width_for_fds(64, 16, 1024) == 16


def test_a_fan_out_wider_than_the_limit_is_narrowed_to_what_fits() -> None:
    soft = FDS_RESERVED + 10 * FDS_PER_SSH
    assert width_for_fds(1000, None, soft) == 10
    assert width_for_fds(1000, None, FDS_RESERVED) == 0
    assert fds_for(1000) == FDS_RESERVED + 1000 * FDS_PER_SSH


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (OSError(errno.EMFILE, "Too many open files"), ["open files", "RLIMIT_NOFILE", "ulimit -n"]),
        (OSError(errno.EAGAIN, "Resource temporarily unavailable"), ["RLIMIT_NPROC", "ulimit -u"]),
        (RuntimeError("can't start new thread"), ["RLIMIT_NPROC", "ulimit -u"]),
    ],
)
def test_a_limit_hit_is_named_with_its_fix(exc: BaseException, words: list[str]) -> None:
    err = limit_error(exc)
    assert isinstance(err, ControllerLimitError)
    for w in words:
        assert w in str(err), str(err)


def test_other_errors_are_not_called_limits() -> None:
    assert limit_error(OSError(errno.ENOENT, "No such file")) is None
    assert limit_error(RuntimeError("boom")) is None


def run_limited(hard: int, body: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import resource\n" + f"resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))\n" + textwrap.dedent(body)
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


def test_a_step_that_must_hold_more_sshs_than_the_limit_is_refused_before_it_starts() -> None:
    p = run_limited(
        200,
        """
        from nodeops.transport import ensure_fds
        try:
            ensure_fds("an attached launch", 1000)
        except Exception as e:
            print(type(e).__name__, e)
        ensure_fds("a small launch", 10)
        print("small ok")
    """,
    )
    assert p.returncode == 0, p.stderr
    assert "ControllerLimitError an attached launch needs one ssh per host at once (1000 hosts" in p.stdout
    assert "RLIMIT_NOFILE" in p.stdout and "ulimit -n" in p.stdout
    assert "small ok" in p.stdout


def test_a_fan_out_under_a_low_limit_finishes_every_host() -> None:
    """Each host holds a real pipe pair while in flight, as an ssh child does."""
    p = run_limited(
        100,
        """
        import os, threading, time
        from nodeops.transport import fan_out
        inflight, peak, lock = [0], [0], threading.Lock()
        def one(h):
            r, w = os.pipe()
            with lock:
                inflight[0] += 1
                peak[0] = max(peak[0], inflight[0])
            time.sleep(0.01)
            with lock:
                inflight[0] -= 1
            os.close(r); os.close(w)
            return h * 2
        got = fan_out(list(range(500)), one)
        print(len(got), got[499], peak[0])
    """,
    )
    assert p.returncode == 0, p.stderr
    count, last, peak = p.stdout.split()
    assert (count, last) == ("500", "998")
    assert int(peak) <= (100 - FDS_RESERVED) // FDS_PER_SSH, p.stdout
