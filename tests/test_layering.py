"""Layers (tests/helpers/layering.py): every import of pdcompile points down, no import cycles,
and the checker itself catches an upward import and a cycle in a small package made for the
purpose."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.layering import (
    LAYERS,
    Layer,
    imports,
    layer_of,
    layer_table,
    modules,
    violations,
)
from tests.helpers.paths import ROOT

FAKE_LAYERS = (Layer("low", ("fake.low",), "below"), Layer("high", ("fake.high",), "above"))


def _package(root: Path, files: dict[str, str]) -> Path:
    (root / "fake").mkdir()
    (root / "fake" / "__init__.py").write_text('"""A package for the checker."""\n')
    for name, text in files.items():
        path = root / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_an_upward_import_is_named_with_its_line(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low.py": '"""Low."""\n\n\ndef f() -> None:\n    from fake.high import g  # upward\n',
        "high.py": '"""High."""\nfrom fake import low\n\n\ndef g() -> None:\n    pass\n'})
    layers = (Layer("root", ("fake",), "the package"), *FAKE_LAYERS)
    found = violations(root, "fake", layers, apart=())
    assert len(found) == 2, found
    upward = next(v for v in found if "higher" in v)
    assert upward.startswith("fake/low.py:5: fake.low (layer low) imports fake.high (layer high")
    assert next(v for v in found if v.startswith("import cycle")) == (
        "import cycle among fake.high, fake.low: fake/high.py:2 fake.high -> fake.low; "
        "fake/low.py:5 fake.low -> fake.high")


def test_downward_imports_pass_and_a_module_without_a_layer_is_named(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low.py": '"""Low."""\n',
        "high.py": '"""High."""\nfrom . import low\nimport fake.low as again\n',
        "stray.py": '"""Nowhere."""\n'})
    layers = (Layer("root", ("fake",), "the package"), *FAKE_LAYERS)
    assert [(i.source, i.target, i.line) for i in imports(root, "fake")] == [
        ("fake.high", "fake.low", 2), ("fake.high", "fake.low", 3)]
    assert violations(root, "fake", layers, apart=()) == [
        "fake.stray (fake/stray.py) has no layer: add it to LAYERS in tests/helpers/layering.py"]


def test_type_checking_imports_and_rooms_kept_apart_count(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a/__init__.py": '"""Room a."""\n', "b/__init__.py": '"""Room b."""\n',
        "a/x.py": ('"""x."""\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n'
                   '    from fake.b.y import Y\n'),
        "b/y.py": '"""y."""\n\n\nclass Y:\n    pass\n'})
    layers = (Layer("rooms", ("fake", "fake.a", "fake.b"), "two rooms"),)
    assert violations(root, "fake", layers, apart=[("fake.a", "fake.b")]) == [
        "fake/a/x.py:5: fake.a.x imports fake.b.y, but fake.a and fake.b do not import each "
        "other"]


def test_the_longest_pattern_decides_and_the_bare_package_is_its_init_alone() -> None:
    layers = (Layer("one", ("p.cost",), ""), Layer("two", ("p", "p.cost.measure"), ""))
    assert layer_of("p.cost.links", layers) == 0
    assert layer_of("p.cost.measure", layers) == 1
    assert layer_of("p", layers) == 1
    assert layer_of("p.other", layers) is None


def test_the_table_renders_highest_first() -> None:
    table = layer_table(FAKE_LAYERS).splitlines()
    assert table[2] == "| high | `fake.high` | above |"
    assert table[3] == "| low | `fake.low` | below |"


def test_pdcompile_imports_only_downward_and_has_no_cycles() -> None:
    found = violations(ROOT, "pdcompile")
    assert not found, "\n".join(found)


def test_the_architecture_page_shows_the_layer_table() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    start = page.index("<!-- layer table")
    start = page.index("\n", start) + 1
    end = page.index("<!-- end of layer table -->")
    assert page[start:end] == layer_table(LAYERS), \
        "docs/architecture.md's layer table differs from tests/helpers/layering.py: paste " \
        "`python tests/helpers/layering.py`'s table there"


def test_every_room_says_what_it_is_and_its_init_imports_only_its_own_room() -> None:
    found = modules(ROOT, "pdcompile")
    rooms = [m for m, path in found.items() if path.name == "__init__.py" and "." in m]
    assert {"pdcompile.schedule", "pdcompile.cost", "pdcompile.machine", "pdcompile.planner",
            "pdcompile.viz", "pdcompile.export", "pdcompile.runtime", "pdcompile.util",
            } <= set(rooms)
    for room in rooms:
        tree = ast.parse(found[room].read_text())
        assert ast.get_docstring(tree), f"{found[room]} needs a docstring saying what the room is"
    outside = [f"{i.file.relative_to(ROOT)}:{i.line} imports {i.target}"
               for i in imports(ROOT, "pdcompile")
               if i.source in rooms and i.source != "pdcompile.cli"
               and not i.target.startswith(i.source + ".")]
    assert not outside, outside


@pytest.mark.slow
def test_planning_a_profile_imports_no_torch(profiles_dir: Path) -> None:
    """The CostGraph, the cost formulas, the planner and the simulator are torch-free: planning
    a PipeDream profile in a fresh interpreter loads no torch."""
    code = ("import sys, pdcompile\nfrom pdcompile.profiles import load_pipedream\n"
            "plan = pdcompile.plan(load_pipedream(sys.argv[1]), 'A')\n"
            "print(plan.config, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(profiles_dir / "alexnet" / "graph.txt")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False", done.stdout
