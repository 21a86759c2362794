"""Values a model's forward computes under `torch.no_grad()`, cut off from autograd in a graph.

A symbolic trace records operations, not the grad mode they ran in, so a graph would let
gradients flow where the model's own `with torch.no_grad():` stopped them (a running mean
subtracted from an activation, a target built from the model's own output). The trace pass
reads every value that enters such a region through `detached`, and the outputs of the modules
called in it, so that nothing computed there requires a gradient, under any cut into stages.
"""

from __future__ import annotations

from typing import Any

import torch


def detached(value: Any) -> Any:
    """`value` with every tensor in it detached (lists, tuples, named tuples and dicts kept);
    other values (sizes, flags) as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(detached(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(detached(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, detached(v)) for k, v in value.items())
    return value
