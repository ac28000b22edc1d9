"""check --fabric: bandwidth arithmetic, the pair schedule, verdicts, NCCL's network lines."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from nodeops.backends.slurm.backend import fabric_files
from nodeops.node import fabric, fabric_probe
from nodeops.spec.loading import load_spec

GIB = 1 << 30


def test_bandwidth_follows_nccl_tests_definitions() -> None:
    # nccl-tests: algbw = size / time; busbw = algbw * 2(n-1)/n for all-reduce.
    # 1 GiB in 48.9 ms is 21.96 GB/s, i.e. 175.7 Gbit/s; on 2 ranks busbw equals algbw.
    assert fabric.algbw_gbps(GIB, 0.0489) / 8 == pytest.approx(21.96, abs=0.01)
    assert fabric.busbw_gbps(GIB, 0.0489, 2) == pytest.approx(fabric.algbw_gbps(GIB, 0.0489))
    assert fabric.bus_factor(8) == pytest.approx(1.75)
    assert fabric.bus_factor(1) == 0.0  # one rank moves nothing over a link
    assert fabric.busbw_gbps(8 * GIB, 1.0, 4) == pytest.approx(8 * GIB * 8 / 1e9 * 1.5)
    assert fabric.algbw_gbps(1, 0.0) == 0.0


@pytest.mark.parametrize("n", range(0, 41))
def test_ring_schedule_measures_each_node_twice_in_two_or_three_rounds(n: int) -> None:
    pairs = fabric.ring_pairs(n)
    rounds = fabric.schedule(pairs)
    assert sorted(p for r in rounds for p in r) == sorted(pairs)  # every pair once
    for r in rounds:  # a round's pairs share no node: they run at once without sharing a NIC
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
    if n < 2:
        assert pairs == [] and rounds == []
    elif n == 2:
        assert rounds == [[(0, 1)]]
    else:
        assert len(pairs) == n  # N measurements, not N^2
        assert Counter(x for p in pairs for x in p) == {i: 2 for i in range(n)}  # both ring neighbours
        assert len(rounds) == (2 if n % 2 == 0 else 3)


def test_probe_args_carry_the_schedule() -> None:
    argv = fabric.probe_args(["a", "b", "c", "d"], 20, 0.7, "gloo")
    assert argv == ["--seconds", "20", "--spread", "0.7", "--backend", "gloo",
                    "--nodes", "a,b,c,d", "--sequential", "--rounds", "0-1;1-2;2-3;3-0"]  # fmt: skip
    assert "--rounds" not in fabric.probe_args(["solo"], 20, 0.7, "nccl")
    big = fabric.probe_args([f"n{i}" for i in range(10)], 20, 0.7, "nccl")
    assert "--sequential" not in big and big[big.index("--rounds") + 1].count(";") == 1  # 2 concurrent rounds
    # Slurm names its nodes once the job runs: the probe is told how many, with the same schedule
    assert fabric.probe_args(3, 20, 0.7, "gloo") == ["--seconds", "20", "--spread", "0.7", "--backend", "gloo",
                                                     "--count", "3", "--sequential", "--rounds",
                                                     "0-1;1-2;2-0"]  # fmt: skip


def test_backend_is_one_for_the_whole_run() -> None:
    assert fabric.backend([8, 8]) == "nccl"
    assert fabric.backend([8, 0]) == "gloo"  # NCCL cannot run on a CPU-only rank
    assert fabric.backend([]) == "gloo"


def test_probe_planning_functions() -> None:
    # importable without torch (the probe imports it inside main())
    rounds = [[(0, 1), (2, 3)], [(1, 2)]]
    assert fabric_probe.parse_rounds(fabric_probe.format_rounds(rounds)) == rounds
    assert fabric_probe.parse_rounds(fabric_probe.format_rounds([])) == []
    sweep = [{"bytes": 1 << 20, "seconds": 0.5}]  # 2 MB/s: a throttled link
    assert fabric_probe.pair_size(sweep, 1.6, 4 << 20) == 1 << 20  # two runs of 1 MiB fit in 1.6 s
    assert fabric_probe.pair_size([{"bytes": 16 << 20, "seconds": 0.02}], 2.0, 4 << 20) == 4 << 20  # capped
    assert fabric_probe.pair_size(sweep, 0.001, 4 << 20) == fabric_probe.MIN_PAIR_BYTES
    best = {0: 10.0, 1: 3.0, 2: 9.0, 3: 2.0, 4: 9.5}
    assert fabric_probe.confirm_rounds(best, 0.7) == [[(1, 0), (3, 4)]]
    assert fabric_probe.confirm_rounds(best, 0.7, sequential=True) == [[(1, 0)], [(3, 4)]]
    assert fabric_probe.confirm_rounds({0: 1.0, 1: 1.0}, 0.7) == []  # 2 nodes: nothing to compare with
    assert fabric_probe.confirm_rounds({0: 1.0, 1: 1.0, 2: 1.0}, 0.7) == []  # no suspect


def named(n: int, slow: set[int], contention: float = 1.0) -> set[str]:
    """The whole rule, as the probe and the verdict run it, on a modelled fabric: a pair with a
    slow node runs at 0.3 of a healthy pair; a pair sharing its round with others at
    ``contention`` of its speed alone (an oversubscribed fabric, or nodes sharing CPUs)."""

    def run(rounds: list[list[tuple[int, int]]], confirm: bool) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for rnd in rounds:
            for a, b in rnd:
                bw = (0.3 if a in slow or b in slow else 1.0) * (contention if len(rnd) > 1 else 1.0)
                out.append({"pair": [a, b], "ranks": 2, "seconds": 0.01 / bw, "iters": 5, "confirm": confirm})
        return out

    pairs = run(fabric.pair_rounds(n), False)
    best = fabric_probe.node_best(pairs, 4 << 20)  # type: ignore[arg-type]
    pairs += run(fabric_probe.confirm_rounds(best, 0.7, n <= fabric.SEQUENTIAL_MAX_NODES), True)
    d = doc([f"n{i}" for i in range(n)], {})
    d["pairs"] = pairs
    return {x.name for x in fabric.evaluate(d).nodes if x.verdict != "ok"}


@pytest.mark.parametrize(
    ("n", "slow"),
    [(3, {1}), (4, {2}), (5, {1, 3}), (6, {0, 2}), (8, {3}), (9, {0, 2, 4, 6}), (12, {5}), (12, {1, 2}),
     (16, {0, 5, 10}), (32, {7})],
)  # fmt: skip
def test_the_slow_nodes_and_only_they_are_named(n: int, slow: set[int]) -> None:
    assert named(n, slow) == {f"n{i}" for i in slow}
    # pairs run together (beyond 8 nodes) on an oversubscribed fabric: still only the slow ones
    assert named(n, slow, contention=0.6) == {f"n{i}" for i in slow}


@pytest.mark.parametrize(("n", "slow"), [(3, {0, 1}), (4, {0, 2}), (6, {0, 2, 4})])
def test_when_no_pair_is_healthy_only_a_floor_can_fail(n: int, slow: set[int]) -> None:
    # every ring pair holds a slow node: no measurement shows what a healthy link reaches
    assert named(n, slow) == set()


Pairs = dict[tuple[int, int], float]


def doc(names: list[str], pair_seconds: Pairs, *, confirm: Pairs | None = None, sweep_seconds: float = 0.01,
        world: int | None = None) -> dict[str, object]:  # fmt: skip
    """A probe document: 4 MiB pairs of one rank per node; times in seconds."""
    pairs = [{"pair": list(p), "ranks": 2, "seconds": t, "iters": 5} for p, t in pair_seconds.items()]
    pairs += [
        {"pair": list(p), "ranks": 2, "seconds": t, "iters": 5, "confirm": True} for p, t in (confirm or {}).items()
    ]
    return {"backend": "gloo", "world": world or len(names), "nodes": names, "pair_bytes": 4 << 20,
            "sweep": [{"bytes": 16 << 20, "seconds": sweep_seconds, "iters": 10}], "skipped": [], "pairs": pairs,
            "env": {n: {"GLOO_SOCKET_IFNAME": "eth0"} for n in names}, "elapsed": 3.2}  # fmt: skip


def test_one_slow_node_of_three_is_named_and_its_neighbours_are_not() -> None:
    # node2 throttled: both of its pairs are slow, so two of the three pairs are; the median pair
    # is a slow one, which is why the verdict compares node scores (each node's best pair).
    r = fabric.evaluate(doc(["node1", "node2", "node3"], {(0, 1): 1.5, (1, 2): 1.6, (2, 0): 0.01}))
    assert [(n.name, n.verdict) for n in r.nodes] == [("node2", "slow"), ("node1", "ok"), ("node3", "ok")]
    assert not r.ok and len(r.problems) == 1 and r.problems[0].startswith("node2: slow: its best pair reaches")
    assert "below network.fabric.max_pair_spread 0.7" in r.problems[0] and "0.7% of the reference" in r.problems[0]
    assert [p.verdict for p in r.pairs] == ["slow", "slow", "ok"]  # slowest first
    assert r.pairs[0].busbw == pytest.approx(fabric.busbw_gbps(4 << 20, 1.6, 2))
    assert r.nodes[0].interface == "eth0 (GLOO_SOCKET_IFNAME)"


def test_healthy_nodes_pass_within_the_spread() -> None:
    r = fabric.evaluate(doc(["a", "b", "c", "d"], {(0, 1): 0.010, (2, 3): 0.012, (1, 2): 0.011, (3, 0): 0.013}))
    assert r.ok and all(n.verdict == "ok" for n in r.nodes) and r.problems == []
    assert r.to_json()["status"] == "ok" and r.to_json()["latency_us"] is None  # no size small enough
    d = doc(["a", "b", "c"], {(0, 1): 0.01, (1, 2): 0.01, (2, 0): 0.01})
    d["sweep"] = [{"bytes": 8 << 10, "seconds": 0.00042, "iters": 20}, *d["sweep"]]
    assert fabric.evaluate(d).to_json()["latency_us"] == 420.0
    json.dumps(r.to_json())  # the --json document is plain JSON


def test_a_node_between_two_slow_ones_is_cleared_by_its_confirmation_pair() -> None:
    # ring a-b-c-d-e: b and d throttled, so c's two ring pairs are slow too; its pair with the
    # best node (a, measured again by the probe) is fast, so c is not named.
    ring = {(0, 1): 1.0, (1, 2): 1.0, (2, 3): 1.0, (3, 4): 1.0, (4, 0): 0.01}
    r = fabric.evaluate(doc(list("abcde"), ring, confirm={(1, 0): 1.0, (2, 0): 0.011, (3, 0): 1.0}))
    assert sorted(n.name for n in r.nodes if n.verdict == "slow") == ["b", "d"]
    without = fabric.evaluate(doc(list("abcde"), ring))
    assert sorted(n.name for n in without.nodes if n.verdict == "slow") == ["b", "c", "d"]


def test_two_nodes_cannot_name_one_but_a_floor_fails_the_pair() -> None:
    r = fabric.evaluate(doc(["a", "b"], {(0, 1): 1.0}))
    assert r.ok and any("cannot be told from its partner" in n for n in r.notes)
    slow = fabric.evaluate(doc(["a", "b"], {(0, 1): 1.0}), min_busbw=10)
    assert not slow.ok and {n.name for n in slow.nodes if n.verdict == "slow"} == {"a", "b"}
    assert "below network.fabric.min_busbw_gbps 10" in slow.problems[0]


def test_floor_on_the_all_nodes_all_reduce() -> None:
    # 16 MiB over 3 ranks in 1 s: 0.18 Gbit/s bus bandwidth
    r = fabric.evaluate(
        doc(["a", "b", "c"], {(0, 1): 0.01, (1, 2): 0.01, (2, 0): 0.01}, sweep_seconds=1.0), min_busbw=1
    )
    assert any(p.startswith("all nodes: all-reduce of 16 MiB reaches 0.179 Gbit/s") for p in r.problems), r.problems
    ok = fabric.evaluate(doc(["a", "b", "c"], {(0, 1): 0.01, (1, 2): 0.01, (2, 0): 0.01}), min_busbw=1)
    assert ok.ok, ok.problems


def test_one_node_has_only_the_all_reduce() -> None:
    r = fabric.evaluate(doc(["solo"], {}))
    assert r.ok and r.pairs == [] and r.nodes[0].best is None


# Lines in the format NCCL prints with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET (hostnames and
# addresses made up; the shapes are NCCL 2.18-2.21's).
SOCKET = """\
gpu1:4101:4101 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.11<0>
gpu1:4101:4122 [0] NCCL INFO NET/IB : No device found.
gpu1:4101:4122 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.11<0>
gpu1:4101:4122 [0] NCCL INFO Using network Socket
"""
IB = """\
gpu2:5202:5230 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to bond0
gpu2:5202:5230 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB bond0:10.2.0.12<0>
gpu2:5202:5230 [0] NCCL INFO Using network IB
"""
ROCE_PLUGIN = """\
gpu3:6303:6340 [1] NCCL INFO NET/IB : Using [0]mlx5_bond_6:1/RoCE [1]mlx5_bond_7:1/RoCE [RO]; OOB bond0:10.3.0.13<0>
gpu3:6303:6340 [1] NCCL INFO Using network NCCL RDMA Plugin v6
"""
MANY_SOCKETS = "h:1:1 [0] NCCL INFO NET/Socket : Using [0]enp3s0f0:10.2.64.94<0> [1]virbr0:192.168.122.1<0>\n"


def test_nccl_network_lines_are_read() -> None:
    assert fabric.parse_nccl_net("[rank0]:" + line for line in SOCKET.splitlines()) == "Socket: eth0"
    assert fabric.parse_nccl_net(IB.splitlines()) == "IB: mlx5_0:1/IB, mlx5_1:1/IB (OOB bond0)"
    # a net plugin: its name, and the only device line NCCL printed
    assert fabric.parse_nccl_net(ROCE_PLUGIN.splitlines()) == (
        "NCCL RDMA Plugin v6: mlx5_bond_6:1/RoCE, mlx5_bond_7:1/RoCE (OOB bond0)"
    )
    assert fabric.parse_nccl_net(MANY_SOCKETS.splitlines()) == "Socket: enp3s0f0, virbr0"
    assert fabric.parse_nccl_net(["[rank0]:fabric: gloo on 3 rank(s)"]) is None


def test_collector_keeps_the_result_and_the_nccl_lines() -> None:
    shown: list[tuple[str, str]] = []
    c = fabric.Collector(lambda h, line: shown.append((h, line)))
    for line in SOCKET.splitlines():
        c("gpu1", "[rank0]:" + line)
    c("gpu1", "[rank0]:fabric: all-reduce 8 KiB: 0.20 ms x20")
    c("gpu1", '[rank0]:NODEOPS_FABRIC {"backend": "nccl"}')
    c("gpu1", "[rank0]:Traceback (most recent call last):")
    assert c.doc == {"backend": "nccl"}
    assert c.interfaces() == {"gpu1": "Socket: eth0"}
    # only the probe's progress is shown (a failure is named by launch from the run's last lines)
    assert [line for _, line in shown] == ["[rank0]:fabric: all-reduce 8 KiB: 0.20 ms x20"]
    verbose: list[tuple[str, str]] = []
    v = fabric.Collector(lambda h, line: verbose.append((h, line)), verbose=True)
    v("gpu1", SOCKET.splitlines()[2])
    assert verbose == [("gpu1", SOCKET.splitlines()[2])]


def test_interfaces_from_nccl_win_over_the_env() -> None:
    d = doc(["gpu1", "gpu2", "gpu3"], {(0, 1): 0.01, (1, 2): 0.01, (2, 0): 0.01})
    d["backend"] = "nccl"
    d["env"] = {"gpu1": {"NCCL_SOCKET_IFNAME": "eth0"}, "gpu2": {}, "gpu3": {}}
    r = fabric.evaluate(d, interfaces={"gpu2": "IB: mlx5_0:1/IB (OOB bond0)"})
    by = {n.name: n.interface for n in r.nodes}
    assert by == {"gpu1": "eth0 (NCCL_SOCKET_IFNAME)", "gpu2": "IB: mlx5_0:1/IB (OOB bond0)",
                  "gpu3": "not set (the default route's)"}  # fmt: skip


def test_spec_thresholds_are_validated_with_their_line(tmp_path: Path) -> None:
    from nodeops.errors import SpecError
    from nodeops.spec.loading import load_spec

    spec = tmp_path / "c.yaml"
    spec.write_text("nodes:\n  - {address: 10.0.0.1, chief: true}\nnetwork:\n  fabric:\n    max_pair_spread: 1.5\n")
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert f"{spec}:5:" in str(e.value) and "network.fabric.max_pair_spread" in str(e.value)
    spec.write_text("nodes:\n  - {address: 10.0.0.1, chief: true}\nnetwork: {fabric: {min_busbw_gbps: 25}}\n")
    f = load_spec(spec).spec.network.fabric
    assert (f.min_busbw_gbps, f.max_pair_spread) == (25, 0.7)


def cluster_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "c.yaml"
    spec.write_text("nodes:\n  - {address: 10.9.0.1, chief: true}\n  - {address: 10.9.0.2}\n")
    return spec


def fake_check(monkeypatch: pytest.MonkeyPatch, status: str) -> None:
    """check's own rows (which need a cluster) replaced by a fixed report: this tests the CLI's
    flow around --fabric, not the probe (tests/integration/test_fabric.py runs it for real)."""
    from nodeops.check import preflight as check

    rows = [check.Row(h, "ssh", status, "fixed") for h in ("10.9.0.1", "10.9.0.2")]
    monkeypatch.setattr(check, "run", lambda *a, **k: None)
    monkeypatch.setattr(check, "evaluate", lambda *a, **k: check.Report(rows, {}, ["10.9.0.1", "10.9.0.2"]))


def test_fabric_is_not_run_when_a_check_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from nodeops.cli import app
    from nodeops.lifecycle import check as check_flow

    ran: list[object] = []
    monkeypatch.setattr(check_flow, "run_fabric", lambda *a, **k: ran.append(a))
    fake_check(monkeypatch, "fail")
    r = CliRunner().invoke(app, ["check", str(cluster_spec(tmp_path)), "--fabric", "--json"],
                           env={"NODEOPS_HOME": str(tmp_path / "home")})  # fmt: skip
    assert r.exit_code == 1 and ran == []
    doc = json.loads(r.stdout)
    assert doc["status"] == "fail" and doc["fabric"]["status"] == "error"
    assert doc["fabric"]["error"].startswith("not run: a check failed")


def test_fabric_failure_is_exit_1_and_json_status_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from nodeops.cli import app
    from nodeops.lifecycle import check as check_flow
    from nodeops.node.fabric import FabricError

    slow = fabric.evaluate(doc(["a", "b", "c"], {(0, 1): 1.0, (1, 2): 1.0, (2, 0): 0.01}))
    monkeypatch.setattr(check_flow, "run_fabric", lambda *a, **k: slow)
    fake_check(monkeypatch, "ok")
    env = {"NODEOPS_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    r = CliRunner().invoke(app, ["check", str(cluster_spec(tmp_path)), "--fabric", "--json"], env=env)
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)  # pure JSON on stdout
    assert (d["status"], d["exit_code"], d["fabric"]["status"]) == ("fail", 1, "fail")
    r = CliRunner().invoke(app, ["check", str(cluster_spec(tmp_path)), "--fabric"], env=env)
    assert r.exit_code == 1 and "fabric: b: slow:" in r.stdout and "fabric: fail" in r.stdout

    def broken(*a: object, **k: object) -> None:
        raise FabricError("the measurement (run X) failed with exit code 1; see above")

    monkeypatch.setattr(check_flow, "run_fabric", broken)
    r = CliRunner().invoke(app, ["check", str(cluster_spec(tmp_path)), "--fabric", "--json"], env=env)
    assert r.exit_code == 1 and json.loads(r.stdout)["fabric"]["error"].startswith("the measurement")


# --------------------------------------------------------------- launch --fabric-check on Slurm: the gate
def gate_dir(tmp_path: Path) -> Path:
    """The files launch ships for a Slurm job's step before training, written as the batch node
    has them: the gate package alone on PYTHONPATH (nothing of this checkout's nodeops)."""
    loaded = load_spec(Path(__file__).resolve().parents[2] / "specs" / "slurm-sandbox.happy.yaml")
    files = fabric_files(loaded, 3, [0, 0, 0])
    run = tmp_path / "run"
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    assert (run / "fabric.args").read_text().splitlines()[:6] == ["--seconds", "30", "--spread", "0.7", "--backend",
                                                                   "gloo"]  # fmt: skip
    assert "--count\n3\n" in (run / "fabric.args").read_text()
    return run


def run_gate(run: Path, *logs: Path) -> subprocess.CompletedProcess[str]:
    # the system's python3, -s: no user site; PYTHONPATH the gate package only (the venv's nodeops
    # is not importable from there), as on a batch node without nodeops
    return subprocess.run(["/usr/bin/python3", "-s", "-m", "nodeops.node.fabric", str(run / "fabric.json"),
                           str(run / "fabric.doc.json"), str(run / "fabric.report.json"), *map(str, logs)],
                          env={"PYTHONPATH": str(run / "fabric-gate"), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs the system's python3")
def test_the_shipped_gate_judges_on_a_node_without_nodeops(tmp_path: Path) -> None:
    run = gate_dir(tmp_path)
    none = run_gate(run)  # no document (waited for 10 s: a shared filesystem may show it late)
    assert none.returncode == 2 and "the measurement gave no result" in none.stdout, none.stdout + none.stderr
    (run / "fabric.doc.json").write_text(json.dumps({"world": 3}))  # garbled: the gate breaks, no verdict
    broken = run_gate(run)
    assert broken.returncode == 3 and "nodeops: fabric: the gate failed: KeyError" in broken.stdout, broken.stdout
    assert not (run / "fabric.report.json").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "b.log").write_text("[rank1]:b:1:1 [0] NCCL INFO NET/Socket : Using [0]eth1:10.0.0.2<0>\n")
    (logs / "a.log").write_text("[rank0]:fabric: gloo on 3 rank(s)\n")
    (run / "fabric.doc.json").write_text(json.dumps(doc(["a", "b", "c"], {(0, 1): 0.01, (1, 2): 1.0, (2, 0): 1.0})))
    p = run_gate(run, logs / "a.log", logs / "b.log", logs / "missing.log")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "nodeops: fabric: c: slow: its best pair reaches" in p.stdout, p.stdout
    assert p.stdout.splitlines()[-1].startswith("nodeops: fabric: fail (3 rank(s), gloo, measured in 3.2s")
    report = fabric.FabricReport.from_json(json.loads((run / "fabric.report.json").read_text()))
    expected = fabric.evaluate(json.loads((run / "fabric.doc.json").read_text()), interfaces={"b": "Socket: eth1"})
    assert [(n.name, n.verdict) for n in report.nodes] == [(n.name, n.verdict) for n in expected.nodes]
    assert report.problems == expected.problems
    assert [n.interface for n in report.nodes if n.name == "b"] == ["Socket: eth1"]
    (run / "fabric.doc.json").write_text(json.dumps(doc(["a", "b", "c"], {(0, 1): 1.0, (1, 2): 1.0, (2, 0): 1.0})))
    ok = run_gate(run)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("nodeops: fabric: ok"), ok.stdout + ok.stderr


def test_a_report_reads_back_as_it_was_written() -> None:
    report = fabric.evaluate(doc(["a", "b", "c"], {(0, 1): 1.0, (1, 2): 0.01, (2, 0): 1.0}), min_busbw=1.0)
    again = fabric.FabricReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report
