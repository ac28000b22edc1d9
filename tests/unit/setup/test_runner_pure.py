"""Pure parts of the runner: fork sizing, the generated ansible.cfg, error extraction."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeops import resources, transport
from nodeops.setup import fast, runner


@pytest.mark.parametrize(
    ("hosts", "fd_limit", "forks"),
    [(4, 1024, 4), (1000, 1_048_576, runner.MAX_FORKS), (200, 1024, (1024 - runner.FDS_RESERVED) // 12), (1, 10, 1)],
)
def test_forks_follow_hosts_cap_and_fd_limit(hosts: int, fd_limit: int, forks: int) -> None:
    assert runner.forks_for(hosts, fd_limit) == forks


def test_fd_limit_is_raised_to_hard_limit() -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = runner.raise_fd_limit()
    assert soft == (hard if hard != resource.RLIM_INFINITY else max(soft, 65536))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    assert soft >= 1024


def test_generated_cfg_keeps_host_keys_checked(tmp_path: Path) -> None:
    cfg = runner.ansible_cfg(8, tmp_path, None)
    assert "host_key_checking = True" in cfg
    assert "pipelining = True" in cfg and "ControlPersist" in cfg and "gathering = explicit" in cfg
    assert "forks = 8" in cfg
    assert "StrictHostKeyChecking" not in cfg and "strategy" not in cfg
    assert "strategy = mitogen_linear" in runner.ansible_cfg(8, tmp_path, tmp_path)


def test_unreachable_message_is_ssh_own_line() -> None:
    ssh_line = "ssh: connect to host 10.0.0.3 port 22: No route to host"
    res = {"msg": f"Task failed: EOF on stream; last 100 lines received:\n{ssh_line}"}
    assert runner._event_error(res) == ssh_line
    assert runner._event_error({"msg": "", "stderr": "boom\nmore"}) == "boom"


def test_inventory_hosts_in_order() -> None:
    inv = {"all": {"children": {"chief": {"hosts": {"a": {}}}, "workers": {"hosts": {"b": {}, "c": {}}}}}}
    assert runner._inventory_hosts(inv) == ["a", "b", "c"]


def test_mitogen_only_for_small_plays_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    installed = importlib.util.find_spec("ansible_mitogen") is not None
    monkeypatch.delenv("NODEOPS_MITOGEN", raising=False)
    assert (runner.mitogen_strategy_dir(runner.MITOGEN_MAX_HOSTS) is not None) == installed
    assert runner.mitogen_strategy_dir(runner.MITOGEN_MAX_HOSTS + 1) is None
    monkeypatch.setenv("NODEOPS_MITOGEN", "1")
    assert (runner.mitogen_strategy_dir(64) is not None) == installed
    monkeypatch.setenv("NODEOPS_MITOGEN", "yes")
    assert (runner.mitogen_strategy_dir(64) is not None) == installed
    for off in ("0", "off", "false"):
        monkeypatch.setenv("NODEOPS_MITOGEN", off)
        assert runner.mitogen_strategy_dir(1) is None


def test_root_cause_prefers_a_real_exit_over_a_signal_death() -> None:
    from collections import deque

    from nodeops.node.failures import HostState, root_cause

    aborted = HostState("node1", exit_code=1, ended_at=1.0, tail=deque(["  exitcode  : -6 (pid: 9)  (SIGABRT)"]))
    real = HostState("node3", exit_code=1, ended_at=2.0, tail=deque(["  exitcode  : 1 (pid: 7)"]))
    ok = HostState("node2", exit_code=0, ended_at=0.5)
    assert root_cause([aborted, real, ok]) is real
    assert root_cause([aborted, ok]) is aborted
    assert root_cause([ok]) is None


def test_root_cause_skips_hosts_that_only_lost_a_peer() -> None:
    """DeepSpeed/pdsh order: node2's rank saw gloo's "Connection closed by peer" and was reported
    before node3, whose rank failed by itself."""
    from nodeops.node.failures import HostState, root_cause

    victim = HostState("node2", exit_code=1, ended_at=1.0)
    victim.tail.append("RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.13]:44693. This is typically")
    culprit = HostState("node3", exit_code=1, ended_at=2.0)
    culprit.tail.append("rank 2: failing on purpose at step 5")
    assert root_cause([victim, culprit]) is culprit


def test_root_cause_ci_race_victim_first_culprit_stopped() -> None:
    """The race CI hit: node1's rank lost its peer and aborted (SIGABRT), its report came first,
    and the supervisor's stop reached node3 after its rank had exited 1 by itself."""
    from nodeops.node.failures import HostState, root_cause

    victim = HostState("node1", exit_code=1, ended_at=1.0)
    victim.tail.extend(["[rank0]:[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [10.214.0.13]:17112.",
                        "E1122 20:53:47.533000 1474 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                        "(exitcode: -6) local_rank: 0 (pid: 1540) of binary: python3",
                        "  exitcode  : -6 (pid: 1540)  (SIGABRT)"])  # fmt: skip
    culprit = HostState("node3", exit_code=-1, ended_at=2.0, stopped=True)
    culprit.tail.extend(["rank 2: failing on purpose at step 3",
                         "E1122 20:53:47.431000 977 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                         "(exitcode: 1) local_rank: 0 (pid: 1100) of binary: python3"])  # fmt: skip
    bystander = HostState("node2", exit_code=-1, ended_at=2.0, stopped=True)
    bystander.tail.append("E1122 20:53:48.0 80 torch/distributed/elastic/agent/server/api.py:1] failed (exitcode: -15)"
                          " local_rank: 0 (pid: 9) of binary: python3")  # fmt: skip
    # the supervisor named node3 (its guard reported exit code 1 before the stop came)
    assert root_cause([victim, culprit, bystander], named="node3") is culprit
    # a stopped host the supervisor did not name is never the cause, whatever its lines say
    assert root_cause([victim, culprit, bystander], named="node1") is victim
    assert root_cause([victim, bystander], named="") is victim


def test_failure_lines_puts_the_ranks_own_lines_first() -> None:
    from nodeops.node.failures import failure_lines

    tail = ["step 1 loss 0.5", "W1122 20:53:40.1 11 torch/distributed/run.py:792] Setting OMP_NUM_THREADS",
            "rank 2: failing on purpose at step 3",
            "E1122 20:53:47.4 977 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
            "local_rank: 0 (pid: 1100) of binary: python3",
            "Traceback (most recent call last):", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
            "  exitcode  : 1 (pid: 1100)"]  # fmt: skip
    own, summary = failure_lines(tail)
    assert own == ["step 1 loss 0.5", "rank 2: failing on purpose at step 3"]
    assert summary[0].endswith("of binary: python3") and summary[-1] == "  exitcode  : 1 (pid: 1100)"
    assert failure_lines(["a", "b"]) == (["a", "b"], [])  # no torchrun: every line is the job's
    # NCCL_DEBUG=INFO lines (teardown chatter after the traceback) never push the traceback out
    nccl = [f"[rank1]:n2:77:90 [0] NCCL INFO comm 0x55 rank 1 nranks 2 - Abort COMPLETE {i}" for i in range(40)]
    own, _ = failure_lines(["[rank1]:Traceback (most recent call last):", "[rank1]:ValueError: boom", *nccl])
    assert own == ["[rank1]:Traceback (most recent call last):", "[rank1]:ValueError: boom"]
    late = failure_lines([tail[3], "[rank2]:Traceback (most recent call last):", "  exitcode  : 1"])
    assert late == (["[rank2]:Traceback (most recent call last):"], [tail[3], "  exitcode  : 1"])
    assert len(failure_lines([str(i) for i in range(100)])[0]) == 20


def test_blamed_peer_becomes_the_root_cause_when_pdsh_never_reported_it() -> None:
    from collections import deque

    from nodeops.node.failures import HostState, blame_peers, root_cause

    victim = HostState("node2", exit_code=1, ended_at=1.0)
    victim.tail.append("[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.13]:44693.")
    states = {"node1": HostState("node1", exit_code=-1, ended_at=1.5), "node2": victim}
    ds_exit = "[ERROR] [launch.py:259:sigkill_handler] ['python'] exits with return code = 1"
    tails = {"10.0.0.13": deque(["rank 2: failing on purpose at step 5", ds_exit])}
    blame_peers(states, tails, {"10.0.0.11": "node1", "10.0.0.12": "node2", "10.0.0.13": "node3"})
    assert states["node3"].exit_code == 1
    assert "failing on purpose" in states["node3"].tail[0]
    assert root_cause(list(states.values())) is states["node3"]


def test_a_stopped_culprit_keeps_its_ranks_exit_code() -> None:
    """A victim's torchrun may report first; fail-fast then stops the culprit's job too, and its
    rank's own code comes from torchrun's line."""
    from nodeops.backends.ssh.run import JobResult
    from nodeops.node.failures import HostState, failure_code

    culprit = HostState("node3", exit_code=-1, ended_at=2.0)
    culprit.tail.append("E1122 api.py:1002] failed (exitcode: 7) local_rank: 0 (pid: 631) of binary: python3")
    assert failure_code(culprit) == 7
    assert failure_code(HostState("n", exit_code=-1)) is None
    assert JobResult("r", {"node3": culprit}, culprit, False, None).exit_code == 7


def test_event_error_of_a_loop_names_only_the_failed_items() -> None:
    from nodeops.setup.runner import _event_error

    res = {"msg": "One or more items failed", "results": [
        {"failed": False, "msg": "All assertions passed"},
        {"failed": True, "msg": "shared_path: shared_path_path must be absolute (got 'x')"},
    ]}  # fmt: skip
    assert _event_error(res) == "shared_path: shared_path_path must be absolute (got 'x')"
    # the same reason for every item (an unreachable node) is said once
    dead = {"failed": True, "msg": "Data could not be sent\nssh: connect to host 10.0.0.4 port 22: No route to host"}
    res = {"msg": "One or more items failed", "results": [dead] * 5 + [{"failed": True, "msg": "other"}]}
    assert _event_error(res) == "ssh: connect to host 10.0.0.4 port 22: No route to host (5 items); other"


def test_the_reasons_roles_run_say_each_reason_once() -> None:
    dead = "the probe could not read the node (ssh: connect to host 10.0.0.4 port 22: No route to host)"
    assert fast.reasons({"packages": dead, "ssh_mesh": dead, "python_env": "new"}) == (
        f"packages, ssh_mesh: {dead}; python_env: new"
    )


def test_each_source_tree_gets_its_own_collection_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two trees under one home (a clone beside a checkout, CI's rehearsal beside the work) once
    # shared one link and turned it to and fro, failing the other's play mid-run.
    mine = resources.collections_path(tmp_path)
    assert (mine / "ansible_collections/nodeops/cluster").resolve() == resources.collection_root().resolve()
    other = tmp_path / "other-tree"
    (other / "roles").mkdir(parents=True)
    monkeypatch.setattr(resources, "collection_root", lambda: other)
    theirs = resources.collections_path(tmp_path)
    assert theirs != mine and theirs.parent == mine.parent == tmp_path
    assert (theirs / "ansible_collections/nodeops/cluster").resolve() == other.resolve()
    monkeypatch.undo()
    assert resources.collections_path(tmp_path) == mine  # the first link was never touched
    assert (mine / "ansible_collections/nodeops/cluster").resolve() == resources.collection_root().resolve()


def test_ssh_sockets_fit_a_unix_socket_path_or_go_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ControlPath of more than 86 bytes fails every ssh ("unix_listener: path ... too long for
    Unix domain socket"): CI met it with NODEOPS_HOME under pytest's temp dir, %C's 40 hex digits
    and ssh's 17-character temp suffix (108 bytes)."""
    from ansible.plugins.connection.ssh import Connection

    met = "/tmp/pytest-of-root/pytest-109/home0/cp/53232bc85f/76b75e0a51f9e7e44e50d880bff3e4b4e0b7c1d0"
    assert len(met) + transport.MUX_SUFFIX == 108 and not transport.fits_control_path(met)
    assert transport.fits_control_path("/" + "x" * (transport.SOCKET_PATH_MAX - transport.MUX_SUFFIX - 1))
    assert not transport.fits_control_path("/" + "x" * (transport.SOCKET_PATH_MAX - transport.MUX_SUFFIX))
    # ~ is the home ssh uses (the passwd entry), not $HOME
    monkeypatch.setattr(transport, "ssh_home", lambda: "/h")
    monkeypatch.setenv("HOME", "/" + "x" * 200)
    assert transport.fits_control_path("~/.ssh/nodeops-0123456789abcdef")
    # Ansible names each host's socket itself when ansible.cfg sets no control_path: 10 hex digits
    name = Connection._create_control_path("10.0.0.1", 22, "debian") % {"directory": ""}
    assert len(name.lstrip("/")) == runner.CONTROL_NAME
    cfg = runner.ansible_cfg(8, tmp_path, None)
    assert "control_path =" not in cfg and f"control_path_dir = {tmp_path}" in cfg

    # the usual place, NODEOPS_HOME/cp/<identity>, where it fits; as Ansible resolves it (links)
    made: list[Path] = []

    def private() -> Iterator[Path]:
        made.append(Path("/tmp/nodeops-1000"))
        yield made[-1]

    monkeypatch.setattr(runner, "short_private_dirs", private)
    monkeypatch.setenv("NODEOPS_HOME", "/tmp/nh-short")
    monkeypatch.setattr(Path, "mkdir", lambda *a, **k: None)
    assert runner.control_dir_for("0123456789") == Path("/tmp/nh-short/cp/0123456789")
    assert made == []  # a private dir is made only when needed
    # a short NODEOPS_HOME that links to a long dir: Ansible would use the long one
    monkeypatch.undo()  # a real mkdir below
    monkeypatch.setattr(runner, "short_private_dirs", private)
    long_dir = tmp_path / ("l" * 60)
    long_dir.mkdir()
    link = Path("/tmp") / f"nh-link-{os.getpid()}"
    link.symlink_to(long_dir)
    try:
        monkeypatch.setenv("NODEOPS_HOME", str(link))
        monkeypatch.setattr(Path, "mkdir", lambda *a, **k: None)
        assert runner.control_dir_for("0123456789") == Path("/tmp/nodeops-1000/cp/0123456789")
    finally:
        link.unlink()
    # a long home: a private short dir; none: no masters at all, and ansible.cfg says so
    monkeypatch.setenv("NODEOPS_HOME", "/home/" + "x" * 60)
    assert runner.control_dir_for("0123456789") == Path("/tmp/nodeops-1000/cp/0123456789")
    monkeypatch.setattr(runner, "short_private_dirs", lambda: iter(()))
    assert runner.control_dir_for("0123456789") is None
    cfg = runner.ansible_cfg(8, None, None)
    assert "ControlMaster=no" in cfg and "ControlPersist" not in cfg and "control_path_dir" not in cfg


def test_a_private_dir_is_used_only_when_it_is_this_users_and_closed(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    assert transport.own_dir(d) == d and (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o777)  # open to others: a socket there could be another user's
    assert transport.own_dir(d) is None
    d.rmdir()
    d.symlink_to(tmp_path)  # a link planted there
    assert transport.own_dir(d) is None
