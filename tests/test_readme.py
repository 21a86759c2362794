"""The README's one-liner, exactly as printed, then the `pdcompile run` its last line names."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import run_bounded


def readme_block() -> str:
    """The Python block under "## The one-liner"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The one-liner"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's one-liner section has no python block"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_one_liner_then_pdcompile_run(tmp_path: Path) -> None:
    code = readme_block()
    command = re.search(r"#\s*then:\s*(pdcompile run .+)$", code, re.M)
    assert command, "the one-liner's last line names the `pdcompile run` command to try"
    (tmp_path / "one_liner.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run_bounded([sys.executable, "one_liner.py"], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stdout
    words = command.group(1).split()
    assert words[:2] == ["pdcompile", "run"]
    ran = run_bounded([sys.executable, "-m", "pdcompile", *words[1:]], cwd=tmp_path, env=env,
                      timeout=240)
    assert ran.returncode == 0, ran.stdout
    assert "training on the exported example minibatch, 20 times" in ran.stdout
    assert "step 20/20 loss" in ran.stdout
    assert "trained 20 minibatches" in ran.stdout
    export = tmp_path / words[2]
    assert not [p.name for p in export.iterdir() if p.suffix in (".pt", ".pkl", ".pth")]
