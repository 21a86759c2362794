"""The command line's conventions: help with examples, exit codes 0/1/2, one-line errors,
colour only on a terminal, --json output a machine can read."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdcompile.cli import SUBCOMMANDS, build_parser, colour_enabled, main
from tests.helpers.paths import ROOT

OWNED = ("inspect", "plan", "export", "demo")

MODEL = """
import torch
from torch import nn


def factory():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return model, (torch.randn(8, 8),)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return path


def _subparser(name: str) -> object:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]  # type: ignore[attr-defined,index]


@pytest.mark.parametrize("name", OWNED)
def test_help_explains_every_option(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"pdcompile {name}" in text and "Exit status" in text and "e.g." in text
    sub = _subparser(name)
    for action in sub._actions:  # type: ignore[attr-defined]
        if action.help == "==SUPPRESS==" or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings} has no help"


def test_no_command_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 1
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_option_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--no-such-option"])
    assert exit_info.value.code == 1
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_the_help_states_the_exit_status_bad_usage_gets(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A subcommand's help that names the exit status of bad usage names the one it exits
    with (four of them said 2 while every usage error exits 1)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--no-such-option"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = build_parser().format_help() + capsys.readouterr().out
    for stated in re.findall(r"(\d) (?:a user error or )?bad usage", help_text):
        assert int(stated) == exit_info.value.code, (command, help_text)


@pytest.mark.parametrize(("argv", "expect"), [
    (["plan", "missing.py:factory", "--cluster", "2"], "model file 'missing.py' does not exist"),
    (["plan", "nofactory", "--cluster", "2"], "must be written as path/to/file.py:factory"),
    (["plan", "--profile", "nowhere/graph.txt", "--cluster", "A"], "nowhere"),
    (["plan", "--costgraph", "nowhere.json", "--cluster", "A"], "nowhere.json"),
    (["plan", "--profile", "x", "--costgraph", "y"], "give exactly one of"),
    (["plan", "--profile", "x", "--cluster", "9z9"], "cluster"),
    (["inspect", "--costgraph", "nowhere.json"], "nowhere.json"),
    (["inspect"], "give exactly one of"),
    (["export", "missing.py:factory", "--out", "o"], "model file 'missing.py' does not exist"),
])
def test_user_errors_exit_1_with_one_line(argv: list[str], expect: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert expect in err
    assert err.count("\n") == 1, err
    assert err.startswith(f"pdcompile {argv[0]}: error: ")
    assert "\033[" not in err  # captured stderr is not a terminal: no colour


def test_colour_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert colour_enabled(Tty()) and not colour_enabled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colour_enabled(Tty())


def test_plan_json_is_the_plan(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{model_file}:factory", "--cluster", "2", "--cost", "analytic",
                 "--planner", "dp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "pdcompile.plan/1" and data["workers"] <= 2


def test_inspect_draw_without_graphviz(model_file: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "g.png"
    assert main(["inspect", f"{model_file}:factory", "--cost", "analytic", "--draw",
                 str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_export_json_and_bad_inputs(model_file: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exp"
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workers"] == 2 and data["command"] == f"pdcompile run {out} --nproc 2"
    assert data["plan"]["config"] == "straight" and (out / "plan.json").is_file()
    assert main(["export", f"{model_file}:factory", "--stages", "2,x", "--out", str(out)]) == 1
    assert "--stages '2,x'" in capsys.readouterr().err
    assert main(["export", f"{model_file}:factory", "--stages", "0", "--out", str(out)]) == 1
    assert "positive" in capsys.readouterr().err
    assert main(["export", f"{model_file}:factory", "--plan", str(tmp_path / "none.json"),
                 "--out", str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_export_keeps_autocast_and_clipping(model_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exp"
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--schedule", "1f1b-flush", "--autocast", "bfloat16",
                 "--clip-grad-norm", "0.5", "--json"]) == 0
    meta = json.loads((out / "pipeline.json").read_text())
    assert meta["autocast"] == "bfloat16" and meta["clip_grad_norm"] == 0.5
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--clip-grad-norm", "0.5"]) == 1  # asynchronous 1F1B: refused in one line
    assert "clip_grad_norm needs every stage's gradients" in capsys.readouterr().err


def test_export_keeps_the_inputs_named_unbatched(model_file: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """compile(unbatched=) had no option: a model of (k,) class weights at batch size k could
    not be exported from the command line without its weights cut into microbatches."""
    out = tmp_path / "exp"
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--schedule", "1f1b-flush", "--unbatched", "input_1", "--json"]) == 0
    assert json.loads((out / "pipeline.json").read_text())["unbatched"] == ["input_1"]
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--unbatched", "mask"]) == 1
    assert "unbatched=['mask']: 'mask' is not an input of the model" in capsys.readouterr().err


def test_export_keeps_the_batch_dimension(model_file: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """compile(batch_dim=) from the command line: --batch-dim (one number, or per input) and
    --target-batch-dim, kept in pipeline.json; a malformed one refused in one line."""
    out = tmp_path / "exp"
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--schedule", "1f1b-flush", "--batch-dim", "input_1=0",
                 "--target-batch-dim", "0", "--json"]) == 0
    assert json.loads((out / "pipeline.json").read_text())["batch_dims"] == {
        "default": 0, "inputs": {"input_1": 0}, "target": 0, "given": True}
    capsys.readouterr()
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out),
                 "--batch-dim", "input_1=first"]) == 1
    err = capsys.readouterr().err
    assert "--batch-dim 'input_1=first': write one dimension like 1" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("options", "message"), [
    (["--lr", "-1"], "--lr -1.0: a learning rate is a finite number 0 or more"),
    (["--lr", "nan"], "--lr nan: a learning rate is a finite number"),
    (["--lr", "inf"], "--lr inf: a learning rate is a finite number"),
    (["--momentum", "5"], "--momentum 5.0: SGD's momentum is at least 0 and below 1"),
    (["--momentum", "nan"], "--momentum nan: SGD's momentum"),
    (["--batch-dim", "7"], "batch_dim=7: no input has dimension 7 (input_1 (8, 8))"),
    (["--batch-dim", "input_1=2"], "batch_dim['input_1']=2: input 'input_1' has shape (8, 8), "
                                   "which has no dimension 2"),
])
def test_export_options_no_step_could_use_are_one_line(
        model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        options: list[str], message: str) -> None:
    """An optimizer or batch dimension the export could never train with is refused before
    anything is written: torch refused a negative --lr in a traceback and took NaN, infinite
    ones and a momentum of 5 without a word; a --batch-dim no input has sent every input whole
    to each microbatch, and the run failed in its workers on the target."""
    out = tmp_path / "exp"
    assert main(["export", f"{model_file}:factory", "--stages", "2", "--schedule",
                 "1f1b-flush", "--microbatches", "2", "--out", str(out), *options]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pdcompile export: error")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_console_entry_exit_codes(tmp_path: Path) -> None:
    """The real process: exit status 1 and one line for a user error, a usage error too."""
    bad = subprocess.run([sys.executable, "-m", "pdcompile", "plan", "--profile",
                          str(tmp_path / "none"), "--cluster", "A"],
                         capture_output=True, text=True, timeout=100, check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and not bad.stdout
    usage = subprocess.run([sys.executable, "-m", "pdcompile", "demo", "--workers", "0"],
                           capture_output=True, text=True, timeout=100, check=False)
    assert usage.returncode == 1 and usage.stderr.count("\n") == 1
    assert "pdcompile demo --help" in usage.stderr


def test_cli_reference_lists_every_option() -> None:
    """docs/cli.md (python docs/gen_cli.py) names every subcommand and option."""
    text = (ROOT / "docs" / "cli.md").read_text()
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    for name, sub in action.choices.items():  # type: ignore[union-attr]
        assert f"## `pdcompile {name}`" in text
        for option in sub._actions:
            for flag in option.option_strings:
                if option.help != "==SUPPRESS==":
                    assert flag in text, f"docs/cli.md lacks {name} {flag}: run docs/gen_cli.py"
