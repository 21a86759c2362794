"""A stage runs its Linear layers through the fused autograd Function (runtime/linear_grads.py)
only where it pays: where gradients accumulate over several backwards before an update
(microbatches, replicas) or where weight gradients wait (after the input-gradient sends, or a
split backward's W). A stage with one backward per update that defers nothing runs plain
autograd, which computes the same products, so the pipeline still trains as one process does
and gradient hooks on its weights fire as they do there (runtime/stage_runtime.py, `_run`)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.runtime import linear_grads
from pdcompile.runtime.stage_runtime import StageRuntime
from tests.helpers.one_process import train_one_process


def _model(width: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = [nn.Linear(5, width), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 3)).double()


def _fused_forwards_by_stage(pipe: pdcompile.pipeline.Pipeline, run: Any) -> Counter[int]:
    """How many Linear calls each stage ran through the fused Function while `run()` ran."""
    counted: Counter[int] = Counter()
    stage: list[int] = []
    forward = StageRuntime.forward
    fused = linear_grads._LinearAccumulate.forward

    def spying_forward(rt: StageRuntime, microbatch: int) -> Generator[Any, None, None]:
        stage.append(rt.stage)
        try:
            yield from forward(rt, microbatch)
        finally:
            stage.pop()

    def spying_fused(ctx: Any, *args: Any) -> torch.Tensor:
        counted[stage[-1]] += 1
        return fused(ctx, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StageRuntime, "forward", spying_forward)
        patch.setattr(linear_grads._LinearAccumulate, "forward", staticmethod(spying_fused))
        run()
    return counted


@settings(max_examples=10, deadline=None)
@given(micro=st.sampled_from([1, 2, 4]), schedule=st.sampled_from(["1f1b-flush", "gpipe"]),
       width=st.integers(2, 7), layers=st.integers(2, 4), data=st.data())
def test_only_stages_that_accumulate_or_defer_run_the_fused_linear(
        micro: int, schedule: str, width: int, layers: int, data: st.DataObject) -> None:
    torch.manual_seed(width * 10 + layers)
    model = _model(width, layers)
    cut = data.draw(st.integers(1, layers), label="blocks on stage 0")
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plan = manual_plan(trace(copy.deepcopy(model)), lambda node: int(
        node.op == "call_module" and int(str(node.target)) >= 2 * cut))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), schedule=schedule,
                             microbatches=micro, plan=plan)
    losses: list[float] = []
    counted = _fused_forwards_by_stage(
        pipe, lambda: losses.extend(pipe.step(x, target=y) for _ in range(2)))
    # stage 0 sends no input gradients: it needs the fused Linear only to accumulate
    assert counted[0] == (2 * micro * cut if micro > 1 else 0)
    # stage 1 computes its weight gradients after sending its input gradients
    assert counted[1] == 2 * micro * (layers - cut + 1)
    want, _ = train_one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), y,
                                F.cross_entropy, micro=micro, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_a_gradient_hook_on_a_weight_of_a_stage_with_one_backward_per_update_fires() -> None:
    torch.manual_seed(0)
    model = _model(4, 2)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plan = manual_plan(trace(copy.deepcopy(model)), lambda node: int(
        node.op == "call_module" and int(str(node.target)) >= 2))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             schedule="1f1b-flush", microbatches=1, plan=plan)
    weight = pipe.named_parameters()["0.weight"]
    seen: list[torch.Tensor | None] = []
    weight.register_hook(lambda grad: seen.append(None if grad is None else grad.clone()))
    pipe.step(x, target=y)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert len(seen) == 1, "the hook on stage 0's weight did not fire once"
    assert seen[0] is not None, "the hook on stage 0's weight saw no gradient"
    torch.testing.assert_close(seen[0], model[0].weight.grad)
