"""The collection's metadata: what `ansible-galaxy collection build/publish` reads."""

from __future__ import annotations

from pathlib import Path

import yaml

import nodeops

ROOT = Path(__file__).resolve().parents[3]


def test_galaxy_metadata_is_complete_and_versioned_with_the_package() -> None:
    galaxy = yaml.safe_load((ROOT / "galaxy.yml").read_text())
    assert {"namespace", "name", "version", "readme", "authors", "description", "license"} <= set(galaxy)
    assert (galaxy["namespace"], galaxy["name"]) == ("nodeops", "cluster")
    assert galaxy["version"] == nodeops.__version__  # one version for the wheel and the collection
    assert (ROOT / galaxy["readme"]).is_file()
    assert "repository" not in galaxy or not str(galaxy["repository"]).endswith(".invalid/nodeops")  # real or none
    runtime = yaml.safe_load((ROOT / "meta" / "runtime.yml").read_text())
    assert runtime["requires_ansible"].startswith(">=")


def test_the_collection_needs_no_nodeops_package() -> None:
    """Infra repos install only the collection: its plugins and the launch role's files import
    nothing from the nodeops package (the package imports them instead, through its links)."""
    offenders = []
    for base in ("plugins", "roles"):
        for p in (ROOT / base).rglob("*.py"):
            text = p.read_text()
            if "from nodeops" in text or "import nodeops" in text:
                offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []
    for link, target in [("src/nodeops/_shell.py", "plugins/module_utils/nodeops_shell.py"),
                         ("src/nodeops/launch/plan.py", "plugins/module_utils/nodeops_launch.py"),
                         *((f"src/nodeops/node/{f}", f"roles/launch/files/{f}")
                           for f in ("agent.py", "protocol.py", "stacks.py", "recovery.py",
                                     "supervisor.py", "stall.py"))]:  # fmt: skip
        assert (ROOT / link).is_symlink() and (ROOT / link).resolve() == (ROOT / target).resolve(), link


def test_every_sanity_ignore_names_an_existing_file_and_gives_its_reason() -> None:
    """tests/sanity/ignore-*.txt (ansible-test sanity, run by scripts/sanity.sh): each entry is
    `path test:code # reason`, for a file that exists and says it is Apache-2.0 where the entry
    waives the GPLv3 header."""
    files = sorted((ROOT / "tests" / "sanity").glob("ignore-*.txt"))
    assert files, "no ignore file for ansible-test sanity"
    for f in files:
        for line in f.read_text().splitlines():
            entry, _, reason = line.partition(" # ")
            path, code = entry.split(" ")
            assert reason.strip() and (ROOT / path).is_file() and ":" in code, line
            if code.endswith("missing-gplv3-license"):
                assert "# SPDX-License-Identifier: Apache-2.0" in (ROOT / path).read_text().splitlines()[:2], path
