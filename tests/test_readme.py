"""The README's Python blocks run as a user pasting each one into a script would: written to a
file, run with `python3 FILE` in a fresh folder with an empty cache (a machine where nothing
was measured yet), then the `pdcompile run` a block's last line names."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import run_bounded


def python_blocks() -> dict[str, str]:
    """Every ```python block of the README, keyed by the heading above it (numbered when a
    section has several)."""
    text = (ROOT / "README.md").read_text()
    blocks: dict[str, str] = {}
    heading = "top"
    # a heading, a python block, or another block (whose `# comments` are no headings)
    for match in re.finditer(r"^(#+ [^\n]+)$|^```python\n(.*?)^```|^```.*?^```", text,
                             re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
            continue
        if match.group(2) is None:
            continue
        key, n = heading, 2
        while key in blocks:
            key, n = f"{heading} ({n})", n + 1
        blocks[key] = match.group(2)
    return blocks


BLOCKS = python_blocks()


def test_the_readme_blocks_are_found_and_are_python() -> None:
    assert {"The one-liner", "Interleaved and zero-bubble schedules"} <= set(BLOCKS)
    for heading, code in BLOCKS.items():
        compile(code, f"README.md, {heading}", "exec")  # a SyntaxError names the block
        assert "=..." not in code.replace(" ", ""), f"{heading}: a placeholder is not a script"


def _fresh_machine(tmp_path: Path) -> dict[str, str]:
    """This checkout's package, an empty cache folder and no override of what it measures."""
    env = {**os.environ, "PDCOMPILE_CACHE": str(tmp_path / "empty-cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("PDCOMPILE_LOCAL_BANDWIDTH", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("heading", list(BLOCKS))
def test_a_readme_block_runs_as_a_script(heading: str, tmp_path: Path) -> None:
    code = BLOCKS[heading]
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    env = _fresh_machine(tmp_path)
    done = run_bounded([sys.executable, script.name], cwd=tmp_path, env=env, timeout=300,
                       name=f"README block under {heading!r}")
    assert done.returncode == 0, done.stdout
    command = re.search(r"#\s*then:\s*(pdcompile run .+)$", code, re.M)
    if command is None:
        return
    words = command.group(1).split()
    ran = run_bounded([sys.executable, "-m", "pdcompile", *words[1:]], cwd=tmp_path, env=env,
                      timeout=240, name=command.group(1))
    assert ran.returncode == 0, ran.stdout
    assert "training on the exported example minibatch, 20 times" in ran.stdout
    assert "step 20/20 loss" in ran.stdout
    assert "trained 20 minibatches" in ran.stdout
    export = tmp_path / words[2]
    assert not [p.name for p in export.iterdir() if p.suffix in (".pt", ".pkl", ".pth")]


def test_the_one_liner_names_the_run_to_try() -> None:
    assert re.search(r"#\s*then:\s*pdcompile run \S+$", BLOCKS["The one-liner"], re.M)
