"""ResNet-50 (He et al., 2016): bottleneck residual blocks [3, 4, 6, 3] with BatchNorm.

`width` divides every channel count (1 = the paper's 64..2048); `blocks` changes the depth.
The residual additions make the graph branch, which the partitioner must handle.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcompile.models.classification import loss_fn, make_target


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet50(nn.Module):
    """Stem, four stages of bottlenecks, global pooling, classifier."""

    def __init__(self, *, num_classes: int = 10, width: int = 4,
                 blocks: tuple[int, int, int, int] = (3, 4, 6, 3)) -> None:
        super().__init__()
        base = max(1, 64 // width)
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = base
        stages: list[nn.Module] = []
        for i, count in enumerate(blocks):
            planes = base * 2**i
            layer: list[nn.Module] = []
            for j in range(count):
                layer.append(Bottleneck(inplanes, planes, stride=2 if (j == 0 and i > 0) else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def factory(*, batch_size: int = 4, image_size: int = 64, width: int = 4, num_classes: int = 10,
            blocks: tuple[int, int, int, int] = (3, 4, 6, 3),
            device: str | torch.device = "cpu") -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (images,)); width=1, image_size=224, num_classes=1000 is the paper's ResNet-50."""
    with torch.device(device):
        model = ResNet50(num_classes=num_classes, width=width, blocks=blocks)
        x = torch.randn(batch_size, 3, image_size, image_size)
    return model, (x,)


__all__ = ["Bottleneck", "ResNet50", "factory", "loss_fn", "make_target"]
