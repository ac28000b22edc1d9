"""The controller's ssh argv (transport.ssh_argv), as the real ``ssh -G`` resolves it (OpenSSH's
own parser; nothing is connected)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nodeops.transport import ssh_argv

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")


def connect_timeout(argv: list[str]) -> str:
    """What ssh would use: ``-G`` prints the resolved options and connects to nothing."""
    p = subprocess.run([argv[0], "-G", *argv[1:]], capture_output=True, text=True, check=True)
    return next(line.split()[1] for line in p.stdout.splitlines() if line.startswith("connecttimeout "))


def test_a_short_connect_timeout_wins_over_the_usual_one_and_the_config_s(tmp_path: Path) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host node1\n  HostName 10.9.0.11\n  ConnectTimeout 30\n")
    assert connect_timeout(ssh_argv(cfg, "node1")) == "10"  # the usual one, before the config's
    assert connect_timeout(ssh_argv(cfg, "node1", connect_timeout=3)) == "3"
    # the command comes after the host, untouched
    assert ssh_argv(cfg, "node1", "true", connect_timeout=3)[-2:] == ["node1", "true"]
