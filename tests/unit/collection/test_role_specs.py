"""Every role's meta/argument_specs.yml mirrors its defaults/main.yml, and its README lists
every variable with its default (the contract for infra repos using the roles alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = sorted(p for p in (Path(__file__).resolve().parents[3] / "roles").iterdir() if (p / "tasks").is_dir())


def test_the_six_roles_exist() -> None:
    assert {r.name for r in ROLES} == {"ssh_mesh", "python_env", "shared_path", "nccl_env", "deepspeed_env", "launch"}
    # launch starts a new run on every play (never idempotent): no molecule scenario; it is tested
    # against the sandbox with plain ansible-playbook (tests/integration/test_collection.py)
    assert {r.name for r in ROLES if (r / "molecule").is_dir()} == {r.name for r in ROLES} - {"launch"}


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_argument_specs_mirror_defaults(role: Path) -> None:
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    options = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert sorted(defaults) == sorted(options), "defaults and argument_specs list different variables"
    for name, value in defaults.items():
        assert name.startswith(f"{role.name}_"), f"{name} lacks the {role.name}_ prefix"
        assert options[name].get("description"), f"{name} has no description"
        templated = isinstance(value, str) and "{{" in value
        if "default" in options[name]:
            assert not templated, f"{name}: a templated default must not be repeated in argument_specs"
            assert options[name]["default"] == value, f"{name}: argument_specs default differs from defaults/main.yml"
        else:
            assert templated or options[name].get("required"), f"{name}: argument_specs has no default"


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_readme_lists_every_variable(role: Path) -> None:
    readme = (role / "README.md").read_text()
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    missing = [name for name in defaults if f"`{name}`" not in readme]
    assert missing == [], f"{role.name}/README.md does not describe {missing}"
    assert "molecule" in readme.lower()


def test_readme_tables_are_current() -> None:
    """scripts/role_readmes.py must leave the READMEs unchanged (run it after editing defaults)."""
    import subprocess
    import sys

    before = {r: (r / "README.md").read_text() for r in ROLES}
    script = ROLES[0].parents[1] / "scripts" / "role_readmes.py"
    subprocess.run([sys.executable, str(script)], check=True)
    after = {r: (r / "README.md").read_text() for r in ROLES}
    stale = [r.name for r in ROLES if before[r] != after[r]]
    for r in ROLES:
        (r / "README.md").write_text(before[r])
    assert stale == [], f"run scripts/role_readmes.py: stale tables in {stale}"
