"""A model with inputs that hold no samples: a fixed (seq, seq) mask, per-class weights and a 0-d
temperature beside the batch of token features (the whole-inputs tests, local and on gloo)."""

from __future__ import annotations

import torch
from torch import nn

SEQ, CLASSES = 3, 4


class Masked(nn.Module):
    """Token features mixed by a fixed (seq, seq) mask, scaled per class and by a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor,
                temperature: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = mask @ h
        return self.b(h).mean(1) * weight / temperature
