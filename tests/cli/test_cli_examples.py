"""The example commands in the CLI's help texts work as written: every one parses, every model,
profile and file it names exists, and the cheap ones (inspect) run.

Examples are written to be run from the repository root (as in docs/cli.md) and name the
profiles the package ships by name; the runs here happen in a scratch folder, so their output
files land in a temporary folder.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from pdcompile.cli import SUBCOMMANDS, build_parser, main
from pdcompile.profiles import shipped_profiles
from tests.helpers.paths import ROOT

MODEL_SPEC = re.compile(r"[\w./-]+:factory\b")


def _examples() -> list[tuple[str, list[str], str | None]]:
    """(subcommand, argv, stdout redirect) of every `pdcompile ...` line of the subcommands'
    help texts (their module docstrings, shown by --help), with `\\` continuations joined."""
    found = []
    for name in SUBCOMMANDS:
        lines = (importlib.import_module(f"pdcompile.cli.{name}_cmd").__doc__ or "").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            while line.endswith("\\"):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if not line.startswith("pdcompile "):
                continue
            words = shlex.split(line, comments=True)[1:]
            redirect = None
            if ">" in words:
                at = words.index(">")
                words, redirect = words[:at], words[at + 1]
            found.append((name, words, redirect))
    return found


EXAMPLES = _examples()


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _resolves(spec: str, base: Path) -> bool:
    """Whether a MODEL spec (path/to/file.py:factory or package.module:factory) names a factory
    that exists (a file under `base`, or an importable module), without calling it."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        file = base / where
        return file.is_file() and f"def {name}(" in file.read_text()
    try:
        return callable(getattr(importlib.import_module(where), name, None))
    except ImportError:
        return False


def test_every_subcommand_with_examples_is_covered() -> None:
    assert {name for name, _, _ in EXAMPLES} >= {"inspect", "plan", "simulate", "export", "demo"}
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize(("name", "argv", "redirect"), EXAMPLES,
                         ids=[" ".join(argv)[:60] for _, argv, _ in EXAMPLES])
def test_example_parses_and_names_files_that_exist(name: str, argv: list[str],
                                                   redirect: str | None) -> None:
    args = _parse(argv)
    assert args.command == name
    model = getattr(args, "model", None)
    if model is not None:
        assert _resolves(model, ROOT), f"`pdcompile {' '.join(argv)}`: no model {model}"
    profile = getattr(args, "profile", None)
    if profile is not None:
        assert (ROOT / profile).exists() or profile in shipped_profiles(), \
            f"`pdcompile {' '.join(argv)}`: no profile {profile}"
    costgraph = getattr(args, "costgraph", None)
    if costgraph is not None:  # written by an earlier example (inspect --json / --save)
        assert any(costgraph in (r, *a) for _, a, r in EXAMPLES if a[0] == "inspect"), costgraph


def test_model_specs_in_all_help_texts_exist() -> None:
    """Option help and descriptions ("e.g. pdcompile.models.vgg16:factory") of every
    subcommand, and the error for a malformed MODEL, name factories that exist."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = [parser.format_help()] + [child.format_help() for child in sub.choices.values()]
    from pdcompile.cli.common import load_factory
    from pdcompile.errors import PdcompileError

    with pytest.raises(PdcompileError) as err:
        load_factory("no-colon")
    texts.append(str(err.value))
    specs = {spec for text in texts for spec in MODEL_SPEC.findall(text)}
    specs -= {"path/to/file.py:factory", "package.module:factory"}  # the grammar, not examples
    assert specs, "no example model in the help texts"
    missing = sorted(spec for spec in specs if not _resolves(spec, ROOT))
    assert not missing, f"help texts name models that do not exist: {missing}"


@pytest.mark.slow
def test_inspect_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """The inspect examples (a few seconds in all) run as written, in the repository layout."""
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "pdcompile").symlink_to(ROOT / "pdcompile")
    monkeypatch.chdir(tmp_path / "main")
    ran = 0
    for name, argv, redirect in EXAMPLES:
        if name != "inspect":
            continue
        capsys.readouterr()
        assert main(argv) == 0, f"`pdcompile {' '.join(argv)}` failed: {capsys.readouterr().err}"
        out = capsys.readouterr().out
        assert out.strip()
        if redirect:
            Path(redirect).write_text(out)
        ran += 1
    assert ran >= 4
    assert Path("g.svg").is_file() and Path("graph.png").is_file()
