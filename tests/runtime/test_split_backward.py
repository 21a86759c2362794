"""The B/W split of zero-bubble schedules and the chunked ranks of interleaved ones, at runtime.

B computes the input gradients (and the gradients of weights outside Linear layers) and defers
each Linear layer's dW = gy^T x to W; interleaved ranks hold one runtime per chunk. The results
equal ordinary training (tests/pipeline/test_schedules_transparency.py); here: that the work
really moves to W, that the recorded run follows the schedule, and the errors a user can meet.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError, PlanError, ScheduleError
from pdcompile.passes.fuse import split_weight_gradients
from pdcompile.passes.split import even_plan
from pdcompile.passes.trace import trace
from pdcompile.planner.interleave import balanced_chunks, interleave, interleaved_plan
from pdcompile.runtime.chunks import ChunkRuntimes
from pdcompile.runtime.linear_grads import (
    accumulating_grads,
    deferring_weight_grads,
    run_weight_grads,
    weight_grad_queue,
)
from pdcompile.schedule.ir import Kind


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def _b_alongside(gm: torch.fx.GraphModule, reference: nn.Module, x: torch.Tensor) -> list:
    """The backward (B) of `gm` on `x` with weight gradients deferred, and of `reference` by
    plain autograd; the input gradients equal. Returns the queue of deferred W work."""
    x = x.clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    queue: list = []
    with accumulating_grads(), deferring_weight_grads(queue):
        out = gm(x)
    out.square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    return queue


def test_b_defers_the_linear_weight_gradients_to_w() -> None:
    model = _mlp()
    reference = _mlp()
    gm = trace(model)
    assert split_weight_gradients(gm) == 3
    assert split_weight_gradients(gm) == 3  # idempotent
    queue = _b_alongside(gm, reference, torch.randn(5, 6))  # B: the input gradient, at once
    linears = [name for name, m in reference.named_modules() if isinstance(m, nn.Linear)]
    for name in linears:
        assert gm.get_submodule(name).weight.grad is None, name  # deferred
    assert gm.get_submodule("1").weight.grad is not None  # LayerNorm: computed in B
    assert len(queue) == 3
    run_weight_grads(queue)  # W
    assert not queue
    for name, param in reference.named_parameters():
        torch.testing.assert_close(gm.get_parameter(name).grad, param.grad, msg=name)


class _Scale(torch.autograd.Function):
    """y = x * s for a parameter s whose gradient joins the B/W split through the queue."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, s)
        ctx.queue = weight_grad_queue()
        return x * s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, s = ctx.saved_tensors
        if ctx.queue is None:
            return grad * s, (grad * x).sum().reshape(s.shape)

        def weight() -> None:  # a saved leaf unpacks as the leaf itself
            update = (grad * x).sum().reshape(s.shape)
            s.grad = update if s.grad is None else s.grad + update

        ctx.queue.append(weight)
        return grad * s, None


def test_a_custom_function_joins_the_split_through_the_queue() -> None:
    s = torch.tensor([3.0], requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    queue: list = []
    with deferring_weight_grads(queue):
        y = _Scale.apply(x, s)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))
    assert s.grad is None and len(queue) == 1
    run_weight_grads(queue)
    torch.testing.assert_close(s.grad, x.detach().sum().reshape(1))
    assert weight_grad_queue() is None  # outside the context


def test_outside_the_deferring_context_nothing_waits() -> None:
    gm = trace(_mlp())
    split_weight_gradients(gm)
    with accumulating_grads():
        gm(torch.randn(2, 6)).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())


def _pipeline(schedule: str, plan: pdcompile.Plan) -> pdcompile.pipeline.Pipeline:
    model = _mlp()
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 6),),
                             loss_fn=nn.functional.cross_entropy, schedule=schedule,
                             microbatches=4, plan=plan, fuse=False)


def test_a_recorded_zero_bubble_run_follows_the_schedule() -> None:
    pipe = _pipeline("zb-h1", even_plan(trace(_mlp()), 3)).timed()
    pipe.step(torch.randn(8, 6), target=torch.randint(0, 3, (8,)))
    assert pipe.last_timeline is not None
    pipe.last_timeline.check_schedule(pipe.schedule())
    weights = [a for _, a in pipe.last_timeline.compute_events() if a.kind == Kind.W]
    assert len(weights) == 3 * 4
    # fuse=False still splits: a zero-bubble schedule needs the rewritten Linear calls
    assert "linear_accumulate" in pipe.stage_modules[0].code


def test_an_interleaved_rank_runs_one_runtime_per_chunk() -> None:
    pipe = _pipeline("interleaved-1f1b", interleaved_plan(trace(_mlp()), 2, 2)).timed()
    assert pipe.stages_of(0) == (0, 2) and pipe.plan.workers == 2
    pipe.step(torch.randn(8, 6), target=torch.randint(0, 3, (8,)))
    runtimes = pipe.last_runtimes
    assert set(runtimes) == {0, 1}
    assert isinstance(runtimes[1], ChunkRuntimes) and sorted(runtimes[1].chunks) == [1, 3]
    assert sorted(runtimes[1].losses) == [0, 1, 2, 3]
    assert pipe.last_timeline is not None
    pipe.last_timeline.check_schedule(pipe.schedule())
    with pytest.raises(ScheduleError, match="rank 1 holds stages \\[1, 3\\], not stage 2"):
        runtimes[1].chunk(2)
    assert len(pipe.optimizers) == 4
    with pytest.raises(PipelineInputError, match="rank 0 runs stages \\[0, 2\\], not stage 1"):
        pipe.state(0, 1)


def test_placements_and_schedules_that_do_not_go_together() -> None:
    gm = trace(_mlp())
    with pytest.raises(PipelineInputError, match="run it with one of the interleaved schedules"):
        _pipeline("1f1b-flush", interleaved_plan(gm, 2, 2))
    with pytest.raises(PipelineInputError, match="needs a plan with several chunks per rank"):
        _pipeline("interleaved-1f1b", even_plan(gm, 2))
    with pytest.raises(PipelineInputError, match="run every stage on one worker"):
        _pipeline("zb-h1", even_plan(gm, 2, replicas=[2, 1]))
    with pytest.raises(PlanError, match="v >= 2 chunks on each of p >= 2 ranks"):
        interleave(even_plan(gm, 3), 2)
    with pytest.raises(PlanError, match="stages \\[0\\] of the plan are replicated"):
        interleave(even_plan(gm, 4, replicas=[2, 1, 1, 1]), 2)
    with pytest.raises(PlanError, match="only when none of them is replicated"):
        plan = interleave(even_plan(gm, 4), 2)
        replace(plan, stages=(replace(plan.stages[0], replicas=2, ranks=(0, 1)),
                              *plan.stages[1:]))


def test_balanced_chunks_of_a_cost_graph() -> None:
    from pdcompile.cost.costgraph import add_block, new_cost_graph

    graph = new_cost_graph("chain")
    costs = [1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 2.0]
    for i, c in enumerate(costs):
        add_block(graph, f"n{i}", fwd=c / 3, bwd=2 * c / 3, act=1.0, params=1.0)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    plan = balanced_chunks(graph, 2, 2)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)] and plan.workers == 2
    pieces = [[int(n[1:]) for n in s.nodes] for s in plan.stages]
    assert sum(pieces, []) == list(range(10))
    work = [sum(costs[i] for i in piece) for piece in pieces]
    assert max(work) <= 6.0, pieces  # the best cut of 16 into 4 contiguous pieces has 6.0
    one_each = balanced_chunks(graph, 5, 2)
    assert [len(s.nodes) for s in one_each.stages] == [1] * 10


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, dilation=1, groups=2, bias=False), nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 3, padding="same"), nn.Tanh(),  # "same": left to autograd
        nn.Flatten(), nn.Unflatten(1, (4, 9)),
        nn.Conv1d(4, 2, 2, dilation=2), nn.Flatten(), nn.Linear(14, 3))


def test_b_defers_the_convolution_weight_gradients_to_w() -> None:
    """A convolution's dW is W work like a Linear's (runtime/conv_grads.py): B gives the input
    gradient at once, W the weight and bias gradients, equal to autograd's."""
    model, reference = _cnn(), _cnn()
    gm = trace(model)
    assert split_weight_gradients(gm) == 4  # 3 convolutions in numbers and the Linear
    queue = _b_alongside(gm, reference, torch.randn(2, 3, 8, 8))
    for name in ("0", "2", "8", "10"):  # deferred
        assert gm.get_submodule(name).weight.grad is None, name
    assert gm.get_submodule("4").weight.grad is not None  # padding="same": computed in B
    assert len(queue) == 4
    run_weight_grads(queue)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(gm.get_parameter(name).grad, param.grad, msg=name)


def test_a_3d_convolution_outside_the_split_is_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), nn.Flatten())
    gm = trace(copy.deepcopy(model))
    assert split_weight_gradients(gm) == 1
    x = torch.randn(2, 2, 4, 4, 4)
    gm(x).sum().backward()  # no deferring context: every gradient in the backward
    model(x).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(gm.get_parameter(name).grad, param.grad, msg=name)
    queue: list = []
    with accumulating_grads(), deferring_weight_grads(queue):
        gm(x).sum().backward()
    assert len(queue) == 1


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-zb", "zb-v"])
def test_a_cnn_under_zero_bubble_schedules_trains_as_one_process(schedule: str) -> None:
    from pdcompile.planner.interleave import fold_v
    from pdcompile.schedule.kinds import kind
    from tests.helpers.one_process import train_one_process

    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    gm = trace(_cnn())
    chunks = 1 if schedule == "zb-h1" else 2
    plan = even_plan(gm, 2 * chunks)
    if kind(schedule).v_shape:
        plan = fold_v(plan)
    elif chunks > 1:
        plan = interleave(plan, 2)
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    pipe = pdcompile.compile(_cnn(), example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy, optimizer=opt,
                             schedule=schedule, microbatches=4, plan=plan)
    deferring = [n for s in pipe.parts.stages for n in s.module.graph.nodes
                 if n.op == "call_function" and n.target.__name__ == "conv_deferrable"]
    assert len(deferring) == 3
    got = pipe.train([(x, y)] * 3)
    model = _cnn()
    want, _ = train_one_process(model, opt(model.parameters()), [x], y,
                                nn.functional.cross_entropy, micro=4, steps=3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    for name, value in pipe.named_parameters().items():
        torch.testing.assert_close(value.detach(), model.get_parameter(name).detach(), msg=name)
