"""A model's own `torch.autograd.Function` (here a gradient reversal layer and a
straight-through rounding) is refused by both front ends naming it, and trains as one process
does inside a module kept whole (passes/custom_functions.py). Before, torch.fx traced its
forward with gradients off (no gradient passed it) and torch.export replaced its backward with
its forward's derivatives: both trained silently wrong."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import TraceError
from tests.helpers.one_process import assert_two_stages_train_like_one_process


class Reversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -0.5 * grad


class Rounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Adversary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return Rounded.apply(torch.tanh(self.layer(Reversal.apply(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.adversary, self.out = nn.Linear(8, 16), Adversary(), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.adversary(torch.tanh(self.inp(x))))


def test_a_custom_function_is_refused_by_both_front_ends_naming_the_way() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"applies the autograd Function .*Reversal .*"
                                         r"no gradient would pass it.*"
                                         r"leaf_modules=\['adversary'\].*torch.export"):
        pdcompile.compile(Net(), example_inputs=(x,), stages=2, cost="analytic")
    with pytest.raises(TraceError, match=r"Function .*Reversal .*torch.export records"):
        pdcompile.compile(Net(), example_inputs=(x,), stages=2, frontend="export",
                          cost="analytic")


def test_a_custom_function_in_a_module_kept_whole_trains_like_one_process() -> None:
    torch.manual_seed(0)
    model = Net().double()
    assert_two_stages_train_like_one_process(model, leaf_modules=["adversary"])
    assert "apply" in torch.autograd.Function.__dict__  # torch's own apply back in place
