"""DeepSpeed hostfile and .deepspeed_env behaviour, from tests/data/peers/deepspeed/CASES.md."""

from __future__ import annotations

import pytest

from nodeops.errors import SpecError
from nodeops.spec import deepspeed

from ...conftest import PEERS

HOSTFILES = PEERS / "deepspeed" / "hostfiles"
ENVFILES = PEERS / "deepspeed" / "deepspeed_env"

OK = {
    "ok-basic": {"worker-0": 4, "worker-1": 4},
    "ok-comments-blank-lines": {"worker-0": 4, "worker-1": 2},
    "ok-commented-duplicate": {"worker-0": 4},
    "ok-leading-trailing-whitespace": {"worker-0": 2, "worker-1": 2},
    "ok-tab-and-multi-space": {"worker-0": 8, "worker-1": 8},
    "ok-trailing-text-ignored": {"worker-0": 4, "worker-1": 2},
    "ok-crlf": {"worker-0": 4, "worker-1": 2},
    "ok-localhost-and-ip": {"localhost": 1, "10.0.0.12": 2},
    "ok-order-preserved": {"node-b": 1, "node-a": 2, "node-c": 1},
    "ok-slots-zero": {"worker-0": 0, "worker-1": 2},
    "ok-leading-zero": {"worker-0": 8},
    "ok-single-host": {"worker-0": 2},
    "ok-no-final-newline": {"worker-0": 2, "worker-1": 2},
}
BAD = {
    "bad-duplicate-host": (3, "multiple entries for worker-0"),
    "bad-duplicate-before-bad-line": (2, "multiple entries for worker-0"),
    "bad-no-slots": (1, "bad entry 'worker-0'"),
    "bad-bare-count": (1, "bad entry 'worker-0 4'"),
    "bad-space-around-equals": (1, "bad entry 'worker-0 slots = 4'"),
    "bad-negative-slots": (1, "bad entry 'worker-0 slots=-1'"),
    "bad-uppercase-slots": (1, "bad entry 'worker-0 SLOTS=4'"),
    "bad-host-with-spaces": (1, "bad entry 'this is bad slots=1'"),
    "bad-colon-count": (1, "bad entry 'worker-0:4'"),
    "bad-semicolon-comment": (1, "bad entry '; worker-0 slots=2'"),
    "bad-mixed-good-and-bad": (2, "bad entry 'this is bad slots=1'"),
    "bad-empty": (1, "empty"),
    "bad-only-comments-and-blanks": (1, "empty"),
}


def test_every_case_file_is_covered() -> None:
    assert {p.name for p in HOSTFILES.iterdir()} == set(OK) | set(BAD)


@pytest.mark.parametrize("name", sorted(OK))
def test_hostfile_ok(name: str) -> None:
    got = deepspeed.parse_hostfile((HOSTFILES / name).read_bytes().decode(), name)
    assert got == OK[name]
    assert list(got) == list(OK[name])  # file order is node-rank order (H8)


@pytest.mark.parametrize("name", sorted(BAD))
def test_hostfile_bad(name: str) -> None:
    line, message = BAD[name]
    with pytest.raises(SpecError) as info:
        deepspeed.parse_hostfile((HOSTFILES / name).read_text(), name)
    # DeepSpeed stops at its first error; nodeops reports every bad line, the first one first
    issue, *rest = info.value.issues
    assert (issue.file, issue.line) == (name, line)
    assert message in issue.message
    lines = [i.line for i in info.value.issues]
    assert lines == sorted(set(lines)), lines
    assert [i.line for i in rest] == EXTRA.get(name, [])


EXTRA = {"bad-duplicate-before-bad-line": [3], "bad-mixed-good-and-bad": [4]}  # the later bad lines, also named


def test_non_ascii_digits_refused() -> None:
    """H12: DeepSpeed accepts Arabic-Indic digits; we do not."""
    with pytest.raises(SpecError):
        deepspeed.parse_hostfile("worker-0 slots=\u0664\n")


def test_hostfile_round_trip() -> None:
    hosts = {"b": 1, "a": 2}
    assert deepspeed.parse_hostfile(deepspeed.render_hostfile(hosts)) == hosts


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ok-simple", {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/opt/proj/src"}),
        ("ok-duplicate-key-last-wins", {"FOO": "2"}),
        ("hazard-export-prefix", {"export A": "1"}),
    ],
)
def test_env_file_parse(name: str, expected: dict[str, str]) -> None:
    assert deepspeed.parse_env_file((ENVFILES / name).read_text()) == expected


def test_env_file_special_values() -> None:
    env = deepspeed.parse_env_file((ENVFILES / "ok-special-values").read_text())
    frags = "".join(deepspeed.export_fragment(k, v) for k, v in env.items())
    assert frags == (
        'export MSG="hello world"; export TAGGED=""quoted value""; '
        'export SINGLE="\'single quoted\'"; export PATHX="$HOME/bin:/usr/bin"; '
        "export EQ=a=b=c; export SPACED_KEY=trimmed; "
    )


@pytest.mark.parametrize("name", ["bad-blank-line", "bad-trailing-blank-line", "bad-comment-line"])
def test_env_file_lines_deepspeed_crashes_on(name: str) -> None:
    with pytest.raises(ValueError, match="has no '='"):
        deepspeed.parse_env_file((ENVFILES / name).read_text())


@pytest.mark.parametrize(
    ("value", "bad"),
    [
        ("INFO", False),
        ("$LD_LIBRARY_PATH:/x", False),
        ("hello world", False),
        ('say "hi"', True),
        ("a`b`", True),
        ("a\\b", True),
        (" padded", True),
    ],
)
def test_env_file_problem(value: str, bad: bool) -> None:
    assert (deepspeed.env_file_problem("K", value) is not None) is bad


def test_rendered_env_file_parses_back_as_deepspeed_reads_it() -> None:
    env = {"A": "1", "B": "x y", "C": "$HOME/bin"}
    assert deepspeed.parse_env_file(deepspeed.render_env_file(env)) == env
