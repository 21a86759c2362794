"""Parameters and buffers that forward never reads (a head kept for another task, a layer left in
the model) stay in the pipeline's state_dict, unchanged by training as in one process, and in an
export; once they were dropped, so `model.load_state_dict(pipe.state_dict())` failed."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn

import pdcompile


class WithSpareHead(nn.Module):
    """Trains `body` and `head`; `spare` (a Linear and a buffer) is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 5)
        self.register_buffer("spare_stat", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_unused_tensors_stay_in_the_state_and_the_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = WithSpareHead()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=nn.functional.mse_loss, stages=2, schedule="1f1b-flush",
                             microbatches=2,
                             optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1))
    for _ in range(2):
        pipe.step(x, target=y)
    state = pipe.state_dict()
    assert set(state) == set(model.state_dict())
    for name in ("spare.weight", "spare.bias", "spare_stat"):
        torch.testing.assert_close(state[name], model.state_dict()[name])
    assert not torch.equal(state["head.weight"], model.head.weight)  # the rest trained
    trained = WithSpareHead()
    trained.load_state_dict(state)  # strict: every key, no extra

    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    again = loaded.state_dict()
    assert set(again) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(again[name], value, msg=lambda m, n=name: f"{n}: {m}")


def test_a_model_that_reads_everything_exports_no_unused_file(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),), stages=2)
    assert pipe.parts.unused == {}
    pipe.export(str(tmp_path / "pipe"))
    assert not (tmp_path / "pipe" / "unused.safetensors").exists()
