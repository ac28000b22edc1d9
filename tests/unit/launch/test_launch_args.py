"""`nodeops launch` argument parsing (torchrun's and deepspeed's convention): options before the
script are nodeops', the script and everything after it are the script's, `--` is optional."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from nodeops.cli import app

CMD = typer.main.get_command(app).commands["launch"]  # type: ignore[attr-defined]


def parse(*argv: str) -> tuple[dict[str, object], list[str]]:
    ctx = CMD.context_class(CMD, info_name="launch")
    CMD.parse_args(ctx, list(argv))
    return ctx.params, ctx.args


@pytest.mark.parametrize(
    ("argv", "detach", "script", "args"),
    [
        (
            ["c.yaml", "train.py", "--lr", "1", "--detach", "-h"],
            False,
            None,
            ["train.py", "--lr", "1", "--detach", "-h"],
        ),
        (["--detach", "c.yaml", "--", "--x"], True, None, ["--x"]),
        (["c.yaml", "--detach", "train.py", "--", "x"], True, None, ["train.py", "--", "x"]),
        (["c.yaml", "--script", "run.sh", "--", "a"], False, "run.sh", ["a"]),
        (["c.yaml", "--script", "run.sh", "a", "--via", "x"], False, "run.sh", ["a", "--via", "x"]),
        (["--via", "ansible", "c.yaml", "t.py", "{{ 7*7 }}"], False, None, ["t.py", "{{ 7*7 }}"]),
    ],
)
def test_options_before_the_script_are_nodeops(argv: list[str], detach: bool, script: str | None,
                                               args: list[str]) -> None:  # fmt: skip
    params, rest = parse(*argv)
    assert (params["detach"], params["script"], rest) == (detach, script, args)


def test_a_misspelt_option_before_the_script_is_exit_2_and_runs_nothing(tmp_path: object) -> None:
    r = CliRunner().invoke(app, ["launch", "no-such-spec.yaml", "--detatch", "train.py"])
    assert r.exit_code == 2
    assert "No such option: --detatch" in r.output


def test_via_lists_its_choices() -> None:
    r = CliRunner().invoke(app, ["launch", "--via", "bogus", "c.yaml", "t.py"])
    assert r.exit_code == 2 and "ssh" in r.output and "ansible" in r.output


def test_launch_does_not_need_from_env_or_secret_variables_exported(tmp_path: object, monkeypatch: object) -> None:
    """launch sends no env values (the ranks read what setup wrote), so an unset from_env/secret
    variable is no reason to refuse: it gets past the spec stage to the hosts (here a closed port)."""
    from pathlib import Path

    mp: pytest.MonkeyPatch = monkeypatch  # type: ignore[assignment]
    d = Path(str(tmp_path))
    mp.setenv("NODEOPS_HOME", str(d / "home"))
    mp.delenv("NODEOPS_UNSET_TOKEN", raising=False)
    spec = d / "c.yaml"
    spec.write_text("nodes:\n  - {address: 127.0.0.1, cpus: [0]}\nssh: {g: {port: 1}}\nenv:\n"
                    "  TOKEN: {from_env: NODEOPS_UNSET_TOKEN, secret: true}\n"
                    "  PLAIN: {from_env: NODEOPS_UNSET_TOKEN}\n")  # fmt: skip
    r = CliRunner().invoke(app, ["launch", "--no-check", str(spec), "train.py"])
    assert "NODEOPS_UNSET_TOKEN" not in r.output
    assert r.exit_code == 1 and "launch failed on 127.0.0.1" in r.output, r.output


def test_usage_line_shows_the_script_and_its_arguments() -> None:
    r = CliRunner().invoke(app, ["launch", "-h"])
    assert r.exit_code == 0 and "[--] SCRIPT [ARGS]..." in r.output
