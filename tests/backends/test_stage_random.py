"""Each stage of a pipeline draws its random numbers from a stream of its own
(runtime/stage_random.py). Every worker is seeded alike (so that readers draw the same data);
drawn from that one stream, a dropout on stage 1 drew the very mask that a dropout of the same
shape on stage 0 had drawn, which no single process does. Here two such dropouts subtract:
identical masks gave a loss of exactly 0 on every step. The local backend draws from the same
per-stage streams, so a distributed run and a local one of the same seed are equal."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdcompile
from pdcompile.worker import train_processes
from tests.helpers.random_models import manual_plan
from tests.helpers.schedule_cuts import cut_graph

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, BATCH, STEPS = 16, 4, 3


class TwinDropouts(nn.Module):
    """Two dropouts of one shape, one per stage, subtracted: 0 where their masks agree."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.ones(WIDTH))
        self.second = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.dropout(x * self.first, 0.5, self.training)
        return a - F.dropout(x * self.second, 0.5, self.training)


def squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def ones() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in range(STEPS):
        yield torch.ones(BATCH, WIDTH), torch.zeros(BATCH, WIDTH)


def _pipeline() -> pdcompile.Pipeline:
    model, x = TwinDropouts(), torch.ones(BATCH, WIDTH)
    gm = cut_graph(model, (x,))
    second = {"second", "mul_1", "dropout_1", "sub"}  # the second dropout and what reads it
    plan = manual_plan(gm, {n.name: int(n.name in second) for n in gm.graph.nodes
                            if n.op not in ("output", "get_attr")}, replicas=[1, 1])
    assert len(plan.stages) == 2
    return pdcompile.compile(model, example_inputs=(x,), example_target=torch.zeros(BATCH, WIDTH),
                             loss_fn=squared, optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                             schedule="1f1b-flush", microbatches=2, plan=plan)


def test_stages_draw_independent_dropout_masks_on_every_backend(tmp_path: Path) -> None:
    pipe = _pipeline()
    pipe.export(str(tmp_path / "pipe"))
    distributed = train_processes(tmp_path / "pipe", 2, ones, steps=STEPS, timeout=120).losses
    assert all(loss > 0 for loss in distributed), distributed  # masks that differ somewhere
    torch.manual_seed(pipe.seed)  # as every worker was seeded
    local = pdcompile.load(str(tmp_path / "pipe")).train(list(ones()))
    assert local == pytest.approx(distributed, rel=1e-12)
