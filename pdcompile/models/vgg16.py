"""VGG-16 (Simonyan and Zisserman, 2015): 13 3x3 convolutions in 5 blocks, 3 linear layers.

`width` divides every channel count (1 = the paper's 64..512); the default is a slim version for
small images that trains on a CPU in well under a second per step.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcompile.models.classification import loss_fn, make_target

CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 with configurable width, classifier size and image size."""

    def __init__(self, *, num_classes: int = 10, width: int = 8, image_size: int = 32,
                 hidden: int | None = None, batch_norm: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                continue
            out = max(1, int(item) // width)
            layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        side = max(1, image_size // 32)
        hidden = hidden or max(16, 4096 // width)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * side * side, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def factory(*, batch_size: int = 8, image_size: int = 32, width: int = 8, num_classes: int = 10,
            batch_norm: bool = False, device: str | torch.device = "cpu"
            ) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (images,)); width=1, image_size=224, num_classes=1000 is the paper's VGG-16."""
    with torch.device(device):
        model = VGG16(num_classes=num_classes, width=width, image_size=image_size,
                      batch_norm=batch_norm)
        x = torch.randn(batch_size, 3, image_size, image_size)
    return model, (x,)


__all__ = ["VGG16", "factory", "loss_fn", "make_target"]
