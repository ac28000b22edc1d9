"""scripts/ensure-docker.sh decides on the engine, not on the client binary.

The images CI and many users start from ship a `docker` client with no engine. The script runs
here with a PATH that holds only stubs: a `docker` client whose `info` fails until an engine
runs, an `apt-get` that records what it was asked and "installs" a `dockerd` stub, and the few
real tools the script uses. Installing the real engine is rehearsed by the demo and CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REAL_TOOLS = ("bash", "sh", "id", "seq", "sleep", "tail", "dirname", "touch", "cat", "nohup", "chmod", "printf")


def stub_path(tmp: Path) -> tuple[Path, Path]:
    bin_dir, state = tmp / "bin", tmp / "state"
    bin_dir.mkdir()
    state.mkdir()
    for tool in REAL_TOOLS:
        real = shutil.which(tool)
        assert real, tool
        (bin_dir / tool).symlink_to(real)

    def stub(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (bin_dir / name).chmod(0o755)

    stub("docker", f'[ "$1" = info ] && {{ [ -e {state}/engine-up ]; exit $?; }}; exit 0')
    dockerd = f"#!{shutil.which('bash')}\\ntouch {state}/engine-up\\n"
    stub("apt-get", f'echo "$*" >> {state}/apt.log\n'
                    f'case " $* " in *" install "*docker.io*) printf "{dockerd}" > {bin_dir}/dockerd; '
                    f"chmod 755 {bin_dir}/dockerd;; esac")  # fmt: skip
    stub("sudo", 'exec "$@"')
    for present in ("debootstrap", "ssh", "rsync"):
        stub(present, "exit 0")
    return bin_dir, state


def run(bin_dir: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "NODEOPS_DOCKERD_LOG": str(tmp / "dockerd.log"), "HOME": str(tmp)}
    return subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts/ensure-docker.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_client_without_engine_installs_and_starts_the_engine(tmp_path: Path) -> None:
    bin_dir, state = stub_path(tmp_path)
    p = run(bin_dir, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "client is on PATH" in p.stdout and "no engine" in p.stdout
    assert "docker.io" in (state / "apt.log").read_text()
    assert (state / "engine-up").exists(), "dockerd was not started"
    assert "docker engine is up" in p.stdout


def test_engine_that_answers_needs_nothing(tmp_path: Path) -> None:
    bin_dir, state = stub_path(tmp_path)
    (state / "engine-up").touch()
    p = run(bin_dir, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (state / "apt.log").exists()
    assert p.stdout == ""


def test_no_engine_after_install_is_a_clear_error(tmp_path: Path) -> None:
    bin_dir, state = stub_path(tmp_path)
    (bin_dir / "apt-get").write_text(f'#!{shutil.which("bash")}\necho "$*" >> {state}/apt.log\n')
    p = run(bin_dir, tmp_path)
    assert p.returncode == 1
    assert "dockerd is not installed" in p.stderr
    assert os.path.exists(state / "apt.log")
