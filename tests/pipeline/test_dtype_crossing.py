"""A tensor's dtype or device read in one stage and used in a later one (timm's XCiT and
EdgeNeXt build their positional encodings with `dtype=x.dtype, device=x.device` read blocks
earlier): such a cut was refused ("its value holds a dtype ... cut elsewhere"), though the
planner and even cuts know nothing of it, so a valid model could fail to compile. The dtype
travels as a number; the device arrives as the receiving stage's own (where its activations
live). Trains as one process does, also loaded from an export."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from tests.helpers.transparency import check


class LateEncoding(nn.Module):
    """Reads the input's dtype and device first, builds an encoding with them last."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, device = x.dtype, x.device
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        encoding = torch.arange(6, dtype=dtype, device=device) / 6
        return self.head(h + encoding)


def _plan(model: nn.Module) -> pdcompile.Plan:
    """a (with the dtype and device) | b | the encoding and head."""
    gm = trace(model)
    later = {"b": 1, "tanh_1": 1}
    return manual_plan(gm, lambda n: later.get(
        n.name, 0 if n.op == "placeholder" or n.name in ("a", "tanh") or n.target is getattr
        else 2))


def test_dtype_and_device_cross_stages(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LateEncoding()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    plan = _plan(model)
    gm = trace(model)
    read = [n.name for n in gm.graph.nodes if n.target is getattr]
    assert len(read) == 2 and all(plan.stage_of()[name] == 0 for name in read)
    pipe = check((copy.deepcopy(model), (x,), y, F.cross_entropy), schedule="1f1b-flush",
                 micro=2, plan=plan)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    twin = copy.deepcopy(pipe)
    for _ in range(2):
        assert loaded.step(x, target=y) == twin.step(x, target=y)
