#!/usr/bin/env python3
"""Regenerate the variables table in each roles/<role>/README.md from defaults and argument_specs.

The prose above the marker line is kept; everything below it is rewritten.
Run: python scripts/role_readmes.py   (tests/unit/collection/test_role_specs.py checks the result)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

MARKER = "## Role variables"
ROOT = Path(__file__).resolve().parent.parent


def variables(role: Path) -> list[tuple[str, str, str]]:
    """(name, default, description): defaults from defaults/main.yml, prose from argument_specs."""
    data = yaml.safe_load((role / "defaults/main.yml").read_text())
    options = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    rows = []
    for name, value in data.items():
        default = yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
        desc = options[name]["description"]
        desc = " ".join(desc) if isinstance(desc, list) else str(desc)  # a list: paragraphs, as ansible-doc has them
        rows.append((name, default.replace("|", "\\|"), desc.replace("|", "\\|")))
    return rows


def main() -> int:
    for role in sorted((ROOT / "roles").iterdir()):
        readme = role / "README.md"
        if not (role / "defaults/main.yml").is_file() or not readme.is_file():
            continue
        head = readme.read_text().split(MARKER)[0].rstrip() + "\n\n"
        table = [MARKER, "", "| variable | default | what it does |", "|---|---|---|"]
        for name, default, text in variables(role):
            table.append(f"| `{name}` | `{default.strip()}` | {text} |")
        readme.write_text(head + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
