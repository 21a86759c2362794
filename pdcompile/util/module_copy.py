"""A deep copy of a module that also holds tensors computed from its parameters.

`copy.deepcopy` refuses a tensor that is not a leaf of autograd. Layers that compute a tensor
attribute from their parameters in a forward pre-hook hold one between calls: a pruned layer
(`torch.nn.utils.prune`: `weight = weight_orig * weight_mask`) and the old
`torch.nn.utils.weight_norm`. The hook computes it again before every forward, so the copy gets
it detached; the parameters and buffers it came from are copied as usual.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def copy_module(module: M) -> M:
    """`copy.deepcopy(module)`, with computed tensor attributes copied detached."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(module, memo)


__all__ = ["copy_module"]
