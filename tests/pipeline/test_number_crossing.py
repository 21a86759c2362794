"""A Python number read from a tensor in one stage (`scale = h.abs().max().item()`) and used in a
later one arrives exactly: a float crossed stages as torch's default float32, so a float64
model trained 1e-8 off one process (its loss 1.01251064658 against 1.01251063821), with no
error. Any float survives the transport bit for bit."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import pdcompile
from pdcompile.runtime.stage_runtime import _decode, _encode


class ItemScale(nn.Module):
    """Divides its output by a number read from an early activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        scale = h.abs().max().item()
        return self.b(h) / scale


@given(st.floats(allow_nan=False) | st.integers(-2**63, 2**63 - 1) | st.booleans())
def test_numbers_cross_bit_for_bit(value: float | int | bool) -> None:
    got = _decode(_encode(value, "n"), type(value).__name__)
    assert type(got) is type(value)
    assert got == value and math.copysign(1, got) == math.copysign(1, value)


def test_a_float_read_in_one_stage_and_used_in_the_next_trains_as_one_process() -> None:
    torch.manual_seed(0)
    model = ItemScale().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.mse_loss,
                             stages=2, schedule="1f1b-flush", microbatches=1,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    stage_of = pipe.plan.stage_of()
    item = next(n for n in pipe.graph.graph.nodes if n.target == "item")
    assert {stage_of[item.name]} | {stage_of[u.name] for u in item.users} == {0, 1}  # crosses
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        want = F.mse_loss(model(x), y)
        want.backward()
        opt.step()
        assert pipe.step(x, target=y) == want.item()
