"""The last stage's backward starts from the loss itself where the schedule's loss scale is 1
(whole minibatches), and from the scaled loss where a minibatch is cut into microbatches; the
pipeline trains as one process does either way (runtime/stage_runtime.py, `backward`)."""

from __future__ import annotations

import copy
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
from tests.helpers.one_process import train_one_process

WIDTH = 6


@settings(max_examples=8, deadline=None)
@given(micro=st.sampled_from([1, 2, 4]), schedule=st.sampled_from(["1f1b-flush", "gpipe"]),
       fuse=st.booleans())
def test_the_loss_is_multiplied_only_by_a_scale_other_than_one(
        micro: int, schedule: str, fuse: bool) -> None:
    torch.manual_seed(micro)
    model = nn.Sequential(nn.Linear(5, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plan = manual_plan(trace(copy.deepcopy(model)), lambda node: int(
        node.op == "call_module" and int(str(node.target)) >= 2))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), schedule=schedule,
                             microbatches=micro, plan=plan, fuse=fuse)
    roots: list[str] = []
    backward = torch.autograd.backward

    def spying(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
        for tensor, grad in zip(tensors, grad_tensors, strict=True):
            if grad is None:  # the loss's root (a received gradient comes with its tensor)
                roots.append(type(tensor.grad_fn).__name__)
        backward(tensors, grad_tensors, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.autograd, "backward", spying)
        losses = [pipe.step(x, target=y) for _ in range(2)]
    want, _ = train_one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), y,
                                F.cross_entropy, micro=micro, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)
    assert len(roots) == 2 * micro
    if micro == 1:
        assert "MulBackward0" not in roots, "a loss scale of 1 was multiplied into the graph"
    else:
        assert set(roots) == {"MulBackward0"}
