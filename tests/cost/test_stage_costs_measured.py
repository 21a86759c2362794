"""Stage costs from a recorded run: a local dry run of the compiled pipeline prices its stages."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PlanError
from pdcompile.timeline import stage_figures


def test_measured_compute_replaces_forward_backward_and_step() -> None:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01), plan=2)
    pipe.timed()
    pipe.train([((x,), y)] * 8)
    timeline = pipe.last_timeline
    assert timeline is not None
    base = StageCosts.uniform(2, fwd=1.0, bwd=2.0, params=1e6)
    measured = base.with_measured_compute(timeline)
    seen = stage_figures(timeline)
    assert measured.fwd == (seen[0]["fwd"], seen[1]["fwd"])
    assert measured.bwd == (seen[0]["bwd"], seen[1]["bwd"])
    assert all(0 < f < 1.0 for f in measured.fwd) and all(0 < b < 2.0 for b in measured.bwd)
    assert measured.optimizer is not None and all(s > 0 for s in measured.optimizer)
    assert measured.stash == (0.0, 0.0) and measured.params == base.params
    with pytest.raises(PlanError, match="stages \\[2\\]"):
        StageCosts.uniform(3, fwd=1.0, bwd=2.0).with_measured_compute(timeline)
