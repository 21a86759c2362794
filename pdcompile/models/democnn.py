"""A small CNN and a learnable synthetic image task, sized for `pdcompile demo` on a CPU.

The task: each of `num_classes` classes is a fixed random image pattern; a sample is its class's
pattern under Gaussian noise. A CNN learns it within a few dozen minibatches (the loss falls from
ln(num_classes) towards 0), which makes the demo's loss curve mean something without a data set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class DemoCNN(nn.Module):
    """Four conv-ReLU blocks (two pooled), then a two-layer classifier with a wide hidden layer
    (most of the parameters, as in VGG: what makes data parallelism pay for all-reduces)."""

    def __init__(self, *, num_classes: int = 8, width: int = 16, image_size: int = 32,
                 hidden: int = 512) -> None:
        super().__init__()
        c = width
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4 * c, 4 * c, 3, padding=1), nn.ReLU(),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(4 * c * side * side, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def factory(*, batch_size: int = 32, image_size: int = 32, width: int = 16,
            num_classes: int = 8, hidden: int = 512) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (images,)) with one example minibatch of `batch_size` images."""
    model = DemoCNN(num_classes=num_classes, width=width, image_size=image_size, hidden=hidden)
    x = torch.randn(batch_size, 3, image_size, image_size)
    return model, (x,)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes."""
    return nn.functional.cross_entropy(output, target)


def make_target(example_inputs: tuple[Any, ...], *, num_classes: int = 8) -> torch.Tensor:
    """Random class labels, one per image."""
    return torch.randint(0, num_classes, (example_inputs[0].shape[0],))


def batches(steps: int, *, batch_size: int = 32, image_size: int = 32, num_classes: int = 8,
            noise: float = 1.0, seed: int = 0
            ) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """`steps` minibatches `((images,), labels)` of the synthetic task; the same stream for the
    same arguments in every process (a worker regenerates it from the seed)."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, image_size, image_size, generator=gen)
    for _ in range(steps):
        labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
        images = patterns[labels] + noise * torch.randn(batch_size, 3, image_size, image_size,
                                                        generator=gen)
        yield (images,), labels
