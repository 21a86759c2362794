"""Inputs that are numbers, not tensors. torch.export writes such a value into the graph at
capture (`for _ in range(repeats)` unrolled for the example's), so a minibatch giving another
value once ran the example's silently; it is refused now, naming the input. Where a stage reads
the value (torch.fx keeps `x * scale` as an operation on the input), another value is simply
used."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.errors import PipelineInputError


class Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.step, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, repeats: int = 2) -> torch.Tensor:
        h = self.first(x)
        for _ in range(repeats):
            h = torch.tanh(self.step(h))
        return self.out(h)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.out(torch.tanh(self.first(x)) * scale)


def test_another_value_of_a_number_the_graph_holds_is_refused() -> None:
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(Repeated(), example_inputs=(x, 3), loss_fn=F.cross_entropy,
                             stages=2, frontend="export", schedule="1f1b-flush", microbatches=2)
    pipe.step(x, 3, target=y)
    with pytest.raises(PipelineInputError, match=r"input 'repeats' is 5, but example_inputs "
                                                 r"gave 3, which the compiled graph holds"):
        pipe.step(x, 5, target=y)


def test_a_number_a_stage_reads_may_change() -> None:
    torch.manual_seed(0)
    model = Scaled()
    reference = Scaled()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 8), torch.randn(8, 3)
    pipe = pdcompile.compile(model, example_inputs=(x, 2.0), stages=2, frontend="fx",
                             loss_fn=F.mse_loss, schedule="1f1b-flush", microbatches=1,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert any(r.name == "scale" for p in pipe.parts.stages for r in p.inputs)
    loss = pipe.step(x, 3.0, target=y)
    want = F.mse_loss(reference(x, 3.0), y)
    want.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value)
