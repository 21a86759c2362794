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


def _compiled(model: nn.Module, stages: int, how: str) -> pdcompile.Pipeline:
    inputs, _ = _data(0)
    return pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                             loss_fn=nn.functional.cross_entropy, optimizer=_sgd,
                             stages=stages if how == "planner" else [1] * stages,
                             cost="analytic", schedule="1f1b-flush", microbatches=MICRO)


@settings(max_examples=12, deadline=None)
@given(which=st.sampled_from(sorted(MODELS)), stages=st.integers(2, 5),
       how=st.sampled_from(["planner", "straight"]))
def test_every_stage_count_trains_a_changed_buffer_like_one_process(which: str, stages: int,
                                                                    how: str) -> None:
    """`stages=K` (the planner's K stages) and `stages=[1] * K` (a straight cut) keep each
    changed buffer's nodes together before they cut: they cut between a queue's read and its
    refill, or a running mean's `mul_` and `add_`, and the split refused the cut (3 stages of
    the queue model, 4 of the running centre)."""
    model = MODELS[which]().double()
    inputs, target = _data(0)
    if how == "straight" and which in ("counted", "detached") and stages == 5:
        stages = 4  # what these two have left to cut between (the next test)
    pipe = _compiled(model, stages, how)
    assert len(pipe.plan.stages) == stages
    _trains_like_one_process(model, pipe, inputs, target, _sgd)


@pytest.mark.parametrize("which", sorted(MODELS))
@pytest.mark.parametrize("how", ["planner", "straight"])
def test_more_stages_than_a_changed_buffer_leaves_are_refused_in_one_line(which: str,
                                                                          how: str) -> None:
    """Only a K above what the model has left to cut between, its buffer's nodes counted as
    one, is refused: in one line naming the buffer and the largest K (which, for the straight
    cut, trains)."""
    model = MODELS[which]().double()
    inputs, target = _data(0)
    with pytest.raises(PlanError) as refused:
        _compiled(model, 20, how)
    message = str(refused.value)
    most = re.search(r"use at most (\d+) stages", message)
    assert most is not None and "\n" not in message, message
    assert re.search(rf"buffer '{BUFFERS[which]}'", message), message
    if how == "straight":
        pipe = _compiled(model, int(most.group(1)), how)
        _trains_like_one_process(model, pipe, inputs, target, _sgd)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_chunked_schedules_keep_a_changed_buffer_in_one_chunk(schedule: str) -> None:
    """Interleaved and V schedules cut 2 x K chunks; the queue's read and refill stay in one."""
    model = Queue().double()
    inputs, target = _data(0)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                             loss_fn=nn.functional.cross_entropy, optimizer=_sgd, stages=2,
                             cost="analytic", schedule=schedule, microbatches=MICRO)
    _trains_like_one_process(model, pipe, inputs, target, _sgd)


def test_a_planned_cluster_keeps_a_changed_buffer_in_one_stage() -> None:
    """`compile(model, "local-4")` planned a cut through the queue's changes, which the split
    refused; now it trains (replicated stages average their buffers, README's limits)."""
    model = Queue().double()
    inputs, target = _data(0)
    pipe = pdcompile.compile(copy.deepcopy(model), "local-4", example_inputs=inputs,
                             loss_fn=nn.functional.cross_entropy, optimizer=_sgd,
                             cost="analytic", schedule="1f1b-flush", microbatches=MICRO)
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    assert all(loss == loss for loss in losses)


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
