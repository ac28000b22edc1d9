"""A real wheel, installed non-editable into a fresh venv, works from another directory.

The fresh venv gets nodeops from the wheel only. Its third-party dependencies are borrowed
from the test interpreter's site-packages through a .pth line (no network needed); a .pth
line does not process that directory's own .pth files, so the editable checkout is not seen.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_wheel_ships_data_and_runs_from_elsewhere(tmp_path: Path) -> None:
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", ROOT)
    (wheel,) = (tmp_path / "dist").glob("nodeops-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for data in ("playbooks", "roles", "templates"):
        assert any(n.startswith(f"nodeops/{data}/") for n in names), f"{data}/ missing from {wheel.name}"

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel)
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(
        py,
        "-c",
        "import nodeops, nodeops.resources as r; print(nodeops.__file__); print(r.data_dir('roles'))",
        cwd=elsewhere,
    ).split()
    assert all(Path(w).is_relative_to(venv) for w in where), where

    spec = elsewhere / "c.yaml"
    spec.write_text("nodes:\n  - address: 10.0.0.1\n    chief: true\n  - address: 10.0.0.2\n")
    out = run(venv / "bin" / "nodeops", "validate", spec, cwd=elsewhere)
    assert "valid: 2 node(s)" in out
    p = subprocess.run(
        [venv / "bin" / "nodeops", "validate", ROOT / "tests/specs/no-chief.error.no-chief.yaml"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "none is marked chief" in p.stderr


SANITY_IGNORES = [f"tests/sanity/{p.name}" for p in (ROOT / "tests" / "sanity").glob("ignore-*.txt")]


def test_roles_build_as_a_collection(tmp_path: Path) -> None:
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    run(galaxy, "collection", "build", "--output-path", tmp_path, ROOT, cwd=ROOT)
    (tarball,) = tmp_path.glob("nodeops-cluster-*.tar.gz")
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
    for role in ("ssh_mesh", "python_env", "shared_path", "nccl_env", "deepspeed_env", "launch"):
        assert f"roles/{role}/tasks/main.yml" in names
        assert f"roles/{role}/meta/argument_specs.yml" in names
    # tests/sanity ships (ansible-test's ignore files, as Galaxy reviewers expect); the Python suite does not
    assert {n for n in names if n.startswith("tests/")} == {"tests/sanity", *SANITY_IGNORES}
    assert not [n for n in names if n.startswith(("src/", ".venv/", ".cache/", ".config/", "molecule/",
                                                    "templates/sandbox", "pyproject.toml"))]  # fmt: skip
    assert not [n for n in names if "/molecule/" in n or "__pycache__" in n]
    modules = sorted(Path(n).stem for n in names if n.startswith("plugins/modules/") and n.endswith(".py"))
    assert modules == ["deepspeed_env_file", "nccl_env_files", "python_env_state", "relay_sync", "shared_path_state",
                       "ssh_mesh_blocks", "ssh_mesh_check", "ssh_mesh_key"]  # fmt: skip
    # Installed where an infra repo installs it: every module documents itself, and a playbook
    # that uses a role by its FQCN resolves the role's modules (the bug: short names from library/)
    coll = tmp_path / "collections"
    # --force: ansible-lint may have installed a copy in ~/.ansible, which galaxy would call "already installed"
    run(galaxy, "collection", "install", "--force", "--offline", "--no-deps", "-p", coll, tarball, cwd=tmp_path)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(coll)}
    bindir = Path(sys.executable).parent
    for m in modules:
        doc = subprocess.run([bindir / "ansible-doc", f"nodeops.cluster.{m}"], capture_output=True, text=True,
                             env=env, check=False)  # fmt: skip
        assert doc.returncode == 0 and "EXAMPLES:" in doc.stdout and "RETURN VALUES:" in doc.stdout, (m, doc.stderr)
    play = tmp_path / "site.yml"
    play.write_text("- hosts: all\n  gather_facts: false\n  roles:\n"
                    + "".join(f"    - nodeops.cluster.{r}\n" for r in ("ssh_mesh", "python_env", "shared_path",
                                                                       "nccl_env", "deepspeed_env")))  # fmt: skip
    syn = subprocess.run([bindir / "ansible-playbook", "-i", "h1,", "--syntax-check", play], capture_output=True,
                         text=True, env=env, cwd=tmp_path, check=False)  # fmt: skip
    assert syn.returncode == 0, syn.stdout + syn.stderr
