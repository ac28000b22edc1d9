"""PyTorch's NCCL flight recorder on GPU runs: the launch asks for it, the ranks' hook sets
the variables the env leaves unset. The live path (a real NCCL collective timing out and
PyTorch writing its dumps) needs GPUs and is not tested here; tests/integration/test_stacks.py
checks that the dump file's path reaches real ranks and that a failed run's dumps are collected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeops.launch import launchers
from nodeops.node import stacks as S
from nodeops.spec.load import load_spec_text

GPU = """
nodes:
  - {address: 10.0.0.1, chief: true, gpus: [0, 1]}
  - {address: 10.0.0.2, gpus: auto}
"""
CPU = """
nodes:
  - {address: 10.0.0.1, chief: true}
  - {address: 10.0.0.2}
"""
NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
         "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "on"),
    [(GPU, True), (CPU, False), (GPU + "launch: {flight_recorder: false}\n", False),
     (CPU + "launch: {flight_recorder: true}\n", True)],
)  # fmt: skip
def test_the_launch_asks_for_it_where_the_spec_has_gpus_unless_the_spec_says(text: str, on: bool) -> None:
    for runner in ("torchrun", "mpirun", "deepspeed"):
        spec = load_spec_text(text).spec
        spec = spec.model_copy(update={"launch": spec.launch.model_copy(update={"runner": runner})})
        plan = launchers.plan(spec, ["train.py"], "20261124-101500-fa12", env_names=["NCCL_DEBUG"])
        assert all(("NODEOPS_FLIGHT_RECORDER" in h.env) == on for h in plan), (runner, plan)
        if runner == "mpirun":  # remote ranks get it only through -x
            argv = plan[0].argv
            forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
            assert ("NODEOPS_FLIGHT_RECORDER" in forwarded) == on, argv


def rank_env(
    tmp_path: Path, env: dict[str, str], rank: bool = True, torch: str = "2.13.0+cpu", names: tuple[str, ...] = NAMES
) -> dict[str, str | None]:
    """What a process's os.environ holds once the hook (as start.sh writes it) has run: a rank
    of the run (RANK set), or another Python process that sees the same PYTHONPATH; the torch
    it finds installed is a distribution's metadata of version ``torch``, first on the path."""
    run = tmp_path / "20261124-101500-fa12"
    (run / S.HOOK_DIR).mkdir(parents=True)
    (run / S.HOOK_DIR / "sitecustomize.py").write_text(S.HOOK)
    dist = tmp_path / "dists" / f"torch-{torch.split('+')[0]}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch}\n")
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{run / S.HOOK_DIR}:{dist.parent}", "NODEOPS_RUN_ID": run.name}
    base |= {"RANK": "3"} if rank else {}
    p = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                       check=True, cwd=tmp_path)  # fmt: skip
    return dict(json.loads(p.stdout))


def test_the_hook_sets_only_the_names_the_installed_torch_reads(tmp_path: Path) -> None:
    # torch 2.8 and later: TORCH_FR_* (the old names would print a deprecation warning per rank)
    dump = str(tmp_path / "new" / "20261124-101500-fa12" / S.FLIGHT_DIR / "rank_")
    got = rank_env(tmp_path / "new", {"NODEOPS_FLIGHT_RECORDER": "1"}, torch="2.11.0+cu128")
    assert got == {**dict.fromkeys(NAMES), "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": dump}  # fmt: skip
    assert (tmp_path / "new" / "20261124-101500-fa12" / S.FLIGHT_DIR).is_dir()
    # before 2.8: only the old names exist
    dump = str(tmp_path / "old" / "20261124-101500-fa12" / S.FLIGHT_DIR / "rank_")
    got = rank_env(tmp_path / "old", {"NODEOPS_FLIGHT_RECORDER": "1"}, torch="2.5.1")
    assert got == {**dict.fromkeys(NAMES), "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}  # fmt: skip
    # a version that cannot be read: both names
    dump = str(tmp_path / "odd" / "20261124-101500-fa12" / S.FLIGHT_DIR / "rank_")
    got = rank_env(tmp_path / "odd", {"NODEOPS_FLIGHT_RECORDER": "1"}, torch="nightly")
    assert got == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": dump,
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}  # fmt: skip


def test_what_the_user_set_wins_under_either_name(tmp_path: Path) -> None:
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/x/f_"}
    got = rank_env(tmp_path / "a", {"NODEOPS_FLIGHT_RECORDER": "1", **mine})
    assert got == {**dict.fromkeys(NAMES), **mine}  # nothing added under the other names
    # a size of 0 turns the recorder off: nothing more is set
    got = rank_env(tmp_path / "b", {"NODEOPS_FLIGHT_RECORDER": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert got == {**dict.fromkeys(NAMES), "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def test_nothing_is_set_unless_asked_or_outside_a_rank(tmp_path: Path) -> None:
    assert rank_env(tmp_path / "a", {}) == dict.fromkeys(NAMES)
    assert rank_env(tmp_path / "b", {"NODEOPS_FLIGHT_RECORDER": "1"}, rank=False) == dict.fromkeys(NAMES)


def test_the_hook_names_the_debug_info_pipe_unless_the_user_did(tmp_path: Path) -> None:
    got = rank_env(tmp_path / "a", {"NODEOPS_FLIGHT_RECORDER": "1"}, names=("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",))
    pipe = str(tmp_path / "a" / "20261124-101500-fa12" / S.FLIGHT_DIR / S.FLIGHT_PIPE)
    assert got == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe}
    mine = {"NODEOPS_FLIGHT_RECORDER": "1", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/x/p_"}
    assert rank_env(tmp_path / "b", mine, names=("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",)) == {
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/x/p_"
    }
    assert rank_env(tmp_path / "c", {}, names=("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",)) == {
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": None
    }


def test_a_dump_is_asked_through_each_ranks_fifo_without_ever_blocking(tmp_path: Path) -> None:
    """What PyTorch's NCCL watchdog does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE (measured on torch
    2.11 with NCCL 2.28 on a GPU: it opens pipe_<rank>.pipe for reading and dumps on a "1"),
    played by a reader thread here: gloo has no flight recorder, and a live NCCL dump needs a GPU
    (untested here)."""
    d = tmp_path / S.FLIGHT_DIR
    d.mkdir()
    os.mkfifo(d / f"{S.FLIGHT_PIPE}3.pipe")
    os.mkfifo(d / f"{S.FLIGHT_PIPE}4.pipe")  # a rank that is gone: nobody reads it
    (d / "rank_3").write_text("an earlier dump")  # not a FIFO: never written
    got: list[bytes] = []
    fd = os.open(d / f"{S.FLIGHT_PIPE}3.pipe", os.O_RDONLY | os.O_NONBLOCK)  # the rank reads its FIFO
    try:
        assert S.ask_flight(str(tmp_path)) == [3]  # returns at once: pipe_4 has no reader (O_NONBLOCK: ENXIO)
        got.append(os.read(fd, 16))
    finally:
        os.close(fd)
    assert got == [b"1\n"]
    assert (d / "rank_3").read_text() == "an earlier dump"
    assert S.ask_flight(str(tmp_path / "none")) == []
