"""Optimizer steps timed on clones: the pipeline's weights and state stay untouched."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cost.optimizer_timing import time_optimizer_steps, time_weight_copies


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


def test_weight_copies_are_timed_per_stage_and_grow_with_the_weights() -> None:
    pipe = _pipe(functools.partial(torch.optim.SGD, lr=0.1))
    copies = time_weight_copies(pipe, repeats=9)
    assert len(copies) == 2 and all(c > 0 for c in copies)
    # stage 0 holds 64x512 + 512x512 weights, stage 1 512x4; the bigger stage copies longer
    sizes = [sum(p.numel() for p in m.parameters()) for m in pipe.stage_modules]
    bigger = max(range(2), key=lambda s: sizes[s])
    assert copies[bigger] > copies[1 - bigger]
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Flatten())  # stage 1: no parameters
    empty = pdcompile.compile(model, example_inputs=(torch.randn(4, 16),), plan=2)
    assert time_weight_copies(empty, repeats=1)[1] == 0.0


def test_weight_copies_refuse_meta_parameters_and_bad_repeats() -> None:
    pipe = _pipe(functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="repeats"):
        time_weight_copies(pipe, repeats=0)
    pipe.stage_modules[0].to("meta")
    with pytest.raises(ValueError, match="meta device"):
        time_weight_copies(pipe)


def test_steps_are_timed_after_evicting_the_caches_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pdcompile.cost.optimizer_timing as optimizer_cost

    flushes: list[int] = []

    class Counting:
        def __init__(self, device: torch.device) -> None:
            flushes.append(0)

        def __call__(self) -> None:
            flushes[-1] += 1

    monkeypatch.setattr(optimizer_cost, "CacheFlush", Counting)
    pipe = _pipe(functools.partial(torch.optim.SGD, lr=0.1))
    time_optimizer_steps(pipe, repeats=4)
    assert flushes == [4, 4]  # one before every timed step of each stage
    flushes.clear()
    time_optimizer_steps(pipe, repeats=4, caches="warm")
    assert flushes == []
    with pytest.raises(ValueError, match="caches='lukewarm'"):
        time_optimizer_steps(pipe, caches="lukewarm")
