"""Sizes torch.export keeps free although the model's code tests them beyond a range are fixed at
the example's, so that another size is refused in words instead of training on a branch the
model would not take (passes/input_shapes.py, `_pinned_sizes`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError


class Parity(nn.Module):
    """Doubles its output where the sequence length is even; fx cannot trace the `if`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.shape[1] % 2 == 0:
            return y * 2
        return y


class Related(nn.Module):
    """Adds 1 where `z` is 3 longer than the batch: two inputs' sizes tested together."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if z.shape[0] == x.shape[0] + 3:
            y = y + 1
        return y * z.mean()


def _square(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def test_a_size_whose_parity_the_model_tests_is_fixed() -> None:
    torch.manual_seed(0)
    model = Parity()
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(2, 4, 3),), loss_fn=_square,
                             stages=[1, 1], cost="analytic")
    assert pdcompile.meta.get_frontend(pipe.graph) == "export"
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(any, 4, 3) float32"
    odd = torch.randn(2, 5, 3)
    with pytest.raises(PipelineInputError, match="fixed it at 4"):  # trained doubled before
        pipe.step(odd, target=torch.zeros(2, 5, 3))
    other_batch = torch.randn(6, 4, 3)  # the batch is not tested: it stays free
    torch.testing.assert_close(pipe.evaluate(other_batch), model(other_batch))


def test_sizes_tested_together_are_fixed_together() -> None:
    torch.manual_seed(0)
    model = Related()
    x, z = torch.randn(2, 3), torch.randn(5)
    pipe = pdcompile.compile(model, example_inputs=(x, z), loss_fn=_square, stages=[1, 1],
                             cost="analytic")
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(2, 3) float32"
    assert pipe.input_shapes.describe("z") == "(5,) float32"
    with pytest.raises(PipelineInputError, match="input 'z'"):  # 3 longer no more: no +1
        pipe.step(x, torch.randn(6), target=torch.zeros(2, 3))


class Pooled(nn.Module):
    """Halves the image, mixes its pixels and averages them: torch.export tests the sizes
    (`h // 2 != 1` and the like) without the result depending on them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 2, stride=2)
        self.linear = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        y = y.reshape(b, c, h * w).transpose(1, 2)
        return self.linear(y).mean(1)


def test_tests_that_only_exclude_degenerate_sizes_leave_them_free() -> None:
    torch.manual_seed(0)
    model = Pooled()
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(2, 3, 8, 8),), loss_fn=_square,
                             stages=[1, 1], cost="analytic", frontend="export")
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(any, 3, any, any) float32"
    bigger = torch.randn(3, 3, 12, 10)
    torch.testing.assert_close(pipe.evaluate(bigger), model(bigger))
