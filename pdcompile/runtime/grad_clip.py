"""Gradient clipping by the global norm, across the stages of a pipeline.

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` scales every gradient of a
minibatch by `min(1, max_norm / (norm + 1e-6))`, where `norm` is the 2-norm of all the model's
gradients together. Cut into stages, no rank holds them all: each rank adds up the squares of
its own stage's gradients, one all-reduce over every rank sums them (a replicated stage's
replicas hold the same gradients after their all-reduce, so each adds its share; a tied
parameter counts once, on the first stage holding it; a rank holding several chunks adds all
of theirs and joins the all-reduce once: runtime/chunks.py), and every rank scales its own by
the same factor, as torchtitan does for its pipeline stages. The norm of a minibatch exists only
once every stage has its gradients, so this needs a flush schedule (asynchronous 1F1B updates
each stage at another time).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdcompile.errors import PipelineInputError

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm
EPSILON = 1e-6


def square_norm(grads: Iterable[torch.Tensor], *, share: int = 1) -> torch.Tensor:
    """The sum of the squares of `grads` (float64, one element), divided by `share`."""
    total = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), 2.0).double().cpu() ** 2
    return total / share


def clip_factor(total_square: torch.Tensor, max_norm: float) -> float:
    """The factor every gradient is scaled by: `min(1, max_norm / (norm + 1e-6))`."""
    norm = float(total_square.sum().sqrt())
    return min(1.0, max_norm / (norm + EPSILON))


def check_max_norm(value: object) -> float | None:
    """`clip_grad_norm` as given, checked: None (no clipping) or a positive finite number;
    a PipelineInputError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < float(value) < float("inf")):
        raise PipelineInputError(f"clip_grad_norm must be a positive number (the largest global "
                         f"gradient norm), got {value!r}")
    return float(value)


__all__ = ["EPSILON", "check_max_norm", "clip_factor", "square_norm"]
