"""Pruned layers (`torch.nn.utils.prune`: a forward pre-hook computes `weight = weight_orig *
weight_mask`) train as one process does, replicated too. The split once failed on them with
torch's "Only Tensors created explicitly by the user support the deepcopy protocol": the
computed weight, held between calls, cannot be deep-copied (util/module_copy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune

import pdcompile
from pdcompile.errors import PipelineInputError
from tests.helpers.one_process import train_one_process
from tests.helpers.transparency import momentum

STEPS, MICRO = 3, 2


def _pruned() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    prune.l1_unstructured(model[2], "weight", amount=0.5)
    return model


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("replicas", [[1, 1, 1], [1, 2, 1]])
def test_a_pruned_layer_trains_as_in_one_process(frontend: str, replicas: list[int]) -> None:
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(_pruned(), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=momentum, stages=replicas, frontend=frontend,
                             schedule="1f1b-flush", microbatches=MICRO)
    losses = [pipe.step(x, target=y) for _ in range(STEPS)]
    reference = _pruned()  # the same weights: a pruned model cannot be deep-copied either
    want, _ = train_one_process(reference, momentum(list(reference.parameters())), (x,), y,
                                F.cross_entropy, micro=MICRO, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    state = pipe.state_dict()
    assert set(state) == set(reference.state_dict())  # weight_orig and weight_mask
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")


def test_exporting_a_pruning_hook_names_the_way_that_can(tmp_path: Path) -> None:
    pipe = pdcompile.compile(_pruned(), example_inputs=(torch.randn(8, 8),), stages=2,
                             frontend="fx", schedule="1f1b-flush", microbatches=MICRO)
    with pytest.raises(PipelineInputError, match=r"forward_pre_hooks.*frontend='export'"):
        pipe.export(str(tmp_path / "pipe"))
