"""Inputs that hold no samples (a (seq, seq) mask, per-class weights, a 0-d temperature) on gloo
processes: every microbatch of every rank that reads them gets them whole, on a pipeline of two
stages and on one stage replicated over two processes (each replica is dealt microbatches of
the samples and the whole mask), with `unbatched=` naming the weights where the batch size
equals the count of classes. Losses and final parameters equal one process's gradient
accumulation (flush schedules) and the local backend (asynchronous 1F1B).
tests/pipeline/test_unbatched_inputs.py covers the local backend."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.worker import train_processes
from tests.helpers.masked_model import CLASSES, SEQ, Masked, accumulated, sgd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, MICRO = 3, 2


def _whole() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.tril(torch.ones(SEQ, SEQ, dtype=torch.float64)),
            torch.rand(CLASSES, generator=gen, dtype=torch.float64) + 0.5,
            torch.tensor(2.0, dtype=torch.float64))


def minibatches(batch: int, steps: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [((torch.randn(batch, SEQ, 5, generator=gen, dtype=torch.float64), *_whole()),
             torch.randn(batch, CLASSES, generator=gen, dtype=torch.float64))
            for _ in range(steps)]


def _model() -> Masked:
    torch.manual_seed(0)
    return Masked().double()


def _pipeline(layout: str, schedule: str, batch: int) -> pdcompile.pipeline.Pipeline:
    """`layout`: 'two stages' (from b's call on: stage 1) or 'replicated' (one stage on
    two processes)."""
    model = _model()
    if layout == "two stages":
        plan = manual_plan(trace(model), {"b": 1})  # what follows b's call goes with it
    else:
        plan = manual_plan(trace(model), lambda n: 0, replicas=[2])
    (inputs, target), = minibatches(batch, 1)
    return pdcompile.compile(model, example_inputs=inputs, example_target=target,
                             loss_fn=F.mse_loss, optimizer=sgd, schedule=schedule,
                             microbatches=MICRO if schedule != "1f1b" else None, plan=plan,
                             unbatched=["weight"] if batch == CLASSES else None)


def _one_process(batch: int, micro: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    return accumulated(model, minibatches(batch, STEPS), micro), model.state_dict()


@pytest.mark.parametrize(("layout", "schedule", "batch"), [
    ("two stages", "1f1b-flush", 6),
    ("replicated", "1f1b-flush", 8),
    ("two stages", "gpipe", CLASSES),  # the weights' size is the batch size: named unbatched
    ("replicated", "1f1b", 6),
])
def test_whole_inputs_train_on_processes_as_in_one(tmp_path: Path, layout: str, schedule: str,
                                                   batch: int) -> None:
    pipe = _pipeline(layout, schedule, batch)
    assert set(pipe.whole_inputs) == {"mask", "weight"}  # (a 0-d temperature has no rows)
    pipe.export(str(tmp_path / "pipe"))
    data = functools.partial(minibatches, batch, STEPS)
    run = train_processes(tmp_path / "pipe", 2, data, steps=STEPS, timeout=200)
    if schedule == "1f1b":  # asynchronous: as the local backend runs it
        want = pipe.train(minibatches(batch, STEPS))
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
        return
    # flush schedules: one process's accumulation; a replicated stage's two replicas each
    # take MICRO microbatches of half the minibatch, so the minibatch counts 2 x MICRO parts
    micro = MICRO * (2 if layout == "replicated" else 1)
    want, state = _one_process(batch, micro)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
    local = _pipeline(layout, schedule, batch)
    local.train(minibatches(batch, STEPS))
    for name, value in state.items():
        torch.testing.assert_close(local.state_dict()[name], value, msg=name)
