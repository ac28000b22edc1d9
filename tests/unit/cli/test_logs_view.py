"""`nodeops logs`: a log read whole gives the same lines as `-f` (no empty line before a rank
line), and --host/--rank/--tail keep what they say."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nodeops.cli import app
from nodeops.cli.jobs_cmds import LogView
from nodeops.node import mpi_split
from nodeops.node import protocol as P


def test_log_lines_cut_at_newlines_only() -> None:
    text = "hello\n\x1e[rank1]:Traceback\x1c x\r\n\x1e[rank0]:ok\u2028still rank0\n"
    assert P.log_lines(text) == ["hello", "\x1e[rank1]:Traceback\x1c x", "\x1e[rank0]:ok\u2028still rank0"]
    assert mpi_split.rank_lines(P.log_lines(text)) == [
        "hello",
        "[rank1]:Traceback\x1c x",
        "[rank0]:ok\u2028still rank0",
    ]
    assert P.log_lines("") == [] and P.log_lines("no newline") == ["no newline"] and P.log_lines("\n") == [""]


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def note(self, text: str) -> None: ...
    def out(self, text: str) -> None: ...
    def report(self, report: object) -> None: ...

    def line(self, host: str, text: str) -> None:
        self.lines.append((host, text))


LOG = [("node1", "torchrun starting"), ("node1", "[rank0]:step 1"), ("node2", "[rank1]:step 1"),
       ("node1", "[rank0]:step 2"), ("node2", "[rank1]:step 2"), ("node2", "[rank10]:step 2"),
       ("node2", "[rank1]:step 3")]  # fmt: skip


def view(hosts: list[str], ranks: list[int], tail: int | None) -> tuple[list[tuple[str, str]], str]:
    rec = Recorder()
    v = LogView(rec, hosts, ranks, tail)  # type: ignore[arg-type]
    for host, text in LOG:
        v.line(host, text)
    v.flush()
    return rec.lines, ""


def test_no_filter_passes_every_line_in_order() -> None:
    assert view([], [], None)[0] == LOG


def test_host_rank_and_tail() -> None:
    assert view(["node2"], [], None)[0] == [x for x in LOG if x[0] == "node2"]
    assert view([], [1], None)[0] == [
        ("node2", "[rank1]:step 1"),
        ("node2", "[rank1]:step 2"),
        ("node2", "[rank1]:step 3"),
    ]
    assert view([], [], 2)[0] == [("node1", "[rank0]:step 1"), ("node1", "[rank0]:step 2"),
                                  ("node2", "[rank10]:step 2"), ("node2", "[rank1]:step 3")]  # fmt: skip
    assert view(["node2"], [1], 1)[0] == [("node2", "[rank1]:step 3")]
    assert view([], [], 0)[0] == []


def test_a_host_without_lines_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert view(["node9"], [], None)[0] == []
    assert "no log line from node9 (hosts with lines in this run's logs: node1, node2)" in capsys.readouterr().err


def test_tail_with_follow_is_a_usage_error() -> None:
    r = CliRunner().invoke(app, ["logs", "-f", "--tail", "5"])
    assert r.exit_code == 2 and "--tail reads the log whole" in r.output
    r = CliRunner().invoke(app, ["logs", "--tail", "-1"])
    assert r.exit_code == 2
