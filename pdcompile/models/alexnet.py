"""AlexNet (Krizhevsky et al., 2012), in the one-GPU form torchvision made common.

`width` divides the channel counts; the default runs on small images on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcompile.models.classification import loss_fn, make_target


class AlexNet(nn.Module):
    """Five convolutions, three max-pools, adaptive pooling to 6x6, three linear layers."""

    def __init__(self, *, num_classes: int = 10, width: int = 4, hidden: int | None = None) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (max(1, c // width) for c in (64, 192, 384, 256, 256))
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        hidden = hidden or max(16, 4096 // width)
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(c5 * 6 * 6, hidden), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def factory(*, batch_size: int = 8, image_size: int = 128, width: int = 4, num_classes: int = 10,
            device: str | torch.device = "cpu") -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (images,)); width=1, image_size=224, num_classes=1000 is the original size."""
    with torch.device(device):
        model = AlexNet(num_classes=num_classes, width=width)
        x = torch.randn(batch_size, 3, image_size, image_size)
    return model, (x,)


__all__ = ["AlexNet", "factory", "loss_fn", "make_target"]
