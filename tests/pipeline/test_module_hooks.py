"""Hooks registered on modules (`register_forward_pre_hook`, `register_forward_hook`,
`register_full_backward_hook`, `register_full_backward_pre_hook`) train as one process runs them,
or are refused naming the module and the way that keeps them (passes/module_hooks.py).

Before: the fuse pass rewrote a hooked Linear's call into `linear_accumulate` and its hooks never
ran; torch.fx traced the model's own forward and skipped hooks on the model itself, and dropped
backward hooks of modules it traced through; torch.export kept no backward hook, nor a
gradient hook registered on a tensor in forward. Each trained silently without them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import TraceError
from tests.helpers.one_process import assert_two_stages_train_like_one_process


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.b = nn.Linear(8, 8), Block(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(torch.tanh(self.a(x))))


def _scaled_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 2.0 + 0.5,)


def _shifted_output(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
    return out - 1.0


def _tripled_grad(module: nn.Module, grad_output: tuple[Any, ...]) -> tuple[Any, ...]:
    return (grad_output[0] * 3.0,)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_forward_hooks_of_layers_run(frontend: str) -> None:
    """A Linear's pre-hook and a module's forward hook change what the layers compute (the fuse
    pass dropped the Linear's under fx)."""
    torch.manual_seed(0)
    model = Net().double()
    model.a.register_forward_pre_hook(_scaled_input)
    model.b.register_forward_hook(_shifted_output)
    model.block.register_forward_hook(_shifted_output)
    assert_two_stages_train_like_one_process(model, frontend=frontend)


def test_a_backward_hook_of_a_linear_runs_under_fx() -> None:
    torch.manual_seed(0)
    model = Net().double()
    model.b.register_full_backward_pre_hook(_tripled_grad)
    assert_two_stages_train_like_one_process(model, frontend="fx")


def test_forward_hooks_of_the_model_itself_run_through_torch_export() -> None:
    """fx traces `forward`, not the call that runs the model's own hooks: refused under fx,
    naming them and frontend='export'; the default front end takes torch.export, which runs
    them."""
    torch.manual_seed(0)
    model = Net().double()
    model.register_forward_pre_hook(_scaled_input)
    model.register_forward_hook(_shifted_output)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"Net has forward_pre_hooks and forward_hooks "
                                         r"registered on the model itself.*frontend='export'"):
        pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2,
                          frontend="fx", cost="analytic")
    assert_two_stages_train_like_one_process(model)


def test_a_backward_hook_of_a_traced_through_module_needs_it_whole() -> None:
    """fx traces through `block`, dropping its backward hook: refused naming
    leaf_modules=['block'], with which it trains as one process; torch.export keeps no backward
    hook and refuses too."""
    torch.manual_seed(0)
    model = Net().double()
    model.block.register_full_backward_pre_hook(_tripled_grad)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"module 'block' \(Block\) has backward_pre_hooks.*"
                                         r"leaf_modules=\['block'\]"):
        pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2, frontend="fx",
                          cost="analytic")
    with pytest.raises(TraceError, match=r"backward hooks on block.*torch.export does not"):
        pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2,
                          frontend="export", cost="analytic")
    assert_two_stages_train_like_one_process(model, leaf_modules=["block"])


def test_backward_hooks_of_the_model_itself_are_refused_by_both_front_ends() -> None:
    torch.manual_seed(0)
    model = Net().double()
    model.register_full_backward_pre_hook(_tripled_grad)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"backward_pre_hooks registered on the model itself.*"
                                         r"torch.export cannot capture it either"):
        pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2, cost="analytic")


class GradHooked(nn.Module):
    """A gradient hook on an activation (`h.register_hook`), registered in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h.register_hook(lambda grad: grad * 3.0)
        return self.b(h)


def test_a_tensor_hook_registered_in_forward_is_refused_naming_it() -> None:
    """fx cannot trace it; torch.export ran it on its own tensors and kept nothing of it (the
    default front end trained without the hook); now refused naming the line."""
    x = torch.randn(4, 8)
    for frontend in ("auto", "export"):
        with pytest.raises(TraceError, match=r"gradient hook on a tensor \(Tensor.register_hook"
                                             r" at .*test_module_hooks.py:\d+\)"):
            pdcompile.compile(GradHooked(), example_inputs=(x,), stages=2, frontend=frontend,
                              cost="analytic")
