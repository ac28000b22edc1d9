"""The docs site's generated references: current, and complete against the code they come from.

(`mkdocs build --strict` itself runs in scripts/test.sh: a broken link or anchor fails the build.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from nodeops.cli import app
from nodeops.spec.model import json_schema

ROOT = Path(__file__).resolve().parents[2]
SPEC_REF = ROOT / "docs" / "reference" / "spec.md"
CLI_REF = ROOT / "docs" / "reference" / "cli.md"


def test_generated_pages_are_current() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_gen.py"), "--check"],
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert p.returncode == 0, f"run python scripts/docs_gen.py\n{p.stdout[-3000:]}{p.stderr[-2000:]}"


def _sections(text: str) -> dict[str, str]:
    """``## Name`` -> the section's text."""
    parts = re.split(r"^## (\w+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_spec_reference_lists_every_field_of_every_model() -> None:
    schema = json_schema()
    models = {"ResourceSpec": schema, **schema["$defs"]}
    sections = _sections(SPEC_REF.read_text())
    assert set(sections) == set(models), "a model of the schema has no section (or a section no model)"
    missing = [
        f"{name}.{field}"
        for name, model in models.items()
        for field in model.get("properties", {})
        if not re.search(rf"^\| `([\w\[\].]+\.)?{re.escape(field)}` \|", sections[name], re.M)
    ]
    assert missing == []


def test_cli_reference_lists_every_command_and_option() -> None:
    text = CLI_REF.read_text()

    def walk(group: Any, prefix: str) -> list[tuple[str, Any]]:  # typer's (click's) groups and commands
        found: list[tuple[str, Any]] = []
        for name, cmd in group.commands.items():
            found.append((f"{prefix} {name}", cmd))
            if hasattr(cmd, "commands"):
                found += walk(cmd, f"{prefix} {name}")
        return found

    commands = walk(typer.main.get_command(app), "nodeops")
    assert len(commands) > 15
    for path, cmd in commands:
        assert f"## `{path}`" in text, path
        for param in cmd.params:
            if param.param_type_name == "option" and not param.hidden:
                assert any(f"`{o}" in text for o in param.opts), f"{path}: {param.opts}"
