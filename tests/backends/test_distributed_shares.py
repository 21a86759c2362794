"""Replicas with unequal shares of each round (`Stage.shares`) on gloo processes: an export of a
plan whose stage 0 runs on two ranks taking two of every three minibatches (or microbatches)
and one trains as the local backend does (which tests/runtime/test_proportional_shares.py
checks against one process and PipeDream's rule)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, BATCH, STEPS = 8, 6, 6


def minibatches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,),
                                                                      generator=gen))
            for _ in range(steps)]


def _pipeline(schedule: str, microbatches: int | None) -> pdcompile.pipeline.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3))
    plan = manual_plan(trace(model), lambda n: 1 if str(n.target) == "2" else 0,
                       replicas=[2, 1])
    plan = replace(plan, stages=(replace(plan.stages[0], shares=(2, 1)), plan.stages[1]))
    return pdcompile.compile(model, example_inputs=(torch.randn(BATCH, WIDTH),),
                             example_target=torch.randint(0, 3, (BATCH,)),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                             schedule=schedule, microbatches=microbatches, plan=plan)


@pytest.mark.parametrize(("schedule", "microbatches"), [("1f1b", None), ("1f1b-flush", 3)])
def test_shares_train_on_processes_as_on_the_local_backend(tmp_path: Path, schedule: str,
                                                            microbatches: int | None) -> None:
    pipe = _pipeline(schedule, microbatches)
    pipe.export(str(tmp_path / "pipe"))
    assert pdcompile.load(str(tmp_path / "pipe")).plan.stages[0].shares == (2, 1)
    run = train_processes(tmp_path / "pipe", 3, functools.partial(minibatches, STEPS),
                          steps=STEPS, timeout=200)
    local = pipe.train(minibatches(STEPS))
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(local))
