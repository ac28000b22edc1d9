"""The supervisor's links to the guards: their key exchange (supervisor.link_kex), decided from
what the real ``ssh -G`` resolves (OpenSSH's own parser; nothing is connected)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nodeops.node import supervisor as SUP

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
SNTRUP = "sntrup761x25519-sha512@openssh.com"


def resolved(config: Path | str, host: str = "node7", *opts: str) -> list[str]:
    p = subprocess.run(["ssh", "-F", str(config), *opts, "-G", host], capture_output=True, text=True, check=True)
    return SUP.kex_list(p.stdout)


def default() -> list[str]:
    return resolved("/dev/null")


def test_ssh_s_own_default_beginning_with_sntrup_is_reordered_and_nothing_else(tmp_path: Path) -> None:
    own = default()
    got = SUP.link_kex(own, own)
    if own[0].startswith("sntrup761") and SUP.FAST_KEX in own:
        assert got and got[0].startswith(f"KexAlgorithms={SUP.FAST_KEX},")
        # what ssh makes of the option: the same algorithms, curve25519-sha256 first
        again = resolved("/dev/null", "node7", "-o", got[0])
        assert again[0] == SUP.FAST_KEX and sorted(again) == sorted(own)
    else:
        assert got == []  # OpenSSH 9.9's mlkem768x25519 or an older default: left first


def test_a_list_a_config_chose_is_left_as_it_is(tmp_path: Path) -> None:
    """A Host block's (or the system policy's) own list, even one beginning with sntrup, is the
    user's choice: the links keep it, per host (another host's list never applies to it)."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host strict\n  KexAlgorithms {SNTRUP}\nHost legacy\n  KexAlgorithms ecdh-sha2-nistp256\n")
    own = default()
    assert SUP.link_kex(own, resolved(cfg, "strict")) == []
    assert SUP.link_kex(own, resolved(cfg, "legacy")) == []
    assert SUP.link_kex(own, resolved(cfg, "other")) == SUP.link_kex(own, own)  # no block: ssh's default


def test_no_list_is_left_to_ssh() -> None:
    assert SUP.kex_list("user debian\nport 22\n") == []
    assert SUP.link_kex([], []) == []
    assert SUP.link_kex([SNTRUP], [SNTRUP]) == []  # no curve25519-sha256 to put first


def test_the_mesh_ssh_argv_carries_the_host_s_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(SUP, "log", said.append)  # not the shipped dir's supervisor.log
    monkeypatch.setattr(SUP, "KEX", {})
    monkeypatch.setattr(SUP, "DEFAULT_KEX", [])
    host = {"name": "node7", "address": "10.0.0.7", "port": 2222, "user": "debian"}
    argv = SUP.ssh_base(host)
    got = SUP.kex_list(subprocess.run([*argv, "-G", host["address"]], capture_output=True, text=True,
                                      check=True).stdout)  # fmt: skip
    own = default()
    assert sorted(got) == sorted(own)
    assert got[0] == (SUP.FAST_KEX if SUP.link_kex(own, own) else own[0])
    assert said == ([f"the links' key exchange: {SUP.link_kex(own, own)[0]}"] if SUP.link_kex(own, own) else [])
    SUP.ssh_base(dict(host, name="again"))  # the same address, port and user: found once, said once
    assert len(said) <= 1 and list(SUP.KEX) == [("10.0.0.7", "2222", "debian")]
