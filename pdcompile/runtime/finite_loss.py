"""Non-finite losses stop a run: a NaN or infinite loss is named with its step, rank and stage.

A loss that is NaN or infinite trains nothing useful from then on (the weights it updates become
NaN too), so a run stops at the first one by default, in one line; `allow_nonfinite=True`
(`--allow-nonfinite`) keeps going. The check runs on the rank that computes the loss, when it
computes it (one scalar read per microbatch on the last stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdcompile.errors import PdcompileError


class NonFiniteLoss(PdcompileError, ArithmeticError):
    """A loss that is NaN or infinite (the message names step, rank, stage and microbatch)."""


@dataclass(frozen=True)
class LossGuard:
    """Refuses a non-finite loss; `first_step` numbers the run's first minibatch in the stream,
    `per_minibatch` its microbatches per minibatch."""

    first_step: int = 0
    per_minibatch: int = 1

    def check(self, loss: torch.Tensor, *, rank: int, stage: int, microbatch: int) -> None:
        """Raise `NonFiniteLoss` if `loss` is NaN or infinite."""
        value = float(loss.detach())
        if math.isfinite(value):
            return
        step = self.first_step + microbatch // max(1, self.per_minibatch)
        raise NonFiniteLoss(
            f"step {step}: the loss is {value} on rank {rank} (stage {stage}, microbatch "
            f"{microbatch} of the run); the run stops (a learning rate too high, or bad data?); "
            "allow_nonfinite=True (--allow-nonfinite) keeps going")


def guard_runtime(rt: object, guard: LossGuard | None) -> None:
    """Give a rank's runtime (or each of its chunks) the guard; None turns the check off."""
    for runtime in list(getattr(rt, "chunks", {}).values()) or [rt]:
        runtime.loss_guard = guard  # type: ignore[attr-defined]


__all__ = ["LossGuard", "NonFiniteLoss", "guard_runtime"]
