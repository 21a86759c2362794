"""Buffers registered with persistent=False: out of state dicts, kept by exports, set at load."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from torch import nn

import pdcompile


class Positions(nn.Module):
    """Adds a fixed table, read through a non-persistent buffer (like BERT's position ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 6 * 8).reshape(6, 8),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.narrow(self.table, 0, 0, x.shape[1])


class Masked(nn.Module):
    """A leaf holding a non-persistent causal mask (like GPT-2's attn.bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        return self.mask[:n, :n] @ self.proj(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.pos = Positions()
        self.mix = Masked()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.pos(self.embed(x))).mean(dim=1))


def _compiled() -> tuple[Model, pdcompile.pipeline.Pipeline, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(4, 6, 4), torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             schedule="1f1b-flush", microbatches=2, stages=3,
                             leaf_modules=[Masked], frontend="fx")
    return model, pipe, x, y


def test_state_dict_leaves_them_out_as_pytorch_does() -> None:
    model, pipe, x, y = _compiled()
    assert {"pos.table", "mix.mask"} <= {n for n, _ in model.named_buffers()}
    state = pipe.state_dict()
    assert set(state) == set(model.state_dict())  # no pos.table, no mix.mask
    pipe.step(x, target=y)
    model.load_state_dict(pipe.state_dict())  # strict: the keys match exactly
    with torch.no_grad():
        torch.testing.assert_close(model(x), pipe(x))


def test_export_keeps_them_and_load_rebuilds_them(tmp_path: Path) -> None:
    _, pipe, x, y = _compiled()
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))  # failed: "unexpected ['mix.mask']"
    buffers = {name for module in loaded.stage_modules for name, _ in module.named_buffers()}
    assert "pos_table" in buffers and "mix.mask" in buffers
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), pipe(x))
    assert set(loaded.state_dict()) == set(pipe.state_dict())
    assert loaded.step(x, target=y) == pipe.step(x, target=y)
