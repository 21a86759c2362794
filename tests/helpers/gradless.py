"""A model whose stages hold parameters that get no gradient (one used only under no_grad, one
frozen), the plans that replicate either stage, and optimizers with weight decay (which moves a
parameter given a zero gradient, and leaves one given none alone)."""

from __future__ import annotations

import torch
import torch.nn as nn

from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.plan import Plan

FIRST = ("x", "a", "tanh", "g", "sigmoid")  # stage 0's nodes: the gate Linear lives there


class GatedFrozen(nn.Module):
    """a, then a gate from g computed under no_grad (g gets no gradient), then a frozen Linear
    and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.g = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.o = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            gate = torch.sigmoid(self.g(x))
        return self.o(self.frozen(h * gate))


def plan_of(model: nn.Module, replicas: list[int]) -> Plan:
    """Stage 0: a and the gate; stage 1: the frozen Linear and the head."""
    gm = trace(model)
    return manual_plan(gm, lambda n: 0 if n.name in FIRST or n.op == "placeholder" else 1,
                       replicas=replicas)


def sgd_decay(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


OPTIMIZERS = {"sgd_decay": sgd_decay, "adamw": adamw}
