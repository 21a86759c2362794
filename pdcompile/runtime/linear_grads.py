"""The fused Linear of the stage runtime: its backward adds dW into `weight.grad` in place, or
queues it for the W action of a split backward.

`linear_accumulate(x, weight, bias)` is what the fuse pass (passes/fuse.py) puts in place of a
stage's Linear calls; generated stage code calls it, so it lives here, beside the runtime that
sets its mode. A pipeline that cuts a minibatch into microbatches accumulates every weight
gradient once per microbatch; plain autograd computes each microbatch's dW = gy^T x into a fresh
tensor and then adds it to `.grad`, while this backward does it in one `addmm_` (gy^T x + grad,
in place), as Megatron-LM's `gradient_accumulation_fusion` does on GPUs. The result equals plain
autograd's up to float rounding (one fused add instead of two roundings). The runtime enters
that mode only where it pays (runtime/stage_runtime.py): where gradients accumulate over several
backwards before an update, or where weight gradients wait (below); a stage with one backward
per update that defers nothing runs plain autograd.

The fused path is taken only for forwards run inside `accumulating_grads()` (the pipeline
runtime's): there the graph is always consumed by `backward()`, which accumulates into `.grad`.
Elsewhere (a user calling a stage module, `torch.autograd.grad`, double backward) and under
autocast it is plain `F.linear`. Parameters the graph also reads directly keep the ordinary path.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split the
backward: a Linear's weight gradient dW = gy^T x feeds nothing in the backward graph (the input
gradient gx = gy W does not need it), so it can wait. Forwards run inside
`deferring_weight_grads(queue)` give their Linear calls that queue: their backward (B) computes
gx at once and appends the dW and db work to the queue as a closure, which the pipeline's W
action (`run_weight_grads`) runs later, while the rank would otherwise wait. It keeps x and gy
alive until then. Weights of other layers (convolutions, norms, embeddings) get their gradients
in B, unless their autograd function queues the work itself (`weight_grad_queue`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

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


class FusedRegion:
    """`accumulating_grads()` and, given a queue, `deferring_weight_grads(queue)` as one
    context: the stage runtime enters it for every forward, where two generator-based contexts
    cost about 10 Python calls more."""

    __slots__ = ("_queue", "_tokens")

    def __init__(self, queue: WeightGrads | None = None) -> None:
        self._queue = queue
        self._tokens: tuple[Any, Any] = (None, None)

    def __enter__(self) -> None:
        deferring = _DEFERRING.set(self._queue) if self._queue is not None else None
        self._tokens = (_ACCUMULATING.set(True), deferring)

    def __exit__(self, *exc: object) -> None:
        accumulating, deferring = self._tokens
        if deferring is not None:
            _DEFERRING.reset(deferring)
        _ACCUMULATING.reset(accumulating)


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
        # what dW reads, kept as eager's matmul keeps it: a view of x where x folds to 2-D as it
        # is, else a copy (an LSTM's batch-first output), which a later in-place change of x
        # leaves alone, as it does in eager mode
        ctx.save_for_backward(x.reshape(-1, x.shape[-1]), weight)
        ctx.leaves = (weight, bias)
        ctx.deferred = _DEFERRING.get()
        out = F.linear(x, weight, bias)
        if out._base is not None:  # inputs of 3 or more dims: a view of the 2-D product, which
            # autograd forbids changing in place through a view of it (y.narrow(...).mul_()) when
            # a custom function returns it; the same memory, not marked as a view
            out = torch.ops.aten._unsafe_view(out, out.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        leaf_weight, bias = ctx.leaves
        gy = grad_out.reshape(-1, grad_out.shape[-1])
        gx = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        gw = gb = None
        in_place = not torch.is_grad_enabled()  # create_graph needs grads as graph outputs
        queue = ctx.deferred
        if in_place and queue is not None and grad_accumulates(leaf_weight) and (
                bias is None or not ctx.needs_input_grad[2] or grad_accumulates(bias)):
            queue.append(lambda: _accumulate_weight_grads(
                gy, x2, leaf_weight if ctx.needs_input_grad[1] else None,
                bias if bias is not None and ctx.needs_input_grad[2] else None))
            return gx, None, None
        if ctx.needs_input_grad[1]:
            if in_place and grad_accumulates(leaf_weight):
                if leaf_weight.grad is None:
                    leaf_weight.grad = gy.t().mm(x2)
                else:
                    leaf_weight.grad.addmm_(gy.t(), x2)
            else:
                gw = gy.t().mm(x2)
        if bias is not None and ctx.needs_input_grad[2]:
            summed = gy.sum(0)
            if in_place and grad_accumulates(bias):
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


def grad_accumulates(leaf: torch.Tensor) -> bool:
    """Whether the gradient may be added into `leaf.grad` here instead of by autograd."""
    grad = leaf.grad
    return leaf.is_leaf and leaf.requires_grad and (
        grad is None or (not grad.requires_grad and grad.layout == torch.strided
                         and grad.shape == leaf.shape and grad.dtype == leaf.dtype))


# `autograd.Function.apply` without its Python wrapper, which (for a function without
# `setup_context`, outside functorch transforms) unwraps dead functorch wrappers and calls this:
# about 8 Python calls a layer and microbatch fewer (docs/runtime-profile.md)
_APPLY = super(torch.autograd.Function, _LinearAccumulate).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active


def linear_accumulate(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the fused gradient accumulation (module docstring)."""
    if not (_ACCUMULATING.get() and torch.is_grad_enabled() and weight.requires_grad) \
            or torch.is_autocast_enabled(x.device.type):  # autocast: its casts need autograd's
        return F.linear(x, weight, bias)
    if _transforms_active():  # vmap, grad...: the full path
        return _LinearAccumulate.apply(x, weight, bias)  # type: ignore[no-any-return]
    return _APPLY(_unwrap_if_dead(x), _unwrap_if_dead(weight),  # type: ignore[no-any-return]
                  None if bias is None else _unwrap_if_dead(bias))


__all__ = ["FusedRegion", "WeightGrads", "accumulating_grads", "deferring_weight_grads",
           "grad_accumulates", "linear_accumulate", "run_weight_grads", "weight_grad_queue"]
