"""A model's own `torch.autograd.Function` (here a gradient reversal layer and a
straight-through rounding) trains as one process does under torch.export, kept as one operator
with its own backward (runtime/function_call.py), and inside a module kept whole under torch.fx,
which refuses it otherwise, naming both ways (passes/custom_functions.py). Before, torch.fx
traced its forward with gradients off (no gradient passed it) and torch.export replaced its
backward with its forward's derivatives: both trained silently wrong; then both refused it,
and BLOOM (its GeLUFunction) compiled under neither."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import TraceError
from pdcompile.meta import get_frontend
from tests.helpers.one_process import assert_two_stages_train_like_one_process

FUNCTION_CALL = torch.ops.pdcompile.function_call.default


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


def test_a_custom_function_is_refused_by_fx_naming_the_way() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"applies the autograd Function .*Reversal .*"
                                         r"no gradient would pass it.*"
                                         r"leaf_modules=\['adversary'\].*frontend='export'"):
        pdcompile.compile(Net(), example_inputs=(x,), stages=2, cost="analytic",
                          frontend="fx")


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_custom_function_trains_like_one_process_under_torch_export(frontend: str) -> None:
    """torch.export keeps each Function as one operator running its own backward (the
    reversal and the straight-through rounding); `auto` falls back to it from fx's refusal."""
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2,
                             cost="analytic", frontend=frontend)
    assert get_frontend(pipe.graph) == "export"
    calls = [n.args[0] for n in pipe.graph.graph.nodes if n.target is FUNCTION_CALL]
    assert calls == [f"{__name__}:Reversal", f"{__name__}:Rounded"]
    assert_two_stages_train_like_one_process(model, frontend=frontend)
    assert "apply" in torch.autograd.Function.__dict__  # torch's own apply back in place


def test_a_local_custom_function_is_refused_by_torch_export_naming_the_way() -> None:
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    class Doubling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(Local.apply(x))

    with pytest.raises(TraceError, match=r"Function .*Local .*defined inside a function.*"
                                         r"define it at a module's top level"):
        pdcompile.compile(Doubling(), example_inputs=(torch.randn(4, 8),), stages=2,
                          frontend="export", cost="analytic")


def test_a_custom_function_in_a_module_kept_whole_trains_like_one_process() -> None:
    torch.manual_seed(0)
    model = Net().double()
    assert_two_stages_train_like_one_process(model, leaf_modules=["adversary"])
    assert "apply" in torch.autograd.Function.__dict__  # torch's own apply back in place
