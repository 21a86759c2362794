"""What one worker keeps between runs: its copy of a stage module and that stage's optimizer
(`RankState`); a stage without parameters gets `NoParameters`, whose steps do nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from pdcompile.runtime.stage_random import StageRandom


class NoParameters(torch.optim.Optimizer):
    """The optimizer of a stage without parameters (pooling, activations): steps do nothing."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": 0.0})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing to update."""


@dataclass
class RankState:
    """What one worker keeps between runs: its stage module copy and its optimizer."""

    rank: int
    stage: int
    module: fx.GraphModule
    optimizer: torch.optim.Optimizer
    param_order: tuple[str, ...]
    # the stream its forwards draw from (runtime/stage_random.py); None until its first run
    random: StageRandom | None = None

    def own_random(self) -> StageRandom:
        """Its stream, seeded on first use from the process's seed, its rank and its stage
        (every rank is seeded alike, so that data readers agree)."""
        if self.random is None:
            self.random = StageRandom.seeded(self.rank, self.stage)
        return self.random


__all__ = ["NoParameters", "RankState"]
