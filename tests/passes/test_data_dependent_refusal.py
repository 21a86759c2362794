"""Data-dependent Python in a forward (a branch on a tensor's value, a router that skips an
expert with no rows) is refused by compile in one line naming the line of code and the fix,
and nothing else: torch.export's failed attempts printed their partial graphs to stderr
(dozens of lines of generated code per attempt) ahead of that line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import TraceError


class BranchOnSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        if y.sum() > 0:
            y = y * 2
        return self.second(y)


class SkippingRouter(nn.Module):
    """Top-1 routing that skips an expert no row chose."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.router(x).topk(1, dim=-1)
        mixed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (chosen[:, 0] == index).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            mixed = mixed.index_add(0, rows, expert(x[rows]) * weight[rows])
        return mixed


@pytest.mark.parametrize("model, culprit", [(BranchOnSum, "if y.sum() > 0:"),
                                            (SkippingRouter, "if rows.numel() == 0:")])
def test_data_dependent_python_is_refused_in_one_line_and_nothing_else(
        model: type[nn.Module], culprit: str, capfd: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(8, 4)
    with pytest.raises(TraceError) as refused:
        pdcompile.compile(model(), "local-2", example_inputs=(x,),
                          loss_fn=nn.functional.mse_loss, stages=2, microbatches=2,
                          cost="analytic")
    message = str(refused.value)
    assert "\n" not in message
    assert f"{model.__name__}.forward" in message and culprit in message
    assert "Fix:" in message and "torch.where" in message
    printed = capfd.readouterr()
    assert "def forward" not in printed.err + printed.out
