"""The shape of a (nested) value, as a key and in words: how minibatches are told apart.

`signature` is equal for values shaped alike (a minibatch shape checked once: numbers count by
type); `shape_key` also tells numbers, strings and devices apart and gives up on other objects
(a message table kept per microbatch shape: a number may be a size the messages take);
`describe` says a shape in an error message.
"""

from __future__ import annotations

from typing import Any

import torch


def signature(value: Any) -> Any:
    """Shapes and dtypes of a (nested) value: equal for minibatches shaped alike."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, signature(v)) for k, v in value.items()))
    return type(value).__name__


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def shape_key(value: Any) -> Any:
    """What decides the shapes a graph computes from a (nested) value: its tensors' shapes,
    dtypes and devices and its numbers and strings themselves (a number can be a size); None
    where a leaf is another object, whose effect on shapes this cannot tell."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, tuple | list):
        keys = [shape_key(v) for v in value]
        return None if any(k is None for k in keys) else (type(value).__name__, *keys)
    if isinstance(value, dict):
        items = [(k, shape_key(v)) for k, v in value.items()]
        if any(k is None for _, k in items) or not all(isinstance(k, str) for k, _ in items):
            return None
        return ("dict", *sorted(items))
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    return None


def describe(value: Any) -> str:
    """"(8, 12) float32" for a tensor, a tuple of those for a tuple, the type otherwise."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


__all__ = ["describe", "shape_key", "signature"]
