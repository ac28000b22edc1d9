"""The preflight inside a Slurm job's allocation, without Slurm: the probe and the rules run here
for real, as the batch script runs them (``python3 -c BOOT < preflight.in`` per node, then
``python3 -c GATE_BOOT``), with the system's bare python3 (no nodeops importable). The live
path (sbatch, srun, a node whose workdir is missing) is tests/integration/test_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodeops.backends.base import LaunchRequest
from nodeops.backends.slurm import backend as slurm_backend
from nodeops.backends.slurm import job as slurm
from nodeops.node import check_rules, probe
from nodeops.spec.loading import load_spec
from tests.unit.backends.test_slurm import SPECS, fake_slurm  # noqa: F401 (a fixture)
from tests.unit.node.test_slurm_batch import batch_job

BARE = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def preflight_in(tmp: Path, workdir: Path, script: str | None = "train.py") -> Path:
    """The payload launch writes, for a Slurm spec whose workdir (not synced) is ``workdir``."""
    spec = tmp / "cluster.yaml"
    spec.write_text(f"slurm: {{nodes: 2}}\nnodes: [{{address: 10.0.0.1}}]\nworkdir: {{path: {workdir}, sync: none}}\n")
    path = tmp / slurm.PREFLIGHT_IN
    path.write_text(slurm_backend.preflight_input(load_spec(spec), script))
    return path


def probe_as_node(payload: Path, node: str, torch: str = "2.13.0") -> str:
    """One srun task of the preflight step: the probe from stdin, SLURMD_NODENAME set by slurmstepd.
    A stand-in torch on PYTHONPATH (the fast probe reads its version.py; this machine has none)."""
    site = payload.parent / f"site-{node}"
    (site / "torch").mkdir(parents=True, exist_ok=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text(f"__version__ = '{torch}'\ncuda = None\n")
    env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, "SLURMD_NODENAME": node,
           "PYTHONPATH": str(site)}  # fmt: skip
    p = subprocess.run([BARE, "-c", probe.BOOT], stdin=payload.open(), capture_output=True, text=True,
                       timeout=120, check=True, env=env)  # fmt: skip
    return p.stdout


def gate(
    payload: Path, output: str, run_dir: Path, nodes: list[str], srun: int = 0
) -> subprocess.CompletedProcess[str]:
    (run_dir / "preflight.out").write_text(output)
    return subprocess.run([BARE, "-I", "-c", check_rules.GATE_BOOT, str(payload), str(run_dir / "preflight.out"),
                           str(run_dir), str(srun), *nodes], capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return list(json.loads((run_dir / slurm.PREFLIGHT_OUT).read_text())["rows"])


def test_preflight_input_is_the_fast_probe_with_the_script_and_the_rules() -> None:
    loaded = load_spec(SPECS / "slurm-sandbox.happy.yaml")  # rsync workdir: the manifest goes along
    d = json.loads(slurm_backend.preflight_input(loaded, "train.py"))
    assert d["plan"]["manifest"]["manifest"]
    assert d["plan"]["mode"] == "node" and d["plan"]["fast"] is True and d["plan"]["script"] == "train.py"
    assert d["plan"]["workdir"] == "/home/debian/train" and d["plan"]["ports"] == []
    assert d["expect"] == {"runner": "torchrun", "workdir": "/home/debian/train"}
    assert d["rules"] == Path(check_rules.__file__).read_text()
    request = LaunchRequest(spec_path=Path("x.yaml"), argv=["-m", "pkg.train"])
    assert request.script_file() is None  # `-m mod`: no file to look for


def test_a_node_without_the_workdir_fails_the_gate_named_with_its_rows(tmp_path: Path) -> None:
    wd = tmp_path / "work"
    wd.mkdir()
    (wd / "train.py").write_text("print('hi')\n")
    good = preflight_in(tmp_path, wd)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = preflight_in(bad_dir, tmp_path / "not-here")  # what node3 sees: no workdir
    output = probe_as_node(good, "node1") + "srun: noise\n" + probe_as_node(bad, "node3", torch="2.12.0")
    p = gate(good, output, tmp_path, ["node1", "node3"])
    assert p.returncode == 1, p.stderr
    failed = [r for r in rows(tmp_path) if r["status"] == "fail"]
    assert {(r["host"], r["check"]) for r in failed} == {("node3", "workdir"), ("node3", "script"), ("node3", "torch")}
    assert all(r["host"] == "node3" for r in failed)
    assert "nodeops: preflight: node3: workdir:" in p.stdout and "preflight: node1" not in p.stdout


def test_a_node_whose_task_never_answered_fails_the_gate_and_a_healthy_set_passes(tmp_path: Path) -> None:
    wd = tmp_path / "work"
    wd.mkdir()
    (wd / "train.py").write_text("")
    payload = preflight_in(tmp_path, wd)
    out = probe_as_node(payload, "node1")
    p = gate(payload, out, tmp_path, ["node1"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert {r["check"] for r in rows(tmp_path)} >= {"python env", "torch"}
    assert all(r["status"] != "fail" for r in rows(tmp_path))
    p = gate(payload, out, tmp_path, ["node1", "node2"])
    assert p.returncode == 1
    assert "nodeops: preflight: node2: probe: no answer from the preflight's srun task" in p.stdout
    p = gate(payload, out, tmp_path, ["node1", "node2"], srun=124)  # `timeout` ended the step
    assert "node2: probe: no answer from the preflight's srun task on this node; the step timed out" in p.stdout
    # the node's own error, from its task's stderr (srun --error=RUN_DIR/preflight-errors/%N.err)
    errs = tmp_path / check_rules.PREFLIGHT_ERRORS
    errs.mkdir()
    (errs / "node2.err").write_text("\nslurmstepd: error: execve(): python3: No such file or directory\n\n")
    p = gate(payload, out, tmp_path, ["node1", "node2"], srun=2)
    assert (
        "nodeops: preflight: node2: probe: no answer from the preflight's srun task on this node; srun exited 2: "
        "slurmstepd: error: execve(): python3: No such file or directory"
    ) in p.stdout, p.stdout


def test_parity_is_judged_against_most_nodes_of_the_allocation() -> None:
    def facts(torch: str) -> dict[str, Any]:
        return {"env": {"python": "3.11.2", "torch": torch, "packages": {"torch": torch}}, "workdir": {"exists": True}}

    # the first node is the odd one: it is named, not the two that agree
    got = check_rules.fast_rows({"node1": facts("2.12.0"), "node2": facts("2.13.0"), "node3": facts("2.13.0")},
                                "", "torchrun", "/w")  # fmt: skip
    bad = [(r.host, r.check, r.detail) for r in got if r.status == check_rules.FAIL]
    assert [(h, c) for h, c, _ in bad] == [("node1", "torch"), ("node1", "packages")]
    assert bad[0][2] == "2.12.0 here, 2.13.0 on most nodes"
    assert "differ from most nodes: torch 2.12.0 (most 2.13.0)" in bad[1][2]


def test_poll_and_verdict_name_the_node_and_row_of_a_failed_preflight(fake_slurm: Path) -> None:  # noqa: F811
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r9"
    d.mkdir(parents=True)
    (d / "result.json").write_text('{"exit": 1, "restart": 0, "signal": "", "requeued": false, '
                                   '"preflight": "failed"}\n')  # fmt: skip
    (d / slurm.PREFLIGHT_OUT).write_text(json.dumps({"status": "fail", "rows": [
        {"host": "node1", "check": "workdir", "status": "ok", "detail": "fine"},
        {"host": "node3", "check": "workdir", "status": "fail", "detail": "/w does not exist; run `nodeops setup`"},
    ]}))  # fmt: skip
    st = slurm.poll(slurm.Login(None), "r9", "4242", {})
    assert st.result is not None and [r["host"] for r in st.result["preflight_rows"]] == ["node3"]
    assert slurm.describe(st) == ("RUNNING: the preflight failed on node3 (workdir: /w does not exist; run "
                                  "`nodeops setup`); no training rank was started")  # fmt: skip


def test_documents_skip_what_cannot_be_a_document() -> None:
    """Frames out of range, a document's frames repeated after it was read, and garbled JSON are
    skipped (that node then counts as not having answered), never an exception."""
    good = probe.frames({"hostname": "n1"})
    tag = good.split()[1]
    assert probe.documents(good + good) == [{"hostname": "n1"}]
    assert probe.documents(f"{probe.MARK}{tag}x 5/1 {{}}\n") == []
    assert probe.documents(f"{probe.MARK}abc 0/1 {{not json\n{probe.MARK}def 0/1 [1]\n") == []


def test_a_preflight_that_broke_by_itself_is_not_blamed_on_a_node(fake_slurm: Path) -> None:  # noqa: F811
    d = fake_slurm / "home" / ".nodeops" / "runs" / "r8"
    d.mkdir(parents=True)
    (d / "result.json").write_text('{"exit": 127, "restart": 0, "signal": "", "requeued": false, '
                                   '"preflight": "error"}\n')  # fmt: skip
    st = slurm.poll(slurm.Login(None), "r8", "4242", {})
    assert slurm.describe(st).startswith("RUNNING: the preflight step itself failed (exit 127; python3 on the batch")


def test_the_batch_script_runs_the_preflight_when_launch_wrote_its_input_and_a_failure_ends_the_job(
    tmp_path: Path,
) -> None:
    """The whole batch script with stand-ins for scontrol and srun (tests/unit/node/test_slurm_batch.py):
    no node answers the preflight's srun step (its tasks get no payload), so the gate fails every
    node and no training step starts; a payload the gate cannot read is the preflight's own error.
    (Without preflight.in there is no preflight step: the same file's hand-submitted job.)"""
    script, run, env = batch_job(tmp_path)
    run.mkdir()
    payload = preflight_in(run, tmp_path / "work")
    for text, kind in ((None, "failed"), ("not json", "error")):
        if text is not None:
            payload.write_text(text)
        (run / "srun.calls").unlink(missing_ok=True)
        p = subprocess.run(["bash", "-c", script, "job.sbatch", "train.py"], env=env, capture_output=True, text=True,
                           timeout=120, check=False)  # fmt: skip
        assert p.returncode != 0, p.stdout + p.stderr
        assert f"nodeops: preflight {kind} (exit {p.returncode}): no training rank was started in this run" in p.stdout
        assert json.loads((run / "result.json").read_text()) == {"exit": p.returncode, "restart": 0, "signal": "",
                                                                 "requeued": False, "preflight": kind}  # fmt: skip
        [call] = (run / "srun.calls").read_text().splitlines()  # the preflight's step only
        assert (
            f"--kill-on-bad-exit=0 --input=all --error={run / check_rules.PREFLIGHT_ERRORS}/%N.err python3 -c " in call
        )
        assert (run / slurm.PREFLIGHT_OUT).exists() is (kind == "failed")
    assert "nodeops: preflight: node2: probe: no answer from the preflight's srun task" in p.stdout or kind == "error"
