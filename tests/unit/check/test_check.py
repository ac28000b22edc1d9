"""`nodeops check`: the pure parts (probe helpers, fact -> ok/warn/fail rules, the report).

The live path runs against the sandbox in tests/integration/test_check.py. GPU rows cannot be
live here (no GPU on these machines): tests/unit/data/nvidia-smi-query.csv is NOT recorded on
our hardware; it follows the `--query-gpu=... --format=csv,noheader,nounits` output format as
seen in public nvidia-smi output (GPU UUIDs borrowed from public issue threads).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeops.check import preflight as check
from nodeops.node import probe
from nodeops.spec.load import load_spec_text

DATA = Path(__file__).parents[1] / "data"
SPEC = """
nodes:
  - {address: 10.0.0.1, chief: true, gpus: [0, 1]}
  - {address: 10.0.0.2, gpus: [0, 1]}
python: {venv: ~/.venvs/train}
workdir: {path: /srv/w}
"""
CPU_SPEC = """
nodes:
  - {address: 10.0.0.1, chief: true, cpus: [0]}
  - {address: 10.0.0.2, cpus: [0]}
  - {address: 10.0.0.3, cpus: [0]}
"""
GPUS = probe.parse_nvidia_smi((DATA / "nvidia-smi-query.csv").read_text())


def facts(**over: Any) -> dict[str, Any]:
    f: dict[str, Any] = {
        "hostname": "n", "nofile": [1048576, 1048576], "shm_bytes": 2 << 30, "env_file": True,
        "disk_free": {"path": "/srv/w", "bytes": 100 << 30},
        "workdir": {"exists": True, "hash": "abc", "files": 3, "bytes": 10, "exact": True},
        "route": {"dev": "eth0", "src": "10.0.0.2"},
        "ports": {"29500": {"ok": True, "rtt_ms": 0.2, "offset_s": 0.001}},
        "nvidia_smi": {"rc": 0, "gpus": GPUS, "error": []},
        "env": {"python": "3.11.2", "executable": "/v/bin/python3", "env_prefix": "/v",
                "ifnames": {"NCCL_SOCKET_IFNAME": "eth0"}, "packages": {"torch": "2.13.0", "numpy": "2.1.0"},
                "torch": "2.13.0", "torch_cuda": "12.8", "cuda_devices": 2, "nccl": "2.27.3"},
    }  # fmt: skip
    for k, v in over.items():
        f[k] = v
    return f


def result(per_host: dict[str, dict[str, Any]], listeners: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "listeners": listeners or {"29500": {"error": "", "seen": sorted(per_host)}},
        "nodes": {h: {"ssh": {"ok": True, "seconds": 0.3}, "facts": f} for h, f in per_host.items()},
    }


def rows_of(report: check.Report, host: str, name: str) -> list[check.Row]:
    return [r for r in report.rows if r.host == host and r.check == name]


def status(report: check.Report, host: str, name: str) -> str:
    (row,) = rows_of(report, host, name)
    return row.status


def test_parse_nvidia_smi_reads_index_name_driver_memory() -> None:
    assert [g["index"] for g in GPUS] == [0, 1]
    assert GPUS[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert GPUS[0]["driver"] == "570.86.15"
    assert GPUS[0]["memory_mib"] == 81559
    assert probe.parse_nvidia_smi("No devices were found\n") == []


def test_healthy_cluster_is_all_ok() -> None:
    spec = load_spec_text(SPEC).spec
    rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": facts()}))
    bad = [r for r in rep.rows if r.status != "ok"]
    assert bad == []
    assert rep.exit_code() == 0 and rep.diff() == {}
    assert {r.check for r in rep.rows if r.host == "10.0.0.2"} >= {
        "ssh", "port 29500", "python env", "interface", "clock", "gpus", "ulimit -n", "/dev/shm", "disk",
        "torch", "workdir hash", "packages",
    }  # fmt: skip


def test_node_that_differs_from_the_chief_is_the_one_reported() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    odd = facts(workdir={"exists": True, "hash": "zzz"})
    odd["env"] = {**odd["env"], "torch": "2.12.0", "packages": {"torch": "2.12.0", "numpy": "2.1.0"}}
    rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": facts(), "10.0.0.3": odd}))
    assert status(rep, "10.0.0.3", "torch") == "fail"
    assert "2.12.0 here, 2.13.0 on the chief" in rows_of(rep, "10.0.0.3", "torch")[0].detail
    assert status(rep, "10.0.0.3", "workdir hash") == "fail"
    assert status(rep, "10.0.0.3", "packages") == "fail"
    assert status(rep, "10.0.0.2", "torch") == "ok"
    assert rep.diff()["torch"] == {"10.0.0.1": "2.13.0", "10.0.0.2": "2.13.0", "10.0.0.3": "2.12.0"}
    assert rep.diff()["pkg torch"]["10.0.0.3"] == "2.12.0"
    assert rep.exit_code() == 1


def test_ssh_failure_from_the_chief_names_the_host_and_reason() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    res = result({"10.0.0.1": facts(), "10.0.0.2": facts()})
    res["nodes"]["10.0.0.3"] = {
        "ssh": {"ok": False, "error": "ssh: connect to host 10.0.0.3 port 22: Connection refused"}
    }
    rep = check.evaluate(spec, res)
    (row,) = rows_of(rep, "10.0.0.3", "ssh")
    assert row.status == "fail" and "Connection refused" in row.detail and "10.0.0.1" in row.detail
    assert rep.exit_code() == 1


def test_unreachable_chief_fails_everything_without_facts() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    rep = check.evaluate(spec, {"unreachable": "ssh from this machine to the chief 10.0.0.1 failed: timeout"})
    assert [r.status for r in rep.rows] == ["fail"] * 3
    assert "timeout" in rep.rows[0].detail


def test_blocked_port_and_taken_port() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    blocked = {"29500": {"ok": False, "error": "connect to 10.0.0.1:29500 timed out after 3s"}}
    res = result({h: facts(ports=blocked) for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3")})
    rep = check.evaluate(spec, res)
    assert all(status(rep, h, "port 29500") == "fail" for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    taken = result({h: facts() for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3")},
                   {"29500": {"error": "cannot listen on port 29500: Address already in use", "seen": []}})  # fmt: skip
    rep = check.evaluate(spec, taken)
    assert "Address already in use" in " ".join(r.detail for r in rows_of(rep, "10.0.0.1", "port 29500"))


def test_warnings_pass_unless_strict() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    warny = facts(nofile=[1024, 4096], shm_bytes=64 << 20, route={"dev": "docker0", "src": "172.17.0.2"},
                  ports={"29500": {"ok": True, "rtt_ms": 0.2, "offset_s": 2.5}})  # fmt: skip
    rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": warny, "10.0.0.3": facts()}))
    for name in ("ulimit -n", "/dev/shm", "interface", "clock"):
        assert status(rep, "10.0.0.2", name) == "warn", name
    assert rep.worst() == "warn"
    assert rep.exit_code() == 0 and rep.exit_code(strict=True) == 1


def test_interface_disagreeing_with_nccl_socket_ifname_warns() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    f = facts()
    f["env"] = {**f["env"], "ifnames": {"NCCL_SOCKET_IFNAME": "ib0"}}
    rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": f, "10.0.0.3": facts()}))
    assert status(rep, "10.0.0.2", "interface") == "warn"
    assert check._ifname_matches("eth0", "eth") and check._ifname_matches("eth0", "=eth0")
    assert not check._ifname_matches("eth0", "^eth,lo") and check._ifname_matches("ens5", "^docker,lo")


def test_gpu_rules() -> None:
    spec = load_spec_text(SPEC).spec

    def gpu_status(**over: Any) -> tuple[str, str]:
        f = facts(**over)
        rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": f}))
        (row,) = rows_of(rep, "10.0.0.2", "gpus")
        return row.status, row.detail

    assert gpu_status()[0] == "ok"
    s, d = gpu_status(nvidia_smi={"rc": 127, "gpus": [], "error": ["nvidia-smi: not found"]})
    assert s == "fail" and "not installed" in d
    s, d = gpu_status(nvidia_smi={"rc": 0, "gpus": GPUS[:1], "error": []})
    assert s == "fail" and "missing [1]" in d
    cpu_torch = facts()
    cpu_torch["env"] = {**cpu_torch["env"], "cuda_devices": 0, "torch_cuda": None}
    s, d = gpu_status(env=cpu_torch["env"])
    assert s == "fail" and "torch sees 0" in d


def test_missing_venv_and_workdir_fail() -> None:
    spec = load_spec_text(SPEC).spec
    f = facts(env={"error": "bash: line 3: /home/u/.venvs/train/bin/activate: No such file or directory", "exit": 1},
              workdir={"exists": False})  # fmt: skip
    rep = check.evaluate(spec, result({"10.0.0.1": facts(), "10.0.0.2": f}))
    assert status(rep, "10.0.0.2", "python env") == "fail"
    assert "No such file" in rows_of(rep, "10.0.0.2", "python env")[0].detail
    assert status(rep, "10.0.0.2", "workdir") == "fail"


def test_json_report_shape() -> None:
    spec = load_spec_text(CPU_SPEC).spec
    rep = check.evaluate(spec, result({h: facts() for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}))
    doc = json.loads(json.dumps(rep.to_json()))
    assert (
        doc["status"] == "ok" and doc["exit_code"] == 0 and list(doc["hosts"]) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    )
    assert {"host", "check", "status", "detail"} == set(doc["hosts"]["10.0.0.2"][0])


def test_tree_hash_sees_content_and_skips_excluded(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("print(1)\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref\n")
    first = probe.tree_hash(str(tmp_path), [".git"])
    (tmp_path / ".git" / "HEAD").write_text("other\n")
    assert probe.tree_hash(str(tmp_path), [".git"]) == first
    (tmp_path / "a" / "x.py").write_text("print(2)\n")  # same size, new content
    assert probe.tree_hash(str(tmp_path), [".git"])["hash"] != first["hash"]
    assert probe.tree_hash(str(tmp_path), [".git"], budget=0)["exact"] is False


def srun_messages(output: str, limit: int = 1024) -> list[str]:
    """A task's output as slurmstepd forwards it: whole lines, a line longer than ``limit`` bytes
    cut into pieces of ``limit`` (Slurm's MAX_MSG_LEN)."""
    out: list[str] = []
    for line in output.splitlines(keepends=True):
        out += [line[i : i + limit] for i in range(0, len(line), limit)]
    return out


@given(st.lists(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=400), max_size=12),
                min_size=1, max_size=5), st.randoms(use_true_random=False))  # fmt: skip
def test_probe_documents_survive_srun_cutting_and_interleaving(docs: list[dict[str, str]], rnd: Any) -> None:
    """What failed a CI run: three nodes' facts through one srun step, one line cut at 1,024 bytes
    and the pieces interleaved with another task's. Frames come back whole, whatever the order."""
    queues = [srun_messages(f"noise from task {i}\n" + probe.frames(d)) for i, d in enumerate(docs)]
    merged: list[str] = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        merged.append(q.pop(0))
    got = probe.documents("".join(merged))
    assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, docs))
    assert all(len(m.encode()) <= 1024 for d in docs for m in probe.frames(d).splitlines(keepends=True))


def test_probe_documents_skip_a_document_with_a_frame_missing() -> None:
    lines = probe.frames({"k": "v" * 3000}).splitlines(keepends=True)
    assert len(lines) > 1
    assert probe.documents("".join(lines[:-1])) == []
    assert probe.documents("".join(lines)) == [{"k": "v" * 3000}]


def test_probe_boots_from_stdin_and_reports_a_real_listener(tmp_path: Path) -> None:
    """The chief mode against this machine alone: bootstrap over stdin, listen, connect, report.
    Only the local leg (no ssh): the node probe is run as the chief would run it, without ssh."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = Path(probe.__file__).read_text()
    lst = probe.Listener(port, "n0nce")
    try:
        plan = {"mode": "node", "name": "me", "nonce": "n0nce", "ports": [port], "chief_address": "127.0.0.1",
                "workdir": str(tmp_path), "exclude": [], "activate": "", "fast": True, "env_file": ""}  # fmt: skip
        p = subprocess.run([sys.executable, "-c", probe.BOOT], input=json.dumps({"source": src, "plan": plan}),
                           capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    finally:
        lst.close()
    (f,) = probe.documents(p.stdout)
    assert f["ports"][str(port)]["ok"] is True
    assert lst.seen == ["me"]
    assert f["env"]["python"].count(".") == 2
    taken = probe.Listener(port, "x")
    try:
        again = probe.Listener(port, "y")
        assert "cannot listen on port" in again.error
    finally:
        taken.close()
    assert f["workdir"] == {"exists": True}  # fast mode: no hash


def test_the_runner_s_own_commands_are_looked_for_where_it_needs_them() -> None:
    assert check.runner_commands("torchrun", chief=True) == []
    assert check.runner_commands("mpirun", chief=False) == ["mpirun"]  # Open MPI's daemons start on every node
    assert check.runner_commands("deepspeed", chief=True) == ["deepspeed", "pdsh"]
    assert check.runner_commands("deepspeed", chief=False) == []
    loaded = load_spec_text(CPU_SPEC + "launch: {runner: deepspeed}\n")
    nodes = check.plan(loaded, fast=True)["nodes"]
    assert [n["plan"]["commands"] for n in nodes] == [["deepspeed", "pdsh"], [], []]


def test_a_node_without_mpirun_fails_the_runner_row_naming_where_it_comes_from() -> None:
    spec = load_spec_text(CPU_SPEC + "launch: {runner: mpirun}\n").spec

    def with_mpirun(path: str) -> dict[str, Any]:
        f = facts()
        f["env"] = {**f["env"], "commands": {"mpirun": path}}
        return f

    rep = check.evaluate(spec, result({"10.0.0.1": with_mpirun("/usr/bin/mpirun"), "10.0.0.2": with_mpirun(""),
                                       "10.0.0.3": with_mpirun("/usr/bin/mpirun")}), fast=True)  # fmt: skip
    assert status(rep, "10.0.0.1", "runner") == "ok"
    (row,) = rows_of(rep, "10.0.0.2", "runner")
    assert row.status == "fail" and "launch.runner mpirun needs mpirun, not found" in row.detail
    assert "openmpi-bin, which setup installs (`nodeops setup SPEC --tags packages`)" in row.detail
    assert rep.exit_code() == 1


def test_the_probe_finds_commands_as_the_job_would() -> None:
    """probe.env_facts for real: bash, the activation, then the env script's lookup (here: no
    env file, no venv, so this machine's PATH)."""
    got = probe.env_facts({"commands": ["sh", "nodeops-surely-not-a-command"], "fast": True})
    assert got["commands"]["sh"].endswith("/sh") and got["commands"]["nodeops-surely-not-a-command"] == ""


def test_a_chief_whose_open_files_cannot_hold_the_supervisor_fails() -> None:
    """The supervisor keeps one ssh per node for the whole run: 1000 nodes need ~3,064 fds."""
    (row,) = check.chief_fd_rows("node1", {"nofile": [1024, 4096]}, 1000)
    assert (row.host, row.check, row.status) == ("node1", "supervisor fds", check.FAIL)
    assert "ulimit -n 1024" in row.detail and "1000 nodes" in row.detail and "limits.conf" in row.detail
    # as a job gets it: env.sh raises soft to hard, and that is what the probe reads in the env
    assert check.chief_fd_rows("node1", {"nofile": [1024, 1048576], "env": {"nofile": [1048576, 1048576]}}, 1000) == []
    assert check.chief_fd_rows("node1", {"nofile": [1024, 1024]}, 64) == []
    assert check.chief_fd_rows("node1", None, 1000) == []


def test_a_neighbour_table_too_small_for_the_cluster_warns_with_the_sysctl() -> None:
    """Issue 43: on one flat network each peer takes a neighbour (ARP) entry; past gc_thresh3 new
    connections fail with 'No route to host' (the 64-node sandbox met it on one shared kernel).
    The peers are the spec's nodes in the subnet of the node's interface to the chief."""
    v4 = {"limit": 1024, "family": "ipv4"}
    flat = facts(neigh=v4, route={"dev": "ens5", "src": "10.0.0.2", "net": "10.0.0.2/16"})
    many = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(999)]
    (row,) = check.neighbour_rows("n2", flat, many[:63])
    assert row.status == "ok" and "gc_thresh3 1024" in row.detail and "63 peer(s) in ens5's subnet" in row.detail
    (row,) = check.neighbour_rows("n2", flat, many)
    assert row.status == "warn", row
    assert "999 peer(s)" in row.detail and "No route to host" in row.detail and "/etc/sysctl.d/" in row.detail
    assert "sysctl -w net.ipv4.neigh.default.gc_thresh3=2254 " in row.detail, row.detail
    # racks of /24s behind routers: only the node's own rack counts
    rack = facts(neigh=v4, route={"dev": "ens5", "src": "10.0.1.2", "net": "10.0.1.2/24"})
    (row,) = check.neighbour_rows("n2", rack, many)
    assert row.status == "ok" and "250 peer(s) in ens5's subnet 10.0.1.0/24" in row.detail, row.detail
    # names are counted as peers (where they are is not known); no subnet known: every node
    (row,) = check.neighbour_rows("n2", rack, ["gpu-1", "gpu-2", "10.0.9.9"])
    assert "2 peer(s)" in row.detail
    nonet = facts(neigh=v4, route={"dev": "ens5", "src": "10.0.0.2"})
    assert check.neighbour_rows("n2", nonet, many)[0].status == "warn"
    # the ranks use another interface than the route to the chief: the limit is the kernel's,
    # for every interface together, so every node counts
    (row,) = check.neighbour_rows("n2", rack, many, "ib0")
    assert "999 peer(s)" in row.detail and "NCCL/gloo use ib0, not ens5" in row.detail, row.detail
    assert "250 peer(s)" in check.neighbour_rows("n2", rack, many, "ens")[0].detail  # a prefix that matches
    # the family the probe read names the sysctl
    v6 = facts(neigh={"limit": 1024, "family": "ipv6"}, route={"dev": "ens5", "src": "", "net": ""})
    assert "net.ipv6.neigh.default.gc_thresh3=" in check.neighbour_rows("n2", v6, many)[0].detail
    # not visible (a container's network namespace), or no route: no row rather than a guess
    assert check.neighbour_rows("n2", facts(neigh=None), many) == []
    assert check.neighbour_rows("n2", facts(neigh=v4, route={"error": "x"}), many) == []
    # evaluate() carries the row for each node that shows its limit
    spec = load_spec_text(CPU_SPEC).spec
    small = facts(neigh={"limit": 1, "family": "ipv4"})
    rep = check.evaluate(spec, result({"10.0.0.1": facts(neigh=v4), "10.0.0.2": small, "10.0.0.3": facts()}))
    assert status(rep, "10.0.0.1", "neighbours") == "ok" and status(rep, "10.0.0.2", "neighbours") == "warn"
    assert "2 peer(s)" in rows_of(rep, "10.0.0.1", "neighbours")[0].detail
    assert rows_of(rep, "10.0.0.3", "neighbours") == []


def test_the_probe_reads_the_kernels_neighbour_limit_and_none_inside_a_network_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real /proc of this machine; then a new network namespace (as a container's), which
    does not show the limit."""
    if shutil.which("ip") is None:
        pytest.skip("no iproute2 here")
    # the subnet the peers are counted in: the interface's own address and prefix (`ip -j addr`)
    assert probe.route_to("127.0.0.1") == {"dev": "lo", "src": "127.0.0.1", "net": "127.0.0.1/8"}
    # launch's fast preflight asks no subnet: one `ip` call fewer on every node (the chief's own
    # route, via lo, still looks up the interface that holds its address)
    calls: list[list[str]] = []
    real = probe._run
    monkeypatch.setattr(probe, "_run", lambda argv, *a, **k: calls.append(argv) or real(argv, *a, **k))
    assert probe.route_to("127.0.0.1", subnet=False)["dev"] == "lo"
    fast = probe.route_to("192.0.2.77", subnet=False)
    if "error" not in fast:  # a machine with a route there
        assert fast["net"] == "" and calls[-1][:3] == ["ip", "-j", "route"], calls
    monkeypatch.undo()
    # a chief named by DNS: resolved first, as the ranks will (`ip route get` takes no names)
    assert probe.route_to("localhost")["dev"] == "lo"
    # an iproute2 whose JSON is broken: no subnet, not a failed probe
    real = probe._run
    monkeypatch.setattr(probe, "_run", lambda argv, *a, **k: (0, "[{", "") if "addr" in argv else real(argv, *a, **k))
    assert probe.route_to("127.0.0.1")["net"] == ""
    monkeypatch.undo()
    knob = Path("/proc/sys/net/ipv4/neigh/default/gc_thresh3")
    if knob.exists():
        assert probe.neighbour_limit("10.0.0.1") == {"limit": int(knob.read_text()), "family": "ipv4"}
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    code = f"import sys; sys.path.insert(0, {str(Path(probe.__file__).parent)!r}); import probe; " \
           "print(probe.neighbour_limit('10.0.0.1'))"  # fmt: skip
    p = subprocess.run(["unshare", "--net", "--map-root-user", sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    if p.returncode != 0 and "unshare" in p.stderr:
        pytest.skip(f"no network namespace here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "None"
