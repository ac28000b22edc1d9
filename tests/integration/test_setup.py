"""`nodeops setup` on the 3-node sandbox, end to end: real CLI, real ansible-runner, real ssh,
a real torch 2.13.0 CPU wheelhouse installed offline on every node.

The tests in this module share one setup run (module fixture) and then look at the nodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from nodeops.resources import nodeops_home
from nodeops.sandbox import cluster as sandbox

from .conftest import NODEOPS, SECRET, USER_KEY_LINE, WORKDIR, setup, ssh, subnet_of, wheelhouse

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_first_setup_succeeds(first_run: subprocess.CompletedProcess[str]) -> None:
    assert first_run.returncode == 0, first_run.stdout + first_run.stderr
    assert "setup ok: 3 host(s)" in first_run.stderr


def test_chief_reaches_every_node_with_strict_host_keys(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    for node in sandbox_cluster.nodes:
        for target in (node.address, node.name):
            p = ssh(sandbox_cluster, "node1",
                    f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {target} uname -n")  # fmt: skip
            assert p.returncode == 0, p.stderr
            assert p.stdout.strip() == node.name


def test_torch_imports_in_the_venv_everywhere(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    for node in sandbox_cluster.nodes:
        p = ssh(sandbox_cluster, node.name, "~/.venvs/train/bin/python -c 'import torch; print(torch.__version__)'")
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == "2.13.0+cpu"


def test_workdir_is_identical_and_leaves_out_git(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    # The chief's workdir also holds .deepspeed_env, which nodeops manages there for DeepSpeed's
    # launcher and leaves out of sync and parity; everything else must be identical.
    cmd = f"cd {WORKDIR} && find . -type f ! -name .deepspeed_env | LC_ALL=C sort | xargs sha256sum | sha256sum"
    hashes = {n.name: ssh(sandbox_cluster, n.name, cmd).stdout for n in sandbox_cluster.nodes}
    assert len(set(hashes.values())) == 1, hashes
    listing = ssh(sandbox_cluster, "node3", f"cd {WORKDIR} && find . -type f | sort").stdout.split()
    assert "./train.py" in listing and "./data/config.json" in listing
    assert not any(f.startswith("./.git") for f in listing)


def test_env_file_names_the_interface_holding_the_address(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    for node in sandbox_cluster.nodes:
        show = 'echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $NCCL_IB_DISABLE $NCCL_DEBUG"'
        iface = f"ip -o -4 addr show | awk '$4 ~ /^{node.address}\\// {{print $2}}'"
        p = ssh(sandbox_cluster, node.name, f". ~/.nodeops/{sandbox_cluster.name}/env.sh && {show} && {iface}")
        words = p.stdout.split()
        assert words[:4] == [words[4], words[4], "1", "WARN"], p.stdout


def test_user_lines_are_kept_byte_for_byte(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    before = first_run.authorized_keys_before  # type: ignore[attr-defined]
    after = ssh(sandbox_cluster, "node2", "cat ~/.ssh/authorized_keys").stdout
    assert USER_KEY_LINE in before
    assert after.startswith(before), "existing authorized_keys content changed"
    assert re.search(r"# BEGIN nodeops ssh_mesh \S+\n.+\n# END nodeops ssh_mesh", after)


def test_secret_is_0600_on_nodes_and_absent_from_artifacts(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    p = ssh(sandbox_cluster, "node3", f"stat -c %a ~/.nodeops/{sandbox_cluster.name}/secrets.env; "
                                      f"grep -c {SECRET} ~/.nodeops/{sandbox_cluster.name}/env.sh")  # fmt: skip
    assert p.stdout.split() == ["600", "0"]
    run_dir = Path(re.findall(r"artifacts: (\S+)", first_run.stderr)[-1])  # type: ignore[attr-defined]
    assert run_dir.is_dir() and oct(run_dir.stat().st_mode & 0o777) == "0o700"
    leaks = [str(f) for f in run_dir.rglob("*") if f.is_file() and SECRET in f.read_text(errors="replace")]
    assert leaks == []
    assert not (run_dir / "secrets.yml").exists()
    assert SECRET not in first_run.stdout + first_run.stderr  # type: ignore[attr-defined]


def test_second_setup_changes_nothing(project: Path, first_run: object) -> None:
    # Converge to this spec first: other modules (launch's mpirun/deepspeed tests) run setup with
    # other specs on the same sandbox, so "second" means the one right after a converge.
    p = setup(project / "cluster.yaml", env={"NODEOPS_IT_SECRET": SECRET})
    assert p.returncode == 0, p.stderr
    t = time.monotonic()
    p = setup(project / "cluster.yaml", env={"NODEOPS_IT_SECRET": SECRET})
    print(f"second setup took {time.monotonic() - t:.1f}s")
    assert p.returncode == 0, p.stderr
    assert "setup ok: 3 host(s), 0 change(s)" in p.stderr, p.stderr
    for host in ("node1", "node2", "node3"):
        assert re.search(rf"│ {host} +│ \d+ +│ 0 +│ 0 +│ 0 +│", p.stderr), p.stderr


def ansible_runs() -> list[Path]:
    """The ansible-runner private data dirs setup left, oldest first: one per Ansible run."""
    d = nodeops_home() / "runs"
    return sorted((r for r in d.glob("setup-*") if (r / "artifacts").is_dir()), key=lambda r: r.stat().st_mtime)


def ansible_command(run: Path) -> list[str]:
    """The ansible-playbook command line ansible-runner recorded for a run."""
    cmd: list[str] = json.loads(next(run.glob("artifacts/*/command")).read_text())["command"]
    return cmd


def test_noop_setup_runs_no_play_and_full_runs_it(project: Path, first_run: object) -> None:
    """Issue 29: with nothing to change, setup probes the nodes and starts no Ansible at all (no
    new ansible-runner run dir appears); --full runs every role anyway."""
    env = {"NODEOPS_IT_SECRET": SECRET}
    assert setup(project / "cluster.yaml", env=env).returncode == 0
    before = ansible_runs()
    p = setup(project / "cluster.yaml", env=env)
    assert p.returncode == 0, p.stderr
    assert "setup ok: 3 host(s), 0 change(s)" in p.stderr, p.stderr
    assert "no Ansible play ran" in p.stderr and "artifacts:" not in p.stderr, p.stderr
    for host in ("node1", "node2", "node3"):
        assert re.search(rf"│ {host} +│ \d+ +│ 0 +│ 0 +│ 0 +│", p.stderr), p.stderr
    assert ansible_runs() == before
    p = setup(project / "cluster.yaml", "--full", env=env)
    assert p.returncode == 0, p.stderr
    assert "setup ok: 3 host(s), 0 change(s)" in p.stderr and "no Ansible play ran" not in p.stderr, p.stderr
    after = ansible_runs()
    assert len(after) == len(before) + 1
    assert not {"--tags", "--limit"} & set(ansible_command(after[-1]))


def fast_lines(stderr: str) -> dict[str, dict[str, str]]:
    """What the fast path said it runs: host -> role -> why (each reason once, after the roles
    it applies to: `nccl_env, deepspeed_env: its input changed; shared_path: ...`)."""
    out: dict[str, dict[str, str]] = {}
    for host, rest in re.findall(r"^    (node\d): (.+)$", stderr, re.M):
        for part in rest.split("; "):
            roles, _, why = part.partition(": ")
            for role in roles.split(", "):
                out.setdefault(host, {})[role] = why
    return out


def test_a_changed_role_input_runs_only_that_role(sandbox_cluster: sandbox.Sandbox, project: Path,
                                                   first_run: object) -> None:  # fmt: skip
    """Issue 29: a spec or controller-file change runs only the roles that read it: an env
    value (nccl_env), a secret's value (nccl_env, compared on the node, never recorded), a
    package (python_env), a workdir file on the controller (shared_path)."""
    env = {"NODEOPS_IT_SECRET": SECRET}
    spec = project / "cluster.yaml"
    original = spec.read_text()
    name = sandbox_cluster.name
    assert setup(spec, env=env).returncode == 0
    try:
        # The spec sits in the workdir's source dir (the default source), so editing it is also a
        # workdir change: shared_path copies cluster.yaml too.
        spec_file = {"shared_path": "1 file(s) differ from the source (cluster.yaml)"}
        cases = [
            # env values also go into the chief's .deepspeed_env (deepspeed_env runs on the chief only)
            ("OMP_NUM_THREADS", lambda: spec.write_text(original.replace("OMP_NUM_THREADS: 1", "OMP_NUM_THREADS: 2")),
             env, {"nccl_env": "its input changed", **spec_file, "deepspeed_env@node1": "its input changed"}),
            ("secret", lambda: None, {"NODEOPS_IT_SECRET": SECRET + "-rotated"},
             {"nccl_env": "secrets.env does not hold the spec's secret values"}),
            ("package", lambda: spec.write_text(original.replace("numpy]", "numpy, filelock]")), env,
             {"python_env": "its input changed", **spec_file}),
            ("workdir file", lambda: (project / "train.py").write_text("print('train v2')\n"), env,
             {"shared_path": "1 file(s) differ from the source (train.py)"}),
        ]  # fmt: skip
        for what, change, case_env, expected in cases:
            spec.write_text(original)
            assert setup(spec, env=env).returncode == 0  # each case starts from the converged cluster
            change()
            p = setup(spec, env=case_env)
            assert p.returncode == 0, (what, p.stderr)
            said = fast_lines(p.stderr)
            assert set(said) == {"node1", "node2", "node3"}, (what, p.stderr)
            for host, roles in said.items():
                want = {r.split("@")[0]: why for r, why in expected.items() if r.split("@")[-1] in (r, host)}
                assert set(roles) == set(want), (what, host, said)
                assert all(why in roles[role] for role, why in want.items()), (what, said)
            cmd = ansible_command(ansible_runs()[-1])
            tags = {r.split("@")[0] for r in expected}
            assert set(cmd[cmd.index("--tags") + 1].split(",")) == tags and "--limit" not in cmd, (what, cmd)
            assert re.search(r"setup ok: 3 host\(s\), [1-9]\d* change\(s\)", p.stderr), (what, p.stderr)
            again = setup(spec, env=case_env)
            assert "no Ansible play ran" in again.stderr, (what, again.stderr)
            if what == "secret":
                got = ssh(sandbox_cluster, "node3", f"grep -c -- '{SECRET}-rotated' ~/.nodeops/{name}/secrets.env")
                assert got.stdout.strip() == "1", got
        assert ssh(sandbox_cluster, "node3", f"cat {WORKDIR}/train.py").stdout == "print('train v2')\n"
        assert SECRET not in json.dumps(json.loads((nodeops_home() / "clusters" / name / "setup.json").read_text()))
    finally:
        spec.write_text(original)
        (project / "train.py").write_text("print('train')\n")
        assert setup(spec, env=env).returncode == 0


SAVE_CKPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:  # as most training scripts do: rank 0 writes into the working dir
    os.makedirs("checkpoints", exist_ok=True)
    torch.save({"w": torch.ones(3)}, "checkpoints/model.pt")
    with open("train.log", "w") as f:
        f.write("step 1 loss 0.5\\n")
dist.barrier()
dist.destroy_process_group()
"""


def test_job_outputs_never_break_setup_or_check(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    """Issue 12: a job's outputs in the chief's workdir used to fail every later setup (parity
    hashed the whole dir). Now nodes are compared with the source; outputs are kept."""
    env = {"NODEOPS_IT_SECRET": SECRET}
    (project / "save_ckpt.py").write_text(SAVE_CKPT)
    try:
        assert setup(project / "cluster.yaml", env=env).returncode == 0
        p = subprocess.run([NODEOPS, "launch", str(project / "cluster.yaml"), "--", "save_ckpt.py"],
                           capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, **env})  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        outputs = f"sha256sum {WORKDIR}/checkpoints/model.pt {WORKDIR}/train.log"
        before = ssh(sandbox_cluster, "node1", outputs)
        assert before.returncode == 0, before.stderr
        p = setup(project / "cluster.yaml", env=env)
        assert p.returncode == 0, p.stderr
        assert "setup ok: 3 host(s), 0 change(s)" in p.stderr, p.stderr
        c = subprocess.run([NODEOPS, "check", str(project / "cluster.yaml"), "--json"], capture_output=True,
                           text=True, timeout=300, check=False, env={**os.environ, **env})  # fmt: skip
        assert c.returncode == 0, c.stdout + c.stderr
        hosts = json.loads(c.stdout)["hosts"]
        workdir = {h: next(r for r in rows if r["check"] == "workdir") for h, rows in hosts.items()}
        assert all(r["status"] == "ok" for r in workdir.values()), workdir
        assert "2 file(s) only here (outputs, kept)" in workdir["node1"]["detail"], workdir
        assert ssh(sandbox_cluster, "node1", outputs).stdout == before.stdout  # kept byte for byte
    finally:
        (project / "save_ckpt.py").unlink()
        ssh(sandbox_cluster, "node1", f"rm -rf {WORKDIR}/checkpoints {WORKDIR}/train.log")


def test_drift_on_one_node_is_detected_and_repaired(sandbox_cluster: sandbox.Sandbox, project: Path,
                                                    first_run: object) -> None:  # fmt: skip
    """A no-op re-run reads less, but still finds and repairs drift: a changed env file, a
    missing key line, a changed package and a changed workdir file, each on one node."""
    env = {"NODEOPS_IT_SECRET": SECRET}
    assert setup(project / "cluster.yaml", env=env).returncode == 0
    sb, name = sandbox_cluster, sandbox_cluster.name
    env_sh = f"~/.nodeops/{name}/env.sh"
    good_env = ssh(sb, "node2", f"cat {env_sh}").stdout
    assert ssh(sb, "node2", f"echo 'export OOPS=1' >> {env_sh}").returncode == 0
    assert ssh(sb, "node3", f"sed -i '/nodeops-{name}@node1$/d' ~/.ssh/authorized_keys").returncode == 0
    assert ssh(sb, "node3", "~/.venvs/train/bin/python -m pip uninstall -y -q filelock").returncode == 0
    assert ssh(sb, "node2", f"echo tampered > {WORKDIR}/train.py").returncode == 0
    # Issue 17, item 4: --check --diff shows the drift as a diff, per host, and changes nothing.
    p = setup(project / "cluster.yaml", "--check", "--diff", env=env)
    assert p.returncode == 0, p.stderr
    assert re.search(r"node2: .*\n--- \S+/env\.sh \(now\)\n\+\+\+ \S+/env\.sh \(wanted\)\n", p.stderr), p.stderr
    assert "\n-export OOPS=1\n" in p.stderr and "(check mode: none made)" in p.stderr
    assert SECRET not in p.stderr  # secrets.env is never diffed
    assert "export OOPS=1" in ssh(sb, "node2", f"cat {env_sh}").stdout
    p = setup(project / "cluster.yaml", env=env)
    assert p.returncode == 0, p.stderr
    # Issue 29: the probe saw each drift, and Ansible ran only where it did (and on the chief,
    # whose key ssh_mesh writes into node3's authorized_keys).
    said = fast_lines(p.stderr)
    assert set(said) == {"node2", "node3"}, p.stderr
    assert said["node2"]["nccl_env"] == "the node changed since setup left it", said
    assert "1 file(s) differ from the source (train.py)" in said["node2"]["shared_path"], said
    assert set(said["node3"]) == {"ssh_mesh", "python_env"}, said
    assert said["node3"]["python_env"] == "its packages changed since setup installed them", said
    cmd = ansible_command(ansible_runs()[-1])
    assert "--limit" not in cmd and set(cmd[cmd.index("--tags") + 1].split(",")) == {
        "nccl_env",
        "shared_path",
        "ssh_mesh",
        "python_env",
    }, cmd
    assert re.search(r"│ node2 +│ \d+ +│ [1-9]", p.stderr) and re.search(r"│ node3 +│ \d+ +│ [1-9]", p.stderr), p.stderr
    assert ssh(sb, "node2", f"cat {env_sh}").stdout == good_env
    assert ssh(sb, "node1", "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes node3 true").returncode == 0
    assert ssh(sb, "node3", "~/.venvs/train/bin/python -c 'import filelock'").returncode == 0
    assert ssh(sb, "node2", f"cat {WORKDIR}/train.py").stdout == (project / "train.py").read_text()
    p = setup(project / "cluster.yaml", env=env)
    assert "setup ok: 3 host(s), 0 change(s)" in p.stderr, p.stderr


def test_limited_run_keeps_every_pinned_node(sandbox_cluster: sandbox.Sandbox, project: Path,
                                             first_run: object) -> None:  # fmt: skip
    """Issue 17, item 1: `--limit node3 --tags ssh_mesh` must not drop node2 from the chief's
    pinned known_hosts block; the chief still reaches every node with strict checking."""
    env = {"NODEOPS_IT_SECRET": SECRET}
    assert setup(project / "cluster.yaml", env=env).returncode == 0
    before = ssh(sandbox_cluster, "node1", "cat ~/.ssh/known_hosts").stdout
    node3 = next(n for n in sandbox_cluster.nodes if n.name == "node3")
    # By address (issue 17, item 5): the chief joins for ssh_mesh; node2 is named as left out.
    p = setup(project / "cluster.yaml", "--limit", node3.address, "--tags", "ssh_mesh", env=env)
    assert p.returncode == 0, p.stderr
    assert "not run on (--limit): node2" in p.stderr and "setup ok: 2 host(s)" in p.stderr, p.stderr
    assert not re.search(r"│ node2 +│", p.stderr), p.stderr
    assert ssh(sandbox_cluster, "node1", "cat ~/.ssh/known_hosts").stdout == before
    for node in sandbox_cluster.nodes:
        q = ssh(sandbox_cluster, "node1", f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {node.address} true")
        assert q.returncode == 0, (node.name, q.stderr)


def test_missing_secret_is_exit_2_before_any_host(project: Path, first_run: object) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NODEOPS_IT_SECRET"}
    p = subprocess.run([NODEOPS, "setup", str(project / "cluster.yaml")], capture_output=True, text=True,
                       env=env, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 2
    # a spec error at the field's line, with the fix (issue 17, item 8)
    assert re.search(
        r"cluster\.yaml:\d+:\d+: error: env\.IT_SECRET\.from_env: NODEOPS_IT_SECRET is not set in this "
        r"shell \(fix: export NODEOPS_IT_SECRET=\.\.\. before setup\)",
        p.stderr,
    ), p.stderr
    assert "artifacts:" not in p.stderr


def test_unreachable_node_is_named_and_others_complete(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    node3 = sandbox_cluster.nodes[2]
    subprocess.run(["docker", "stop", "-t", "1", node3.container], check=True, capture_output=True)
    try:
        p = setup(project / "cluster.yaml", env={"NODEOPS_IT_SECRET": SECRET})
        assert p.returncode == 1, p.stderr
        assert re.search(
            r"node3: unreachable: ssh: connect to host .*(No route to host|timed out|refused)", p.stderr
        ), p.stderr
        assert re.search(r"│ node1 .*│ ok +│", p.stderr) and re.search(r"│ node2 .*│ ok +│", p.stderr), p.stderr
        assert "setup failed on node3" in p.stderr
    finally:
        subprocess.run(["docker", "start", node3.container], check=True, capture_output=True)
    sandbox._wait_for_sshd(node3.address, time.monotonic() + 60)
    p = setup(project / "cluster.yaml", env={"NODEOPS_IT_SECRET": SECRET})
    assert p.returncode == 0, p.stderr


def test_setup_refuses_unknown_host_keys(sandbox_cluster: sandbox.Sandbox, project: Path, tmp_path: Path) -> None:
    """With an empty known_hosts every node must be refused: host keys are really checked.

    (ansible-runner and molecule both turn checking off by default; nodeops turns it back on.)
    """
    empty = tmp_path / "known_hosts"
    empty.touch()
    spec = tmp_path / "cluster.yaml"
    text = (project / "cluster.yaml").read_text()
    spec.write_text(re.sub(r"known_hosts: .*", f"known_hosts: {empty}", text))
    p = setup(spec, "--tags", "nccl_env", env={"NODEOPS_IT_SECRET": SECRET, "ANSIBLE_HOST_KEY_CHECKING": "False"})
    assert p.returncode == 1, p.stderr
    for host in ("node1", "node2", "node3"):
        assert re.search(rf"{host}: unreachable: .*(Host key verification failed|mismatching host key)", p.stderr), (
            p.stderr
        )
    assert empty.read_text() == "", "nothing may be added to known_hosts behind the user's back"


def test_nfs_mode_in_check_mode_only(sandbox_cluster: sandbox.Sandbox, tmp_path: Path) -> None:
    """The sandbox kernel has no NFS, so the live mount is untested; check mode must plan it
    (report a change on every node) and touch nothing: no mount, no fstab line, no mount point."""
    spec = tmp_path / "nfs.yaml"
    server = subnet_of(sandbox_cluster).rsplit(".", 1)[0] + ".250"  # no such host: nothing is mounted
    spec.write_text(sandbox_cluster.spec_path.read_text()
                    + "workdir:\n  path: /mnt/nodeops-nfs\n  sync: nfs\n"
                    + f"  nfs: {{server: {server}, export: /exports/train, options: 'rw,hard'}}\n")  # fmt: skip
    fstab_before = ssh(sandbox_cluster, "node2", "cat /etc/fstab").stdout
    p = setup(spec, "--check", "--tags", "shared_path")
    assert p.returncode == 0, p.stderr
    assert "setup (check mode)" in p.stderr
    for host in ("node1", "node2", "node3"):
        assert re.search(rf"│ {host} +│ \d+ +│ [1-9]\d* +│ 0 +│ 0 +│", p.stderr), p.stderr
    assert ssh(sandbox_cluster, "node2", "cat /etc/fstab").stdout == fstab_before
    assert ssh(sandbox_cluster, "node2", "test -e /mnt/nodeops-nfs").returncode == 1


def test_conda_without_conda_names_host_and_fix(sandbox_cluster: sandbox.Sandbox, tmp_path: Path) -> None:
    """The live conda path is untested (no conda in the sandbox image); its error path is."""
    spec = tmp_path / "conda.yaml"
    spec.write_text(sandbox_cluster.spec_path.read_text() + "python:\n  conda: train\n")
    p = setup(spec, "--tags", "python_env", "--limit", "node3")
    assert p.returncode == 1, p.stderr
    assert re.search(r"node3: .*conda not found at ~/miniconda3/bin/conda on node3", p.stderr), p.stderr
    assert "note: the chief node1 joins --limit" not in p.stderr  # --tags python_env does not need the chief


def test_full_mesh_lets_every_node_reach_every_node(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object, tmp_path: Path
) -> None:
    spec = tmp_path / "full.yaml"
    spec.write_text((project / "cluster.yaml").read_text() + "mesh: {mode: full}\n")
    p = setup(spec, "--tags", "ssh_mesh", env={"NODEOPS_IT_SECRET": SECRET})
    assert p.returncode == 0, p.stderr
    for src in ("node2", "node3"):
        for dst in sandbox_cluster.nodes:
            q = ssh(sandbox_cluster, src, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {dst.address} uname -n")
            assert q.returncode == 0 and q.stdout.strip() == dst.name, f"{src} -> {dst.name}: {q.stderr}"


def test_setup_installs_py_spy_by_default(sandbox_cluster: sandbox.Sandbox, first_run: object) -> None:
    """The project's spec does not list py-spy: setup puts it in the env (from the wheelhouse),
    for `nodeops stacks` and the hang watchdog."""
    for node in sandbox_cluster.nodes:
        p = ssh(sandbox_cluster, node.name, "~/.venvs/train/bin/py-spy --version")
        assert p.returncode == 0 and p.stdout.startswith("py-spy "), (node.name, p.stdout, p.stderr)


def test_py_spy_that_cannot_be_installed_is_a_warning_unless_the_spec_requires_it(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object, tmp_path: Path
) -> None:
    """An offline wheelhouse without py-spy: setup says so on every host and goes on (stacks use
    the ranks' signal hook); with python.py_spy: true it fails there instead."""
    (tmp_path / "wheels").mkdir()
    text = (project / "cluster.yaml").read_text()
    text = text.replace("venv: ~/.venvs/train", "venv: ~/.venvs/bare", 1)
    text = re.sub(r"packages: \[.*\]", "packages: []", text)
    text = re.sub(r"wheelhouse: .*", f"wheelhouse: {tmp_path / 'wheels'}", text)
    spec = tmp_path / "bare.yaml"
    try:
        spec.write_text(text)
        p = setup(spec, "--tags", "python_env", env={"NODEOPS_IT_SECRET": SECRET})
        assert p.returncode == 0, p.stderr[-3000:]
        for node in ("node1", "node2", "node3"):
            assert re.search(rf"{node}: warning: Install the tools .*py-spy", p.stderr), p.stderr[-3000:]
        spec.write_text(text.replace("venv: ~/.venvs/bare", "venv: ~/.venvs/bare\n  py_spy: true", 1))
        p = setup(spec, "--tags", "python_env", env={"NODEOPS_IT_SECRET": SECRET})
        assert p.returncode != 0, p.stderr[-3000:]
        assert re.search(r"node\d: Install the tools .*py-spy", p.stderr), p.stderr[-3000:]
        assert "warning: Install the tools" not in p.stderr
    finally:
        for node in sandbox_cluster.nodes:
            ssh(sandbox_cluster, node.name, "rm -rf ~/.venvs/bare")


def run_stdout(stderr: str) -> str:
    """The Ansible output of the run whose artifacts a setup printed."""
    m = re.search(r"^artifacts: (\S+)$", stderr, re.M)
    assert m, stderr[-2000:]
    return next(Path(m.group(1)).glob("artifacts/*/stdout")).read_text()


def task_results(stdout: str, task: str) -> dict[str, str]:
    """host -> ok/changed/skipping/failed for one task of an Ansible run's output."""
    block = stdout.split(f" : {task}] ", 1)[1].split("\nTASK [", 1)[0]
    return {
        host: status for status, host in re.findall(r"^(ok|changed|skipping|failed|fatal): \[(node\d)", block, re.M)
    }


def test_cold_setup_sent_the_wheelhouse_once(
    sandbox_cluster: sandbox.Sandbox, first_run: subprocess.CompletedProcess[str]
) -> None:
    """Issue 29: the controller sent the wheelhouse to the chief only; the chief passed it on to
    node2 and node3 over the cluster's network, and every node holds all of it.

    How the test knows: the bytes this machine sent into the sandbox's network during the first
    setup (the Docker bridge's transmit counter: node-to-node traffic is switched between the
    containers and never counts) stay under 2x the wheelhouse, where sending it to each of the
    3 nodes would be at least 3x. The counter also holds the nodes' apt downloads (NATed through
    this machine) and Ansible's own traffic, hence the margin."""
    wheels = {w.name: w.stat().st_size for w in wheelhouse().glob("*.whl")}
    size = sum(wheels.values())
    sent = first_run.bytes_sent  # type: ignore[attr-defined]
    print(f"first setup: {sent / 2**20:.0f} MiB sent into the sandbox network, wheelhouse {size / 2**20:.0f} MiB")
    assert size < sent < 2 * size, (sent, size)
    out = run_stdout(first_run.stderr)
    assert task_results(out, "Sync the wheelhouse to the relay host") == {"node1": "changed"}
    # one task on the chief itself passes it on to both (issue 43: no task per node delegated to it)
    assert task_results(out, "Pass the wheelhouse on from the relay host") == {
        "node1": "changed", "node2": "skipping", "node3": "skipping"}  # fmt: skip
    assert set(task_results(out, "Sync the wheelhouse to the node from the controller").values()) == {"skipping"}
    for node in sandbox_cluster.nodes:  # read right after the first setup (conftest.first_run)
        got = dict(line.rsplit(" ", 1) for line in first_run.staged[node.name].splitlines())  # type: ignore[attr-defined]
        assert {k: int(v) for k, v in got.items()} == wheels, node.name


def test_pip_and_uv_make_the_same_env(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    """Issue 29: the first setup installed with uv (installer: auto, uv's wheel is in the
    wheelhouse). The same packages installed by setup into two fresh venvs, one with
    installer: uv and one with installer: pip, give every node the same packages at the same
    versions, and the parity check across nodes passes on both. (Fresh venvs: other tests add
    packages to the session's ~/.venvs/train, DeepSpeed for one.) Without torch: the first setup
    installed it with uv on every node, and six more installs of it (~200 s of this suite's CPU)
    would prove nothing numpy and py-spy do not."""
    out = run_stdout(first_run.stderr)
    assert set(task_results(out, "Install the packages with uv").values()) == {"changed"}
    assert set(task_results(out, "Install the packages with pip").values()) == {"skipping"}
    text = (project / "cluster.yaml").read_text()
    freeze = "~/.venvs/{}/bin/python -m pip list --format=freeze --disable-pip-version-check"
    try:
        for installer, used, unused in (("uv", "uv", "pip"), ("pip", "pip", "uv")):
            spec = tmp_path / f"{installer}.yaml"
            spec.write_text(
                re.sub(r"packages: \[.*\]", "packages: [numpy]", text).replace(
                    "venv: ~/.venvs/train", f"venv: ~/.venvs/it-{installer}\n  installer: {installer}", 1
                )
            )
            p = setup(spec, "--tags", "python_env", env={"NODEOPS_IT_SECRET": SECRET})
            assert p.returncode == 0, p.stderr[-3000:]
            got = run_stdout(p.stderr)
            assert set(task_results(got, f"Install the packages with {used}").values()) == {"changed"}, installer
            assert set(task_results(got, f"Install the packages with {unused}").values()) == {"skipping"}, installer
        for node in sandbox_cluster.nodes:
            by_uv = ssh(sandbox_cluster, node.name, freeze.format("it-uv")).stdout.split()
            by_pip = ssh(sandbox_cluster, node.name, freeze.format("it-pip")).stdout.split()
            assert any(d.startswith("numpy==") for d in by_uv), by_uv
            assert any(d.startswith("py-spy==") for d in by_uv) and not any(d.startswith("torch==") for d in by_uv)
            assert by_uv == by_pip, (node.name, set(by_uv) ^ set(by_pip))
    finally:
        for node in sandbox_cluster.nodes:
            ssh(sandbox_cluster, node.name, "rm -rf ~/.venvs/it-uv ~/.venvs/it-pip")


def test_the_chief_passes_on_source_files_only_and_the_controller_sends_where_it_cannot(
    sandbox_cluster: sandbox.Sandbox, project: Path, first_run: object
) -> None:
    """Issue 29: an edited workdir file goes from the controller to the chief, and from the chief
    to the others; an output a job wrote on the chief stays there. node3 no longer lets the
    chief in (its ssh_mesh block is gone from authorized_keys): setup warns, naming node3 and
    ssh's reason, and the controller sends node3 the file itself (issue 43: node3 reads its own
    result of the chief's one relay task)."""
    sb = sandbox_cluster
    env = {"NODEOPS_IT_SECRET": SECRET}
    train = project / "train.py"
    original = train.read_text()
    drop_block = "sed -i '/^# BEGIN nodeops ssh_mesh /,/^# END nodeops ssh_mesh /d' ~/.ssh/authorized_keys"
    try:
        assert ssh(sb, "node1", f"echo chief-only > {WORKDIR}/relay-output.txt").returncode == 0
        assert ssh(sb, "node3", drop_block).returncode == 0
        train.write_text(original + "# relayed\n")
        p = setup(project / "cluster.yaml", "--tags", "shared_path", env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        out = run_stdout(p.stderr)
        assert task_results(out, "Pass the source on from the relay host") == {
            "node1": "changed", "node2": "skipping", "node3": "skipping"}  # fmt: skip
        assert task_results(out, "Copy the source from the controller where the relay could not") == {
            "node1": "skipping", "node2": "skipping", "node3": "changed"}  # fmt: skip
        said = " ".join(p.stderr.split())
        # the chief's warning, naming node3 and ssh's reason
        assert re.search(r"node1: warning: Pass the source on from the relay host: relay_sync: could not pass "
                         r"\S+ on to node3 \(rsync exit \d+\): .*Permission denied", said), said[-3000:]  # fmt: skip
        for node in ("node2", "node3"):
            assert ssh(sb, node, f"tail -1 {WORKDIR}/train.py").stdout == "# relayed\n", node
            assert ssh(sb, node, f"test -e {WORKDIR}/relay-output.txt").returncode == 1, node
    finally:
        train.write_text(original)
        ssh(sb, "node1", f"rm -f {WORKDIR}/relay-output.txt")
        p = setup(project / "cluster.yaml", env=env)  # puts the block back, and train.py
        assert p.returncode == 0, p.stderr[-3000:]
