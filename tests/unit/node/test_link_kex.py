"""The supervisor's links to the guards: their key exchange (supervisor.kex_order), read from
what the real ``ssh -G`` resolves for a config (OpenSSH's own parser)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nodeops.node import supervisor as SUP

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")


def resolved(tmp: Path, kex: str | None) -> str:
    cfg = tmp / "ssh_config"
    cfg.write_text("Host *\n" + (f"  KexAlgorithms {kex}\n" if kex else ""))
    p = subprocess.run(["ssh", "-F", str(cfg), "-G", "node7"], capture_output=True, text=True, check=True)
    return p.stdout


def supported() -> set[str]:
    return set(subprocess.run(["ssh", "-Q", "kex"], capture_output=True, text=True, check=True).stdout.split())


def test_sntrup_first_puts_curve25519_first_and_keeps_the_same_algorithms(tmp_path: Path) -> None:
    if not {"sntrup761x25519-sha512@openssh.com", "curve25519-sha256"} <= supported():
        pytest.skip("this OpenSSH has no sntrup761x25519")
    listed = "sntrup761x25519-sha512@openssh.com,ecdh-sha2-nistp256,curve25519-sha256"
    got = SUP.kex_order(resolved(tmp_path, listed))
    assert got == ["KexAlgorithms=curve25519-sha256,sntrup761x25519-sha512@openssh.com,ecdh-sha2-nistp256"]
    # what ssh itself makes of the option: the same set, nothing widened
    again = SUP.kex_order(resolved(tmp_path, got[0].split("=", 1)[1]))
    assert again == []


@pytest.mark.parametrize(
    "listed",
    [
        "curve25519-sha256,sntrup761x25519-sha512@openssh.com",  # already first
        "sntrup761x25519-sha512@openssh.com,ecdh-sha2-nistp256",  # the user's config allows no curve25519: kept
        "ecdh-sha2-nistp256",
    ],
)
def test_other_lists_are_left_to_ssh(tmp_path: Path, listed: str) -> None:
    if not set(listed.split(",")) <= supported():
        pytest.skip("this OpenSSH lacks one of them")
    assert SUP.kex_order(resolved(tmp_path, listed)) == []


def test_this_clients_default_is_reordered_only_when_it_starts_with_sntrup(tmp_path: Path) -> None:
    out = resolved(tmp_path, None)
    default = next(line.split(" ", 1)[1].split(",") for line in out.splitlines() if line.startswith("kexalgorithms "))
    got = SUP.kex_order(out)
    if default[0].startswith("sntrup761") and "curve25519-sha256" in default:
        assert got and got[0].startswith("KexAlgorithms=curve25519-sha256,")
        assert sorted(got[0].split("=", 1)[1].split(",")) == sorted(default)
    else:
        assert got == []


def test_no_kexalgorithms_line_is_left_to_ssh() -> None:
    assert SUP.kex_order("user debian\nport 22\n") == []
