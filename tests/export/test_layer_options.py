"""torch.nn layers whose repr leaves out some of their options (AvgPool2d's count_include_pad,
ceil_mode and divisor_override, Upsample's align_corners, RNN's nonlinearity) export with those
options. The stage source rebuilt such layers from their repr, which gives the defaults, so a
loaded export of timm's PoolFormer-v2 (AvgPool2d(3, 1, 1, count_include_pad=False)) computed
another function than the pipeline it was exported from, silently (found by feeding timm's
models through compile, export and load)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile

LAYERS = {
    "avgpool2d_count_include_pad": nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    "avgpool2d_ceil_mode": nn.AvgPool2d(2, 2, ceil_mode=True),
    "avgpool2d_divisor_override": nn.AvgPool2d(2, 1, divisor_override=3),
    "avgpool1d_count_include_pad": nn.AvgPool1d(3, 1, 1, count_include_pad=False),
    "upsample_align_corners": nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
    "rnn_relu": nn.RNN(4, 4, nonlinearity="relu", batch_first=True),
}


class _Net(nn.Module):
    """conv | layer | conv, head: the layer sits in the first stage."""

    def __init__(self, layer: nn.Module, one_d: bool) -> None:
        super().__init__()
        conv = nn.Conv1d if one_d else nn.Conv2d
        self.inp = conv(3, 4, 3, padding=1)
        self.layer = layer
        self.out = conv(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if isinstance(self.layer, nn.RNN):  # over the length of a 1-d signal
            h = self.layer(h.transpose(1, 2))[0].transpose(1, 2)
        else:
            h = self.layer(h)
        h = self.out(torch.tanh(h))
        return self.head(h.flatten(2).mean(-1))


def _plain_attributes(module: nn.Module) -> dict[str, object]:
    """The layer's options (an RNN's weights and their references left out)."""
    base = set(nn.Module().__dict__)
    return {k: v for k, v in vars(module).items()
            if k not in base and not k.startswith("_flat_weight")}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_options_survive_export(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = copy.deepcopy(LAYERS[name])
    one_d = "1d" in name or "rnn" in name
    model = _Net(layer, one_d)
    x = torch.randn(4, 3, 7) if one_d else torch.randn(4, 3, 7, 7)
    y = torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(model, stages=2, cost="analytic", example_inputs=(x,),
                             loss_fn=F.cross_entropy, schedule="1f1b-flush", microbatches=2,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    rebuilt = [m for stage in loaded.stage_modules for m in stage.modules()
               if type(m) is type(layer)]
    assert len(rebuilt) == 1
    assert _plain_attributes(rebuilt[0]) == _plain_attributes(layer)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), pipe(x), rtol=0, atol=0)
    assert loaded.step(x, target=y) == pipe.step(x, target=y)
