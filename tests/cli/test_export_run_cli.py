"""`pdcompile export FILE.py:factory` then `pdcompile run DIR`, as a user would type them, on a
model file outside the package (its `loss_fn` beside the factory): both succeed, from another
folder and after the model file is gone, with pdcompile.load's losses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import pdcompile
from tests.helpers.model_files import MODEL_FILE
from tests.helpers.paths import ROOT
from tests.helpers.processes import printed_losses, run_bounded


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_a_model_file_then_run(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "mynet.py").write_text(MODEL_FILE)
    env = {**os.environ, "PDCOMPILE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = run_bounded([sys.executable, "-m", "pdcompile", "export", "mynet.py:factory",
                        "--stages", "2", "--out", "exp/"], cwd=models, env=env, timeout=240,
                       name="pdcompile export")
    assert done.returncode == 0, done.stdout
    assert "warn" not in done.stdout.lower(), done.stdout  # nothing was left unsaved
    folder = models / "exp"
    (models / "mynet.py").unlink()  # what runs is the export's own copy
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    example = pdcompile.load(str(folder))
    inputs, target = example.example_inputs, example.example_target
    assert inputs is not None and isinstance(target, torch.Tensor)
    want = example.train([(inputs, target)] * 3)
    ran = run_bounded([sys.executable, "-m", "pdcompile", "run", str(folder), "--steps", "3",
                       "--threads", "1"], cwd=elsewhere, env=env, timeout=240,
                      name="pdcompile run")
    assert ran.returncode == 0, ran.stdout
    assert "trained 3 minibatches" in ran.stdout
    assert printed_losses(ran.stdout) == pytest.approx(want, rel=1e-6)
    sys.modules.pop("pdcompile_user_mynet", None)  # imported here by pdcompile.load
