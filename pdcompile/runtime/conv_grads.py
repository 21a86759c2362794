"""Convolutions whose weight gradients wait for W in zero-bubble schedules.

A zero-bubble schedule splits a microbatch's backward into B (the input gradients, which the
previous stage waits for) and W (the weight gradients, which nothing in the backward reads), and
fills its bubbles with W (runtime/linear_grads.py does it for Linear layers). A convolution's
weight gradient is the same kind of work: `aten.convolution_backward` computes the input
gradient and the weight and bias gradients from the same saved input and output gradient, each
alone when asked (its output mask), so B asks for the input gradient and queues the rest for W.
In CNNs the convolutions hold nearly all the weights, so without this a zero-bubble schedule had
no W to move and ran as 1F1B-flush does.

`conv_deferrable(x, weight, bias, stride, padding, dilation, groups)` is what the B/W split pass
(passes/fuse.py, `split_weight_gradients`) puts in place of a stage's Conv1d/2d/3d calls. It
takes the split path only for forwards run inside `deferring_weight_grads` (the pipeline
runtime's, for a schedule that splits the backward) with gradients enabled and autocast off;
anywhere else it is the plain `F.conv*d`, so a stage module called by a user behaves as the
model did.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

from pdcompile.runtime.linear_grads import grad_accumulates, weight_grad_queue

_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the weight's dimensions


class _ConvDeferred(torch.autograd.Function):
    """A convolution whose backward computes the input gradient and queues dW and db for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...],
                groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.leaves = (weight, bias)
        ctx.shape = (stride, padding, dilation, groups)
        ctx.queue = weight_grad_queue()
        return _CONV[weight.dim()](x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        leaf_weight, bias = ctx.leaves
        stride, padding, dilation, groups = ctx.shape
        wants_w, wants_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_out = grad_out.contiguous()

        def grads(mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
            return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]
                grad_out, x, weight, None if bias is None else [bias.shape[0]], list(stride),
                list(padding), list(dilation), False, [0] * len(stride), groups, mask)

        gx = grads([True, False, False])[0] if ctx.needs_input_grad[0] else None
        queue = ctx.queue
        if queue is not None and not torch.is_grad_enabled() and (wants_w or wants_b) and \
                (not wants_w or grad_accumulates(leaf_weight)) and \
                (not wants_b or grad_accumulates(bias)):
            def weight_grads() -> None:
                _, gw, gb = grads([False, wants_w, wants_b])
                _add_grad(leaf_weight if wants_w else None, gw)
                _add_grad(bias if wants_b else None, gb)

            queue.append(weight_grads)
            return gx, None, None, None, None, None, None
        if not (wants_w or wants_b):
            return gx, None, None, None, None, None, None
        _, gw, gb = grads([False, wants_w, wants_b])
        return gx, gw if wants_w else None, gb if wants_b else None, None, None, None, None


def _add_grad(leaf: torch.Tensor | None, grad: torch.Tensor | None) -> None:
    """`grad` added into `leaf.grad` (a deferred W)."""
    if leaf is None or grad is None:
        return
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad.add_(grad)


def conv_deferrable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    stride: tuple[int, ...], padding: tuple[int, ...],
                    dilation: tuple[int, ...], groups: int) -> torch.Tensor:
    """`F.conv{1,2,3}d(x, weight, bias, stride, padding, dilation, groups)` whose weight
    gradients wait for W inside `deferring_weight_grads` (module docstring)."""
    if weight_grad_queue() is None or not torch.is_grad_enabled() \
            or not (weight.requires_grad or (bias is not None and bias.requires_grad)) \
            or torch.is_autocast_enabled(x.device.type):  # autocast: its casts need autograd's
        return _CONV[weight.dim()](x, weight, bias, stride, padding, dilation, groups)
    return _ConvDeferred.apply(x, weight, bias, tuple(stride), tuple(padding),  # type: ignore
                               tuple(dilation), groups)


__all__ = ["conv_deferrable"]
