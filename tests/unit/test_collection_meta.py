"""The collection's metadata: what `ansible-galaxy collection build/publish` reads."""

from __future__ import annotations

from pathlib import Path

import yaml

import nodeops

ROOT = Path(__file__).resolve().parents[2]


def test_galaxy_metadata_is_complete_and_versioned_with_the_package() -> None:
    galaxy = yaml.safe_load((ROOT / "galaxy.yml").read_text())
    assert {"namespace", "name", "version", "readme", "authors", "description", "license"} <= set(galaxy)
    assert (galaxy["namespace"], galaxy["name"]) == ("nodeops", "cluster")
    assert galaxy["version"] == nodeops.__version__  # one version for the wheel and the collection
    assert (ROOT / galaxy["readme"]).is_file()
    runtime = yaml.safe_load((ROOT / "meta" / "runtime.yml").read_text())
    assert runtime["requires_ansible"].startswith(">=")
