"""Models whose forward changes a buffer, shared by the trace and the buffer-state tests."""

from __future__ import annotations

import torch
from torch import nn


class RunningCentre(nn.Module):
    """A centre, a gate from a module and a running mean of the hidden values, all under the
    model's own no_grad; the running mean is moved, then added to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            centre = h.mean(0, keepdim=True)
            gate = torch.sigmoid(self.gate(h))
            self.running.mul_(0.9).add_(0.1 * centre[0])
        return self.b((h - centre) * gate + self.running)
