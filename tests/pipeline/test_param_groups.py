"""`compile(..., param_groups=fn)`: optimizer param groups by the parameters' names in the model
(the usual 'no weight decay for biases and norms'), per stage, as one process with the same
groups trains; kept in exports. Before, each stage's factory got a flat list of parameters and
no way to tell them apart."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.errors import PipelineInputError
from tests.helpers.one_process import param_groups_of, train_one_process

STEPS, MICRO = 3, 2


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.norm(torch.tanh(self.inp(x))))))


def no_decay(name: str, param: torch.nn.Parameter) -> dict[str, Any]:
    """No weight decay for biases and norms; the norm also learns 10x faster."""
    if name.startswith("norm."):
        return {"weight_decay": 0.0, "lr": 0.1}
    return {"weight_decay": 0.0} if param.ndim < 2 else {}


def adamw(params: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.5)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    return train_one_process(model, adamw(param_groups_of(model, no_decay)), (x,), y,
                             F.mse_loss, micro=MICRO, steps=STEPS)[0]


@pytest.mark.parametrize("stages", [[1, 1, 1], [1, 2]])
def test_param_groups_by_name_train_as_one_process(stages: list[int], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Normed()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.mse_loss,
                             optimizer=adamw, param_groups=no_decay, stages=stages,
                             schedule="1f1b-flush", microbatches=MICRO)
    assert any(len(opt.param_groups) > 1 for opt in pipe.optimizers)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    losses = [pipe.step(x, target=y) for _ in range(STEPS)]
    want = _reference(model, x, y)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value,
                                   msg=lambda m, n=name: f"{n}: {m}")
    again = [loaded.step(x, target=y) for _ in range(STEPS)]  # the groups came back
    assert again == losses


def test_a_group_that_is_not_options_is_refused_naming_the_parameter() -> None:
    with pytest.raises(PipelineInputError, match=r"param_groups\('inp.weight', ...\) returned "
                                                 r"\[0.0\]"):
        pdcompile.compile(Normed(), example_inputs=(torch.randn(4, 8),), stages=2,
                          param_groups=lambda name, p: [0.0])
