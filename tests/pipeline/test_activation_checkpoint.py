"""A model that checkpoints a block itself (`torch.utils.checkpoint.checkpoint`) trains as one
process does under both front ends, reentrant or not (passes/reentrant_checkpoint.py). Before,
the reentrant checkpoint's block was traced with gradients off: under torch.fx it was cut from
autograd (the block never trained and no gradient reached the layers before it), under
torch.export nothing trained at all; both silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointFunction, checkpoint

from tests.helpers.one_process import assert_two_stages_train_like_one_process


class Checkpointed(nn.Module):
    def __init__(self, *, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_block_trains_like_one_process(frontend: str, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant=reentrant).double()
    assert_two_stages_train_like_one_process(model, frontend=frontend)
    assert "apply" not in CheckpointFunction.__dict__  # torch's own apply again after capture
