"""Whether a tensor the runtime kept may be overwritten: nothing but its holder refers to it.

The stash reuses a dropped weight version's storage for the next version (runtime/stash.py).
That is safe only where no one else can still read the old values: not an autograd graph (a
saved tensor holds the tensor's implementation), not a view of it or a tensor sharing its
storage (`detach()`), not a Python reference (a hook that kept `module.weight` during a
forward). Each count is compared with the same count taken the same way for a tensor known to
be held only by a dict, so that the test does not depend on how an interpreter counts its own
temporary references.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

_use_count = getattr(torch.Tensor, "_use_count", None)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _counts(holder: Mapping[Any, torch.Tensor], key: Any) -> tuple[int, int, int]:
    """Python references, implementation references and storage references of `holder[key]`."""
    tensor = holder[key]
    storage = tensor.untyped_storage()
    return (sys.getrefcount(tensor), tensor._use_count(),
            _storage_use_count(storage._cdata))  # type: ignore[misc]


def _alone() -> tuple[int, int, int] | None:
    """The counts of a tensor held by one dict only (None where torch lacks the counters)."""
    if _use_count is None or _storage_use_count is None:
        return None
    try:
        return _counts({0: torch.empty(1)}, 0)
    except (AttributeError, RuntimeError, TypeError):
        return None


_ALONE = _alone()


def only_held_here(holder: Mapping[Any, torch.Tensor], key: Any) -> bool:
    """Whether `holder[key]` exists and nothing but `holder` refers to it or to its storage
    (False where this torch cannot tell)."""
    if _ALONE is None or key not in holder:
        return False
    return _counts(holder, key) == _ALONE


__all__ = ["only_held_here"]
