"""A stranger's checkout is the repository alone: no file of it (code, docs, help text,
examples, benchmarks, tests) names a folder beside it or this team's machines."""

from __future__ import annotations

import re

import pytest

from tests.helpers.paths import ROOT

OUTSIDE = ("../shared", '/ "shared"', "/work/")
"""Paths that exist on the team's machines only (a sibling folder named as text or joined as a
Path, the team's own folders)."""

SKIPPED = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache",
           "build", "dist"}


def _text_files() -> list[str]:
    files = []
    for path in sorted(ROOT.rglob("*")):
        parts = set(path.relative_to(ROOT).parts)
        if not path.is_file() or parts & SKIPPED or any(p.endswith(".egg-info") for p in parts):
            continue
        data = path.read_bytes()
        if b"\0" not in data[:4096]:  # text, not an image or a wheel
            files.append(str(path.relative_to(ROOT)))
    return files


def test_no_file_names_a_place_outside_the_repository() -> None:
    named = [f"{name}: {needle}" for name in _text_files()
             for needle in OUTSIDE if needle in (ROOT / name).read_text(errors="replace")
             and name != "tests/test_repository.py"]
    assert not named, "files that name places a fresh clone lacks:\n" + "\n".join(named)


def test_the_scan_reads_the_repository() -> None:
    files = _text_files()
    assert "README.md" in files and "pdcompile/__init__.py" in files
    assert not [f for f in files if f.endswith(".png")]
    if not files:
        pytest.fail("no text file found under the repository")


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the command the README gives for the tests, word for word."""
    ci = re.search(r"^TEST_COMMAND='(.+)'", (ROOT / ".ci" / "run").read_text(), re.M)
    assert ci, ".ci/run names its TEST_COMMAND"
    readme = (ROOT / "README.md").read_text()
    two = readme[readme.index("## Two commands"):]
    block = re.search(r"```bash\n(.*?)```", two, re.S)
    assert block, "the README's \"Two commands\" section has a bash block"
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert ci.group(1) in lines, (ci.group(1), lines)


def test_results_page_is_assembled_from_the_results_files() -> None:
    """benchmarks/RESULTS.md is the concatenation of benchmarks/results/*.md: a section written
    into RESULTS.md alone is lost by the next `python benchmarks/assemble_results.py` (three
    sections were, once); write it into its results file and assemble."""
    import runpy

    assemble = runpy.run_path(str(ROOT / "benchmarks" / "assemble_results.py"))["assemble"]
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == assemble(ROOT / "benchmarks" /
                                                                       "results")
