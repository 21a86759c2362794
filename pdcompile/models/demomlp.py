"""A wide MLP on the demo's synthetic image task: weights large against their compute.

Every layer is a `hidden x hidden` Linear: with a few dozen samples per minibatch, each weight
is used for little arithmetic, so data parallelism, which all-reduces every weight after every
minibatch, spends much of its time communicating, while a pipeline sends only the small
activations between its stages (and each stage steps only its own weights). The layers are
alike, so the model cuts into stages of equal work. This is the model `pdcompile demo` trains
(the task is `democnn.batches`, images flattened).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcompile.models.democnn import batches, loss_fn, make_target


class DemoMLP(nn.Module):
    """Flatten, `depth` Linear-ReLU layers of width `hidden`, a Linear to the classes."""

    def __init__(self, *, image_size: int = 16, hidden: int = 1024, depth: int = 8,
                 num_classes: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(3 * image_size * image_size, hidden),
                                   nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def factory(*, batch_size: int = 32, image_size: int = 16, hidden: int = 1024, depth: int = 8,
            num_classes: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (images,)) with one example minibatch of `batch_size` images."""
    model = DemoMLP(image_size=image_size, hidden=hidden, depth=depth, num_classes=num_classes)
    return model, (torch.randn(batch_size, 3, image_size, image_size),)


__all__ = ["DemoMLP", "batches", "factory", "loss_fn", "make_target"]
