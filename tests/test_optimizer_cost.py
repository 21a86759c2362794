"""Optimizer steps timed on clones: the pipeline's weights and state stay untouched."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.optimizer_cost import time_optimizer_steps


def _pipe(optimizer: object) -> pdcompile.Pipeline:
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 4))
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 64),),
                             loss_fn=nn.functional.cross_entropy, optimizer=optimizer, plan=2)


def test_steps_are_timed_per_stage_without_touching_the_pipeline() -> None:
    pipe = _pipe(functools.partial(torch.optim.Adam, lr=0.1))
    before = [{n: p.detach().clone() for n, p in m.named_parameters()}
              for m in pipe.stage_modules]
    steps = time_optimizer_steps(pipe, repeats=3)
    assert len(steps) == 2 and all(s > 0 for s in steps)
    for module, saved in zip(pipe.stage_modules, before, strict=True):
        for name, p in module.named_parameters():
            assert torch.equal(p, saved[name]) and p.grad is None
    assert all(not opt.state for opt in pipe.optimizers)


def test_adam_costs_more_than_sgd_on_the_same_stages() -> None:
    # Adam makes several passes over four tensors per parameter; SGD without momentum one
    adam = time_optimizer_steps(_pipe(functools.partial(torch.optim.Adam, lr=0.1)), repeats=9)
    sgd = time_optimizer_steps(_pipe(functools.partial(torch.optim.SGD, lr=0.1)), repeats=9)
    assert sum(adam) > sum(sgd)


def test_bad_repeats_is_refused() -> None:
    with pytest.raises(ValueError, match="repeats"):
        time_optimizer_steps(_pipe(functools.partial(torch.optim.SGD, lr=0.1)), repeats=0)
