"""A run's timeouts as one set (nodeops.spec.timeouts): the default hard timeout, the order the
dry run prints, and the spec values that break it (refused with file:line, or warned)."""

from __future__ import annotations

import pytest

from nodeops.errors import SpecError
from nodeops.spec import timeouts as T
from nodeops.spec.load import load_spec_text

GPU = "nodes:\n  - {address: 10.0.0.1, gpus: [0, 1], chief: true}\n  - {address: 10.0.0.2, gpus: [0, 1]}\n"
CPU = "nodes:\n  - {address: 10.0.0.1, chief: true}\n  - {address: 10.0.0.2}\n"


def test_the_default_hard_timeout_is_half_the_collective_timeout() -> None:
    assert T.hard(load_spec_text(GPU).spec) == (300.0, "default: half the collective timeout")  # NCCL: 10 min
    assert T.hard(load_spec_text(CPU).spec)[0] == 900.0  # gloo: 30 min
    spec = load_spec_text(CPU + "launch: {collective_timeout: 20m}\n").spec
    assert T.hard(spec)[0] == 600.0 and T.collective(spec) == (1200.0, "launch.collective_timeout")
    assert T.hard(load_spec_text(CPU + "launch: {hang_timeout: 0}\n").spec)[0] is None  # off
    assert T.hard(load_spec_text(CPU + "launch: {hang_timeout: 90s}\n").spec) == (90.0, "launch.hang_timeout")


def test_the_table_lists_the_timeouts_in_the_order_they_fire() -> None:
    lines = T.table(load_spec_text(GPU).spec)
    names = [ln.split(".", 1)[1].split("  ")[0].strip() for ln in lines[1:6]]
    assert names == ["stall report", "NCCL InfiniBand retries", "hang timeout", "NCCL heartbeat monitor",
                     "collective timeout"]  # fmt: skip
    assert "5m" in lines[3] and "10m" in lines[5] and "<- out of order" not in "".join(lines)
    assert [r.name for r in T.rows(load_spec_text(CPU).spec)] == ["stall report", "hang timeout",
                                                                  "collective timeout"]  # fmt: skip


def test_a_hang_timeout_not_below_the_collective_timeout_is_refused_with_its_line() -> None:
    with pytest.raises(SpecError) as e:
        load_spec_text(GPU + "launch:\n  hang_timeout: 10m\n", "c.yaml")
    (issue,) = e.value.issues
    assert (issue.file, issue.line, issue.field) == ("c.yaml", 5, "launch.hang_timeout")
    assert "not below the collective timeout 10m (PyTorch's default for NCCL)" in issue.message
    assert "launch.collective_timeout" in issue.fix
    # the same value under a longer collective timeout the script declares is fine
    load_spec_text(GPU + "launch:\n  hang_timeout: 10m\n  collective_timeout: 30m\n")


def test_nccl_timeouts_that_fire_before_the_hang_timeout_are_warned_of() -> None:
    loaded = load_spec_text(GPU + "network:\n  nccl: {NCCL_IB_TIMEOUT: '24'}\n"
                            "env: {TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: '120'}\nlaunch: {hang_timeout: 4m}\n")  # fmt: skip
    fields = sorted(w.field for w in loaded.warnings)
    assert fields == ["env.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "network.nccl.NCCL_IB_TIMEOUT"]
    assert T.ib_retry(loaded.spec) == pytest.approx((4.096e-6 * 2**24 * 8, "network.nccl"))
    assert "<- out of order" in "".join(T.table(loaded.spec))


def test_a_collective_timeout_that_is_no_duration_is_refused() -> None:
    with pytest.raises(SpecError) as e:
        load_spec_text(CPU + "launch: {collective_timeout: 3s}\n")
    assert e.value.issues[0].field == "launch.collective_timeout"


def test_a_timeout_turned_off_takes_no_place_in_the_firing_order() -> None:
    lines = T.table(load_spec_text(CPU + "launch: {hang_timeout: 0}\n").spec)
    assert lines[2].startswith("  2. collective timeout") and not any(ln.startswith("  3.") for ln in lines)
    assert "     hang timeout (launch.hang_timeout (0: off)): off: nothing stops a hung run before PyTorch" in lines
