"""Layers held in another mode than their model (fine-tuning's frozen BatchNorm: `model.train()`
then `bn.eval()`) train as in one process, stay so in the user's model, and come back so from an
export. The fx front end once switched every layer to the model's mode (`gm.train(...)`, on the
user's own layers too), so a frozen BatchNorm normalised by the minibatch and moved its
statistics; an export rebuilt every layer in training mode."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from tests.helpers.transparency import check


def _fine_tuned() -> nn.Module:
    """A training model whose first BatchNorm (and a dropout) are frozen in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.5),
                          nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():  # statistics a pretrained model would have
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model[1].eval()
    model[3].eval()
    return model


def _modes(modules: list[nn.Module]) -> list[tuple[str, bool]]:
    return [(type(m).__name__, m.training) for root in modules for m in root.modules()
            if isinstance(m, nn.BatchNorm1d | nn.Dropout)]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_frozen_batchnorm_trains_as_in_one_process(frontend: str) -> None:
    model = _fine_tuned()
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pipe = check((model, (x,), y, F.mse_loss), schedule="1f1b-flush", micro=2, plan=None,
                 stages=2, frontend=frontend)
    frozen = pipe.state_dict()["1.running_mean"]
    torch.testing.assert_close(frozen, _fine_tuned()[1].running_mean)  # never moved
    assert pipe.model is not None and not pipe.model[1].training and pipe.model.training


def test_compile_leaves_the_users_layers_in_their_modes() -> None:
    model = _fine_tuned()
    before = _modes([model])
    pdcompile.compile(model, example_inputs=(torch.randn(16, 8),), stages=2)
    assert _modes([model]) == before and model.training


def test_an_export_keeps_each_layers_mode(tmp_path: Path) -> None:
    model = _fine_tuned()
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.mse_loss,
                             stages=2, schedule="1f1b-flush", microbatches=2)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    assert _modes(loaded.stage_modules) == _modes(pipe.stage_modules) == _modes([model])
    assert all(m.training for m in loaded.stage_modules)
    for _ in range(2):
        assert loaded.step(x, target=y) == pipe.step(x, target=y)
    for name, value in pipe.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
