"""Fused weight-gradient accumulation (passes/fuse.py): same gradients as plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pdcompile.passes.fuse import fuse_grad_accumulation
from pdcompile.passes.trace import trace
from pdcompile.runtime.linear_grads import accumulating_grads, linear_accumulate


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 7)])
@pytest.mark.parametrize("x_grad", [True, False])
def test_accumulates_like_autograd_over_microbatches(bias: bool, shape: tuple[int, ...],
                                                     x_grad: bool) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(7, 6, bias=bias)
    fused = copy.deepcopy(plain)
    for _ in range(3):  # three microbatches accumulate into .grad
        x = torch.randn(shape, requires_grad=x_grad)
        x2 = x.detach().clone().requires_grad_(x_grad)
        plain(x).pow(2).sum().backward()
        with accumulating_grads():
            out = linear_accumulate(x2, fused.weight, fused.bias)
        out.pow(2).sum().backward()
        if x_grad:
            assert x.grad is not None and x2.grad is not None
            torch.testing.assert_close(x2.grad, x.grad)
    assert set(_grads(fused)) == set(_grads(plain)) == ({"weight", "bias"} if bias else {"weight"})
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(_grads(fused)[name], grad)


def test_outside_the_context_it_is_plain_linear() -> None:
    """torch.autograd.grad must get its gradients back, not find them in .grad."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    (gw,) = torch.autograd.grad(linear_accumulate(x, layer.weight, layer.bias).sum(),
                                [layer.weight])
    assert layer.weight.grad is None
    torch.testing.assert_close(gw, torch.ones(2, 3).t() @ x)


def test_double_backward_keeps_the_ordinary_path() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with accumulating_grads():
        y = linear_accumulate(x, layer.weight, layer.bias).tanh().sum()
    (gx,) = torch.autograd.grad(y, [x], create_graph=True)
    gx.sum().backward()  # second order reaches the weight through the returned gradient
    ref = nn.Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    xr = x.detach().clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(ref(xr).tanh().sum(), [xr], create_graph=True)
    gr.sum().backward()
    torch.testing.assert_close(gx, gr)
    assert layer.weight.grad is not None and ref.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 3))


def test_rewrite_keeps_outputs_names_and_gradients() -> None:
    model = _mlp()
    gm = trace(copy.deepcopy(model))
    names = [n for n, _ in gm.named_parameters()]
    assert fuse_grad_accumulation(gm) == 3
    assert [n for n, _ in gm.named_parameters()] == names
    assert not any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                         nn.Linear) for n in gm.graph.nodes)
    x = torch.randn(5, 8)
    assert torch.equal(gm(x), model(x))  # forward is F.linear either way
    for chunk in x.chunk(4):
        model(chunk).square().mean().backward()
        with accumulating_grads():
            out = gm(chunk)
        out.square().mean().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(_grads(gm)[name], grad)


def test_stashed_versions_collect_their_own_gradients() -> None:
    """functional_call with a stashed copy: the copy's leaves get the gradient, not the live
    parameters (the runtime moves it over, see StageRuntime._collect)."""
    model = _mlp()
    gm = trace(copy.deepcopy(model))
    fuse_grad_accumulation(gm)
    stashed = {n: p.detach().clone().requires_grad_(True) for n, p in gm.named_parameters()}
    x = torch.randn(4, 8)
    with accumulating_grads():
        out = functional_call(gm, stashed, (x,))
    out.sum().backward()
    assert all(p.grad is None for p in gm.parameters())
    model(x).sum().backward()
    for name, grad in _grads(model).items():
        assert stashed[name].grad is not None
        torch.testing.assert_close(stashed[name].grad, grad)


def test_a_layer_called_twice_sums_both_uses() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(torch.relu(self.layer(x)))

    torch.manual_seed(2)
    model = Twice()
    gm = trace(copy.deepcopy(model))
    assert fuse_grad_accumulation(gm) == 2
    x = torch.randn(3, 6)
    model(x).sum().backward()
    with accumulating_grads():
        out = gm(x)
    out.sum().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(_grads(gm)[name], grad)


def test_parameter_also_read_directly_is_left_alone() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x) @ self.layer.weight

    gm = trace(Tied())
    assert fuse_grad_accumulation(gm) == 0


def test_autocast_takes_the_plain_path() -> None:
    """Under autocast the forward runs in low precision; its backward must be autograd's."""
    torch.manual_seed(3)
    layer = nn.Linear(8, 4)
    ref = copy.deepcopy(layer)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), accumulating_grads():
        out = linear_accumulate(x, layer.weight, layer.bias)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref(x).float().sum().backward()
    assert layer.weight.grad is not None and ref.weight.grad is not None
    assert torch.equal(layer.weight.grad, ref.weight.grad)
