"""Each role's molecule scenario: create (sandbox nodes), converge, idempotence, verify, destroy.

Real molecule, real Ansible over real ssh with pinned host keys, on the sandbox image.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeops.resources import collections_path

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "molecule/default/molecule.yml").is_file())
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_role_has_a_scenario() -> None:
    assert ROLES == ["deepspeed_env", "nccl_env", "python_env", "shared_path", "ssh_mesh"]


@pytest.mark.parametrize("role", ROLES)
def test_molecule(role: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NODEOPS_HOME"}  # the shared config uses the default
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["NO_COLOR"] = "1"
    # the roles call nodeops.cluster.* by FQCN: this tree is that collection
    env["ANSIBLE_COLLECTIONS_PATH"] = str(collections_path(tmp_path / "collections"))
    p = subprocess.run(
        [str(Path(sys.executable).parent / "molecule"), "test"],
        cwd=ROOT / "roles" / role, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for step in ("converge", "idempotence", "verify"):
        assert f"{step}: Executed: Successful" in out, f"{step} did not run:\n{out[-3000:]}"
