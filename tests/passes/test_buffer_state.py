"""A buffer that forward changes in place keeps its state in one stage, under any cut.

Each stage holds its own copy of the buffers it reads, and a buffer's value carries over from
one microbatch to the next. Cuts through a buffer's changes (`running.mul_(0.9)` in stage 0,
`.add_(...)` in stage 1), or between a read and a later change (a queue read for logits in
stage 0, refilled in stage 1), trained silently on copies that drifted apart: losses off by
1e-2, the state dict's running mean by 0.2. Even `compile(stages=2)` cut so. Now the split moves
those nodes into one stage (passes/buffer_state.py), or refuses the cut naming the buffer. That
stage's operations read a copy of the buffer (`h * self.scale` saved the buffer, which the next
forward changed before this backward: autograd refused it), and what a change writes into it is
detached (a detached value received from another stage took a gradient and gave the buffer an
autograd history).
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.passes.split import manual_plan
from tests.helpers.buffer_models import RunningCentre
from tests.helpers.random_models import random_cut
from tests.helpers.schedule_cuts import cut_graph, flush_reference

STEPS, BATCH, MICRO = 3, 8, 2


class Queue(nn.Module):
    """MoCo's queue: read for logits, then refilled with this microbatch's mean (no_grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.register_buffer("queue", torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        logits = h @ self.queue.clone().t()
        with torch.no_grad():
            self.queue[0] = h.mean(0)
            self.queue.copy_(self.queue.roll(1, 0))
        return self.b(h) + logits.sum(1, keepdim=True)


class Counted(nn.Module):
    """A step count and a decay the forward reads after changing them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.scale.mul_(0.9)
        return self.b(torch.tanh(self.a(x)) * self.scale) + self.steps


class DetachedAverage(nn.Module):
    """A running mean moved by a detached value, outside no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.running.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.b(h + self.running)


MODELS = {"centre": RunningCentre, "queue": Queue, "counted": Counted,
          "detached": DetachedAverage}
BUFFERS = {"centre": "running", "queue": "queue", "counted": "(steps|scale)",
           "detached": "running"}


def _data(seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    return (torch.randn(BATCH, 6, dtype=torch.float64),), torch.randint(0, 3, (BATCH,))


def _trains_like_one_process(model: nn.Module, pipe: pdcompile.Pipeline,
                             inputs: tuple[torch.Tensor], target: torch.Tensor,
                             optimizer: object) -> None:
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    want, state = flush_reference(model, inputs, target, nn.functional.cross_entropy, MICRO,
                                  STEPS, optimizer)  # type: ignore[arg-type]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64))
    got = pipe.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@settings(max_examples=30, deadline=None)
@given(which=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 2**16),
       stages=st.integers(2, 4), schedule=st.sampled_from(["1f1b-flush", "gpipe", "zb-h1"]))
def test_any_cut_keeps_a_changed_buffer_or_is_refused_naming_it(which: str, seed: int,
                                                                stages: int,
                                                                schedule: str) -> None:
    model = MODELS[which]().double()
    inputs, target = _data(seed)
    plan = random_cut(cut_graph(model, inputs), random.Random(seed), stages=stages,
                      replicas=[1] * stages)
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                                 loss_fn=nn.functional.cross_entropy, optimizer=_sgd,
                                 plan=plan, schedule=schedule, microbatches=MICRO)
    except PlanError as err:
        assert re.search(rf"buffer '{BUFFERS[which]}' is changed in place by .* one stage",
                         str(err)), str(err)
        return
    _trains_like_one_process(model, pipe, inputs, target, _sgd)


@pytest.mark.parametrize("which", sorted(MODELS))
@pytest.mark.parametrize("stages", [2, 3])
def test_compile_with_a_stage_count_trains_a_changed_buffer_like_one_process(
        which: str, stages: int) -> None:
    """The planner's cut of K stages (it cut between `mul_` and `add_` of the running mean)."""
    model = MODELS[which]().double()
    inputs, target = _data(0)
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                                 loss_fn=nn.functional.cross_entropy, optimizer=_sgd,
                                 stages=stages, cost="analytic", schedule="1f1b-flush",
                                 microbatches=MICRO)
    except PlanError as err:  # too few operations to keep the buffer apart from every cut
        assert stages == 3 and "buffer" in str(err), str(err)
        return
    _trains_like_one_process(model, pipe, inputs, target, _sgd)


def test_a_detached_value_from_an_earlier_stage_moves_a_buffer_without_autograd_history() -> None:
    """The received mean took a gradient, `add_` gave the buffer its autograd history, and the
    next microbatch's backward failed ("backward through the graph a second time")."""
    model = DetachedAverage().double()
    inputs, target = _data(0)
    gm = cut_graph(model, inputs)
    first = {"x", "a", "tanh", "detach", "mean"}
    assert first < {n.name for n in gm.graph.nodes}
    plan = manual_plan(gm, lambda node: 0 if node.name in first else 1)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                             loss_fn=nn.functional.cross_entropy, optimizer=_sgd, plan=plan,
                             schedule="1f1b-flush", microbatches=MICRO)
    _trains_like_one_process(model, pipe, inputs, target, _sgd)
