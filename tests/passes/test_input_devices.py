"""Example inputs on another device than the model are refused before tracing, naming the input,
both devices and the fix (before: a node of the shape pass failed with torch's "Expected all
tensors to be on the same device", naming neither)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu() * mask)


def test_inputs_on_another_device_than_the_parameters_are_named() -> None:
    model = TwoInputs().to("meta")
    with pytest.raises(PipelineInputError,
                       match=r"example input #0 is on cpu but the model's parameters are on "
                             r"meta; build the example inputs on meta"):
        pdcompile.compile(model, example_inputs=(torch.randn(4, 8), torch.ones(4, 8)), stages=2)


def test_a_named_input_on_another_device_is_named() -> None:
    model = TwoInputs()
    inputs = {"x": torch.randn(4, 8), "mask": torch.ones(4, 8, device="meta")}
    with pytest.raises(PipelineInputError, match=r"example input 'mask' is on meta but the "
                                                 r"model's parameters are on cpu"):
        pdcompile.compile(model, example_inputs=inputs, stages=2)


def test_inputs_on_the_models_device_compile() -> None:
    model = TwoInputs()
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 8), torch.ones(4, 8)),
                             loss_fn=nn.functional.cross_entropy, stages=2,
                             schedule="1f1b-flush", microbatches=2)
    loss = pipe.step(torch.randn(4, 8), torch.ones(4, 8), target=torch.zeros(4, dtype=torch.long))
    assert loss > 0
