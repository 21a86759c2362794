"""The loss and the target of the image classifiers (AlexNet, VGG-16, ResNet-50): one home, so
that their model modules name the same functions (`module:loss_fn`, `module:make_target`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes."""
    return nn.functional.cross_entropy(output, target)


def make_target(example_inputs: tuple[Any, ...], *, num_classes: int = 10) -> torch.Tensor:
    """Random class labels, one per image."""
    x = example_inputs[0]
    return torch.randint(0, num_classes, (x.shape[0],), device=x.device)


__all__ = ["loss_fn", "make_target"]
