"""A model that turns the caller's torch.autocast off inside its forward, as timm's EfficientViT
keeps its attention in float32."""

from __future__ import annotations

import torch
from torch import nn


class FloatAttention(nn.Module):
    """Attention in float32 whatever autocast the caller runs it under (a CPU model)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.autocast("cpu", enabled=False):
            h = h.float()
            h = torch.softmax(h @ h.t(), -1) @ h
        return self.b(h)
