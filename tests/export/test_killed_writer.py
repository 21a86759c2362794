"""A writer killed (SIGKILL) at a random moment while it exports, again and again, into one
folder: what it leaves is refused in one line or loads exactly the pipeline written, never a
mix; exporting into it again works."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PdcompileError
from pdcompile.pipeline import Pipeline
from tests.helpers.processes import finish_bounded, start_bounded

_WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.export.test_killed_writer import pipeline
pipe = pipeline()
pipe.export({out!r})
print("ready", flush=True)
while True:
    pipe.export({out!r})
"""


def pipeline() -> Pipeline:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 8))
    return pdcompile.compile(model, example_inputs=(torch.randn(16, 64),),
                             example_target=torch.randn(16, 8), loss_fn=nn.functional.mse_loss,
                             stages=[1, 1, 1], microbatches=2, cost="analytic")


def _weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [t for m in pipe.stage_modules for t in m.state_dict().values()]


@pytest.mark.slow
def test_a_writer_killed_at_random_leaves_no_mix(tmp_path: Path) -> None:
    expected = _weights(pipeline())
    root = str(Path(__file__).resolve().parents[2])
    rng = random.Random(0)
    outcomes = []
    for attempt in range(4):
        out = tmp_path / f"out{attempt}"
        proc = start_bounded([sys.executable, "-c", _WRITER.format(root=root, out=str(out))],
                             env={**os.environ, "PYTHONPATH": root})
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line + finish_bounded(proc, timeout=30, name="writer")
        time.sleep(rng.uniform(0.0, 0.3))
        os.killpg(proc.pid, signal.SIGKILL)
        finish_bounded(proc, timeout=30, name="writer")
        try:
            loaded = pdcompile.load(str(out))
        except PdcompileError as err:
            assert "\n" not in str(err) and str(out) in str(err)
            outcomes.append("refused")
        else:
            assert all(torch.equal(a, b) for a, b in zip(_weights(loaded), expected,
                                                          strict=True))
            outcomes.append("whole")
        pipeline().export(str(out))  # a folder a killed writer left takes a new export
        assert all(torch.equal(a, b) for a, b in zip(_weights(pdcompile.load(str(out))),
                                                      expected, strict=True))
    assert len(outcomes) == 4
