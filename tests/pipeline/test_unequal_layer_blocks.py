"""`stages=K` keeps whole layer blocks (api.py `_planned_in_blocks`) unless cutting inside them is
clearly faster: where the model's K blocks are unequal, whole blocks cannot balance (timm's
shvit_s2 in 4 stages: 21.47 ms a minibatch on whole blocks, 9.88 ms cut inside them)."""

from __future__ import annotations

import torch
from torch import nn

import pdcompile


class UnequalBlocks(nn.Module):
    """Four numbered blocks of 9, 1, 1 and 1 Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(*(nn.Linear(512, 512) for _ in range(n))) for n in (9, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def test_four_unequal_blocks_in_four_stages_are_cut_inside_the_largest() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 512)
    pipe = pdcompile.compile(UnequalBlocks(), example_inputs=(x,), loss_fn=_mse, stages=4,
                             schedule="1f1b-flush", microbatches=2, cost="analytic")
    holders = {i for i, program in enumerate(pipe.stage_programs)
               for names in program.param_names.values() for name in names
               if name.startswith("layers.0.")}
    assert len(holders) > 1, pipe.plan.config  # the 9 layers of block 0 over several stages
    assert pipe.plan.time_per_minibatch > 0
