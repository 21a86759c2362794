"""Tensor constants of a graph, held in storage of their own.

Tracing bakes a tensor the model's code built from sizes alone into the graph as a constant
(`_tensor_constant0`), strides and all: `torch.arange(n)[None].expand(b, n)`, a common way to
build position indices, becomes a constant whose rows share one memory location. Reading it is
fine, but pdcompile puts a graph's buffers back after every run that must change nothing (the
shape pass, the dry run of a minibatch, the cost pass), and `copy_` into such a tensor fails.
No operation of the graph can write to it either (PyTorch refuses the same), so giving it dense
storage of its own changes no value the graph computes.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def shares_memory_within(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may be one memory location (an expanded tensor, strides 0);
    a conservative test: True only where the strides leave no room between dimensions."""
    reach = 0  # the furthest offset the dimensions with smaller strides reach
    for size, stride in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] > 1),
                               key=lambda d: d[1]):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def densify_constants(gm: fx.GraphModule) -> list[str]:
    """Give every tensor the graph holds at its root (tracing's constants), whose elements share
    memory, dense storage of its own; the names it changed. The layers' own tensors are the
    user's (the graph shares them with the model), and are left alone."""
    names = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    names |= {name for name, _ in gm.named_buffers(recurse=False)}
    changed = []
    for name in sorted(n for n in names if "." not in n):
        value = getattr(gm, name, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                and value.device.type != "meta" and shares_memory_within(value):
            setattr(gm, name, value.contiguous())
            changed.append(name)
    return changed


__all__ = ["densify_constants", "shares_memory_within"]
