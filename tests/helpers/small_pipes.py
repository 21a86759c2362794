"""A small model, its data and its pipeline, for the backends' tests."""

from __future__ import annotations

import torch
import torch.nn as nn

import pdcompile

mse = nn.functional.mse_loss


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def small_data(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]


def small_pipe(model: nn.Module, **options: object) -> pdcompile.pipeline.Pipeline:
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 6),), loss_fn=mse,
                             **options)  # type: ignore[arg-type]
