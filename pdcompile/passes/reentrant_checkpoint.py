"""Activation checkpointing by `torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)`,
traced as the plain call `fn(x)`.

The reentrant checkpoint runs `fn` inside an autograd Function whose forward turns gradients
off (its backward runs `fn` again with them on). torch.fx records that forward: every operation
of `fn` traced with gradients off, which the trace then cuts from autograd as it does a
`torch.no_grad()` region of the model (passes/trace.py). The pipeline trained silently without
the checkpointed layers' gradients, and without any gradient flowing past them (under
torch.export it trained nothing at all). Checkpointing
changes what is kept, not what is computed, so within a capture (either front end) the Function's `apply` calls `fn`
directly (the pipeline has its own recomputation: a plan's `recompute`). The non-reentrant
checkpoint (`use_reentrant=False`) runs `fn` with gradients on and traces as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.checkpoint import CheckpointFunction


@contextmanager
def reentrant_checkpoints_as_calls() -> Iterator[None]:
    """Within: `CheckpointFunction.apply(fn, preserve_rng_state, *args)` returns `fn(*args)`."""
    own = CheckpointFunction.__dict__.get("apply")

    def apply(cls: type, function: Callable[..., Any], preserve_rng_state: bool,
              *args: Any) -> Any:
        return function(*args)

    CheckpointFunction.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        if own is None:
            del CheckpointFunction.apply
        else:
            CheckpointFunction.apply = own  # type: ignore[method-assign]


__all__ = ["reentrant_checkpoints_as_calls"]
