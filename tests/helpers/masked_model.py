"""A model with inputs that hold no samples: a fixed (seq, seq) mask, per-class weights and a 0-d
temperature beside the batch of token features (the whole-inputs tests, local and on gloo)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
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


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def accumulated(model: nn.Module, batches: Iterable[tuple[tuple[torch.Tensor, ...], torch.Tensor]],
                micro: int) -> list[float]:
    """One process's training of `model` (in place, `sgd`), one update per minibatch
    ((x, *rest), y): gradients accumulated over `micro` microbatches of x and y, the rest read
    whole; each minibatch's loss."""
    opt = sgd(model.parameters())
    losses = []
    for (x, *rest), y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
            loss = F.mse_loss(model(xs, *rest), ys) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses
