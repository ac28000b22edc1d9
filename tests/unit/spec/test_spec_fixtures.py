"""Spec fixtures, collected automatically: ``<name>.happy.yaml`` must validate;
``<name>.error.<reason>.yaml`` must fail with every error named in its ``# expect:`` lines
(``LINE:COL FIELD | part of the message``) and with nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nodeops.errors import SpecError
from nodeops.spec.load import load_spec_text
from nodeops.spec.loading import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
EXPECT = re.compile(r"^# expect: (\d+):(\d+) (\S+) \| (.+)$", re.M)
HAPPY = sorted(SPECS.glob("*.happy.yaml"))
ERRORS = sorted(SPECS.glob("*.error.*.yaml"))


def test_fixture_corpus_is_big_enough() -> None:
    reasons = {p.name.split(".error.")[1] for p in ERRORS}
    assert len(reasons) >= 30, sorted(reasons)
    assert len(HAPPY) >= 3


@pytest.mark.parametrize("path", HAPPY, ids=lambda p: p.name)
def test_happy_spec_validates(path: Path) -> None:
    loaded = load_spec(path)
    assert loaded.spec.nodes


@pytest.mark.parametrize("path", ERRORS, ids=lambda p: p.name)
def test_error_spec_is_reported_precisely(path: Path) -> None:
    expected = [(int(a), int(b), f, m) for a, b, f, m in EXPECT.findall(path.read_text())]
    assert expected, f"{path.name} has no '# expect:' line"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    got = [i for i in info.value.issues if i.severity == "error"]
    shown = "\n".join(str(i) for i in got)
    assert len(got) == len(expected), f"expected {len(expected)} error(s), got:\n{shown}"
    for line, col, field, msg in expected:
        match = [i for i in got if (i.line, i.col, i.field) == (line, col, field) and msg in str(i)]
        assert match, f"no error {line}:{col} {field} | {msg!r} in:\n{shown}"
        assert match[0].fix, f"error without a fix hint: {match[0]}"
        assert match[0].file == str(path)


@pytest.mark.parametrize("field", ["key_file", "known_hosts", "username", "proxy_jump"])
def test_a_trailing_line_break_is_refused_like_any_other_odd_character(field: str) -> None:
    """`$` in a pattern also matches before a final newline: the checks anchor with \\Z."""
    text = f'nodes:\n  - {{address: 10.0.0.1}}\nssh:\n  g:\n    {field}: "k\\n"\n'
    with pytest.raises(SpecError) as e:
        load_spec_text(text)
    assert f"ssh.g.{field}" in str(e.value)


def test_a_node_name_with_a_trailing_line_break_is_refused() -> None:
    with pytest.raises(SpecError) as e:
        load_spec_text('nodes:\n  - {address: 10.0.0.1, name: "n1\\n"}\n')
    assert "nodes[0].name" in str(e.value)


def test_proxy_jump_none_is_refused_rather_than_read_by_ssh_as_no_jump() -> None:
    with pytest.raises(SpecError) as e:
        load_spec_text("nodes:\n  - {address: 10.0.0.1}\nssh:\n  g:\n    proxy_jump: NONE\n")
    assert "ssh's keyword for no jump host" in str(e.value)
