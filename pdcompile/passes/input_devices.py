"""The example inputs' devices against the model's: a mismatch is the user's to fix, and
without this check it surfaces as a failing node deep in the shape pass ("Expected all tensors to
be on the same device") that names neither the input nor the fix. `nn.DataParallel` on a machine
with one GPU moves its module to that GPU when it is built, so inputs made on the CPU next to it
no longer match."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pdcompile.errors import PipelineInputError


def check_input_devices(model: nn.Module, args: Sequence[Any],
                        kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuses example inputs on another device than the model's parameters and buffers, where
    those all sit on one device (a model spread over several devices is left to the trace)."""
    held = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(held) != 1:
        return
    (device,) = held
    leaves, _ = tree_flatten((tuple(args), dict(kwargs or {})))
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            raise PipelineInputError(
                f"example input {_where(args, kwargs, index)} is on {leaf.device} but the model's "
                f"parameters are on {device}; build the example inputs on {device} (for example "
                f"`x.to('{device}')`), or move the model with `model.to('{leaf.device}')`"
                + (" (nn.DataParallel moves its module to the GPU when built)"
                   if device.type == "cuda" else ""))


def _where(args: Sequence[Any], kwargs: Mapping[str, Any] | None, index: int) -> str:
    """The input's position for the message: `#i` among positional arguments, else its name."""
    count = 0
    for position, arg in enumerate(args):
        leaves, _ = tree_flatten(arg)
        if index < count + len(leaves):
            return f"#{position}"
        count += len(leaves)
    for name, value in dict(kwargs or {}).items():
        leaves, _ = tree_flatten(value)
        if index < count + len(leaves):
            return repr(name)
        count += len(leaves)
    return f"#{index}"
