"""A forward wrapped by a decorator that takes `(*args, **kwargs)` (functools.wraps: a logging
decorator, transformers' `deprecate_kwarg` on BLOOM) is traced by torch.fx through the wrapper
(passes/decorated_forward.py), and a model's own autograd Function is kept by torch.export
with its backward. Before, fx failed on every such forward with "code:
co_varnames is too small" (it rewrote the wrapper's code to take the wrapped function's
arguments), so the fix the refusal of a custom Function gave (frontend='fx', the module kept
whole) failed too; and torch.export's refusal said `leaf_modules=[name]` without the name."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.errors import TraceError
from pdcompile.passes.trace import trace
from tests.helpers.one_process import assert_two_stages_train_like_one_process


class Halved(torch.autograd.Function):
    """Doubles forward, halves the gradient backward: not its forward's derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Halved.apply(torch.tanh(x))


def scaled(factor: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator of (*args, **kwargs) that multiplies what the forward returns."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) * factor
        return wrapper
    return decorate


def decorated_net(layers: int, factor: float, star_kwargs: bool,
                  keyword_only: bool) -> nn.Module:
    """A stack of Linear layers with `Act` between them, whose forward is decorated by
    `scaled(factor)`, optionally taking **kwargs and a keyword-only `temperature`."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 6)
            self.act = Act()
            self.mid = nn.Sequential(*(nn.Linear(6, 6) for _ in range(layers)))
            self.out = nn.Linear(6, 3)

        def plain(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                  temperature: float = 1.0) -> torch.Tensor:
            h = self.mid(self.act(self.inp(x)))
            if mask is not None:
                h = h * mask
            return self.out(h) / temperature

    if star_kwargs and keyword_only:
        def forward(self: Any, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                    temperature: float = 2.0, **kwargs: Any) -> torch.Tensor:
            return self.plain(x, mask, temperature)
    elif star_kwargs:
        def forward(self: Any, x: torch.Tensor, mask: torch.Tensor | None = None,
                    **kwargs: Any) -> torch.Tensor:
            return self.plain(x, mask)
    elif keyword_only:
        def forward(self: Any, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                    temperature: float = 2.0) -> torch.Tensor:
            return self.plain(x, mask, temperature)
    else:
        def forward(self: Any, x: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
            return self.plain(x, mask)
    Net.forward = scaled(factor)(forward)  # type: ignore[method-assign]
    torch.manual_seed(0)
    return Net().double()


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 3), factor=st.sampled_from([0.5, 1.0, 3.0]),
       star_kwargs=st.booleans(), keyword_only=st.booleans())
def test_fx_traces_a_decorated_forward_through_its_wrapper(
        layers: int, factor: float, star_kwargs: bool, keyword_only: bool) -> None:
    model = decorated_net(layers, factor, star_kwargs, keyword_only)
    gm = trace(model, leaf_modules=["act"], num_positional=1)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(gm(x), model(x))  # the wrapper's factor is in the graph


@pytest.mark.parametrize("star_kwargs", [False, True])
def test_a_decorated_forward_with_a_custom_function_kept_whole_trains_like_one_process(
        star_kwargs: bool) -> None:
    model = decorated_net(2, 0.5, star_kwargs, keyword_only=True)
    assert_two_stages_train_like_one_process(model, frontend="fx", leaf_modules=["act"])


def test_torch_export_keeps_a_custom_function_inside_a_decorated_forward() -> None:
    """torch.export keeps the Function as one operator running its own backward
    (runtime/function_call.py), which it once refused naming the module that calls it."""
    model = decorated_net(1, 1.0, star_kwargs=False, keyword_only=False)
    assert_two_stages_train_like_one_process(model, frontend="export")


def test_a_forward_named_as_code_is_traced_without_running_its_name() -> None:
    """The function handed to fx is written with a fixed name: a wrapped forward whose
    `__name__` was set to text shaped as code (any string may be one) is not executed."""
    ran: list[str] = []

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)
    forward.__name__ = "f(x): pass\nran.append('name')\ndef g"

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

    Net.forward = scaled(2.0)(forward)  # type: ignore[method-assign]
    model = Net()
    x = torch.randn(5, 4)
    gm = trace(model)
    assert ran == []
    torch.testing.assert_close(gm(x), model(x))
