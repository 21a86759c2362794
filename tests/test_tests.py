"""The tests' own rules: test modules import only tests.helpers, never each other; every folder
of tests/ is a package; outside the slow lane no test starts a process."""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`; relative imports keep their dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_test_modules_import_only_the_helpers() -> None:
    wrong = [f"{path.relative_to(TESTS.parent)}:{line}: imports {name}"
             for path in sorted(TESTS.rglob("*.py")) for line, name in _imported(path)
             if name.startswith(".") or name.split(".")[-1].startswith("test_")
             or (name.startswith("tests") and name != "tests.helpers"
                 and not name.startswith("tests.helpers."))]
    assert not wrong, "put what tests share in tests/helpers/:\n" + "\n".join(wrong)


def test_every_folder_is_a_package() -> None:
    folders = {path.parent for path in TESTS.rglob("*.py")}
    assert not sorted(str(f) for f in folders if not (f / "__init__.py").is_file())


def test_the_fast_lane_refuses_a_python_process() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest\.mark\.slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(pytest.fail.Exception, match="a multiprocessing child"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_the_slow_lane_starts_processes() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=60).returncode == 0
