"""Fused weight-gradient accumulation: the backward of a Linear adds dW into `weight.grad`.

A pipeline that cuts a minibatch into microbatches accumulates every weight gradient once per
microbatch. Plain autograd computes each microbatch's dW = gy^T x into a fresh tensor and then
adds it to `.grad`: for a 1024 x 1024 layer and 32-row microbatches that is 8 MiB of extra
memory traffic per layer and microbatch, about as much as the product itself moves. The fused
backward does it in one `addmm_` (gy^T x + grad, in place), as Megatron-LM's
`gradient_accumulation_fusion` does on GPUs. On this project's 2-core CPU the 2-process
1F1B-flush benchmark (8 microbatches of 32, Linear(1024, 1024) layers) trains 1.20x faster with
it (benchmarks/results/runtime.md).

The rewrite is applied to stage modules after the split (`fuse_grad_accumulation`): every
`nn.Linear` submodule call (and `F.linear` on a module's own parameters) becomes
`linear_accumulate(x, weight, bias)`. Submodules and their parameters stay where they were, so
state-dict names, optimizers, checkpoints and `functional_call` with stashed weight versions
work unchanged. The result equals plain autograd's up to float rounding (one fused add instead
of two roundings).

The fused path is taken only for forwards run inside `accumulating_grads()` (the pipeline
runtime's): there the graph is always consumed by `backward()`, which accumulates into `.grad`.
Elsewhere (a user calling a stage module, `torch.autograd.grad`, double backward) and under
autocast the rewritten module is plain `F.linear`. Parameters the graph also reads directly keep
the ordinary path.

The same rewrite splits the backward for zero-bubble schedules (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024; `split_weight_gradients`): in the backward graph a Linear's
weight gradient dW = gy^T x feeds nothing (the input gradient gx = gy W does not need it), so
it can wait. Forwards run inside `deferring_weight_grads(queue)` give their Linear calls that
queue: their backward (B) computes gx at once and appends the dW and db work to the queue as a
closure, which the pipeline's W action (`run_weight_grads`) runs later, while the rank would
otherwise wait. It keeps x and gy alive until then. Weights of other layers (convolutions,
norms, embeddings) get their gradients in B, unless their autograd function queues the work
itself (`weight_grad_queue`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import fx

_ACCUMULATING: ContextVar[bool] = ContextVar("pdcompile_accumulating_grads", default=False)
WeightGrads = list[Callable[[], None]]  # deferred weight-gradient work of one microbatch
_DEFERRING: ContextVar[WeightGrads | None] = ContextVar("pdcompile_deferring_weight_grads",
                                                        default=None)


@contextmanager
def accumulating_grads() -> Iterator[None]:
    """Forwards run here take the fused path: their graphs must be consumed by `backward()`."""
    token = _ACCUMULATING.set(True)
    try:
        yield
    finally:
        _ACCUMULATING.reset(token)


@contextmanager
def deferring_weight_grads(queue: WeightGrads) -> Iterator[None]:
    """Forwards run here (inside `accumulating_grads()`) defer their Linear layers' weight
    gradients to `queue` when their backward runs (module docstring)."""
    token = _DEFERRING.set(queue)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def weight_grad_queue() -> WeightGrads | None:
    """Where a forward running now defers its weight-gradient work (None: it computes it in B).
    A custom autograd function joins the B/W split by reading it in its forward and appending
    its weight-gradient work to it in its backward, as the Linear calls do."""
    return _DEFERRING.get()


def run_weight_grads(queue: WeightGrads) -> None:
    """The deferred weight-gradient work of one microbatch (W): accumulate it into `.grad`."""
    with torch.no_grad():
        while queue:
            queue.pop(0)()


class _LinearAccumulate(torch.autograd.Function):
    """y = x W^T + b whose backward accumulates dW and db straight into the leaves' `.grad`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.leaves = (weight, bias)
        ctx.deferred = _DEFERRING.get()
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        leaf_weight, bias = ctx.leaves
        gy = grad_out.reshape(-1, grad_out.shape[-1])
        gx = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        gw = gb = None
        in_place = not torch.is_grad_enabled()  # create_graph needs grads as graph outputs
        queue = ctx.deferred
        if in_place and queue is not None and _accumulates(leaf_weight) and (
                bias is None or not ctx.needs_input_grad[2] or _accumulates(bias)):
            x2 = x.reshape(-1, x.shape[-1])
            queue.append(lambda: _accumulate_weight_grads(
                gy, x2, leaf_weight if ctx.needs_input_grad[1] else None,
                bias if bias is not None and ctx.needs_input_grad[2] else None))
            return gx, None, None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if in_place and _accumulates(leaf_weight):
                if leaf_weight.grad is None:
                    leaf_weight.grad = gy.t().mm(x2)
                else:
                    leaf_weight.grad.addmm_(gy.t(), x2)
            else:
                gw = gy.t().mm(x2)
        if bias is not None and ctx.needs_input_grad[2]:
            summed = gy.sum(0)
            if in_place and _accumulates(bias):
                if bias.grad is None:
                    bias.grad = summed
                else:
                    bias.grad.add_(summed)
            else:
                gb = summed
        return gx, gw, gb


def _accumulate_weight_grads(gy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None,
                             bias: torch.Tensor | None) -> None:
    """dW = gy^T x and db = sum(gy), added into the leaves' `.grad` (a deferred W)."""
    if weight is not None:
        if weight.grad is None:
            weight.grad = gy.t().mm(x2)
        else:
            weight.grad.addmm_(gy.t(), x2)
    if bias is not None:
        if bias.grad is None:
            bias.grad = gy.sum(0)
        else:
            bias.grad.add_(gy.sum(0))


def _accumulates(leaf: torch.Tensor) -> bool:
    """Whether the gradient may be added into `leaf.grad` here instead of by autograd."""
    grad = leaf.grad
    return leaf.is_leaf and leaf.requires_grad and (
        grad is None or (not grad.requires_grad and grad.layout == torch.strided
                         and grad.shape == leaf.shape and grad.dtype == leaf.dtype))


def linear_accumulate(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the fused gradient accumulation (module docstring)."""
    if not (_ACCUMULATING.get() and torch.is_grad_enabled() and weight.requires_grad) \
            or torch.is_autocast_enabled(x.device.type):  # autocast: its casts need autograd's
        return F.linear(x, weight, bias)
    return _LinearAccumulate.apply(x, weight, bias)  # type: ignore[no-any-return]


def fuse_grad_accumulation(gm: fx.GraphModule) -> int:
    """Rewrite the Linear calls of `gm` in place (module docstring); returns how many."""
    uses = Counter(id(p) for _name, p in gm.named_parameters(remove_duplicate=False))
    get_attr_uses = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.kwargs or len(node.args) != 1:
            continue
        module = gm.get_submodule(str(node.target))
        if type(module) is not torch.nn.Linear:
            continue
        own = [module.weight] + ([module.bias] if module.bias is not None else [])
        if any(uses[id(p)] != 1 for p in own):
            continue  # shared with another module of the stage: left to autograd
        if any(get_attr_uses[f"{node.target}.{n}"] for n in ("weight", "bias")):
            continue  # the graph also reads the parameter directly
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None \
                else None
            call = gm.graph.call_function(linear_accumulate, (node.args[0], weight, bias))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def split_weight_gradients(gm: fx.GraphModule) -> int:
    """The B/W split pass: every Linear call of `gm` that owns its parameters becomes one whose
    weight gradient can wait for W (`deferring_weight_grads`); idempotent after
    `fuse_grad_accumulation`, which makes the same calls. Returns how many calls can defer."""
    fuse_grad_accumulation(gm)
    return sum(1 for node in gm.graph.nodes
               if node.op == "call_function" and node.target is linear_accumulate)


__all__ = ["WeightGrads", "deferring_weight_grads", "fuse_grad_accumulation",
           "linear_accumulate", "run_weight_grads", "split_weight_gradients",
           "weight_grad_queue"]
