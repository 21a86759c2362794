"""passes/batch_check.py: which models it refuses (rows of dimension 0 mixed while those of
dimension 1 stay apart, as a sequence-first model's) and which it leaves alone (rows apart, a
batch of one, noise in evaluation mode, outputs that do not hold the rows: a loss over the
batch, a (batch, batch) matrix; samples mixed by design: attention over the batch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.errors import PipelineInputError
from pdcompile.passes.batch_check import check_samples_apart


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn
        self.norm = nn.BatchNorm1d(3)  # training-mode statistics would mix rows

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(self.norm(x.transpose(1, 2)).transpose(1, 2))


def _check(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> None:
    model = _Fn(fn)

    def call(named: Mapping[str, Any]) -> Any:
        return model(named["x"])

    check_samples_apart(model, {"x": x}, call)
    assert model.training  # the check's eval mode undone


X = torch.randn(6, 4, 3)


@pytest.mark.parametrize(("what", "fn", "x"), [
    ("rows apart", lambda x: torch.tanh(x) * 2, X),
    ("a batch of one", lambda x: x.cumsum(0), X[:1]),
    ("noise in eval mode", lambda x: x.cumsum(0) + torch.randn_like(x), X),
    ("a loss over the batch", lambda x: (x.mean(), x * 3), X),
    ("a (batch, batch) matrix", lambda x: x.flatten(1) @ x.flatten(1).T, X),
    ("attention over the batch", lambda x: torch.softmax(x.flatten(1) @ x.flatten(1).T, -1)
     @ x.flatten(1), X),
    ("rows mixed along dimension 1 too", lambda x: x - x.mean((0, 1)), X),
])
def test_left_alone(what: str, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> None:
    _check(fn, x)


@pytest.mark.parametrize(("what", "fn"), [
    ("a running sum along dimension 0", lambda x: x.cumsum(0)),
    ("weights normalised over dimension 0", lambda x: torch.softmax(x, 0) * x),
    ("the rows' mean, beside a loss", lambda x: (x.sum(), x - x.mean(0))),
    ("a running sum, (batch, features) out", lambda x: x.cumsum(0)[-1]),
])
def test_refused(what: str, fn: Callable[[torch.Tensor], Any]) -> None:
    with pytest.raises(PipelineInputError, match="mixes the rows of dimension 0 of input 'x' "
                                                 r"\(6, 4, 3\) but keeps those of "
                                                 "dimension 1 apart.*batch_dim=1"):
        _check(fn, X)


def test_a_batch_first_mask_beside_sequence_first_features_is_named_per_input() -> None:
    """A (batch, seq) padding mask beside (seq, batch, d) features: the fix names each
    input's batch dimension."""
    model = nn.Identity()

    def call(named: Mapping[str, Any]) -> Any:
        x, mask = named["x"], named["mask"]
        return x.cumsum(0) * mask.float().mean(1)[None, :, None]

    named = {"x": X, "mask": torch.rand(4, 6) > 0.5}
    with pytest.raises(PipelineInputError, match=r"batch_dim=\{'x': 1, 'mask': 0\}"):
        check_samples_apart(model, named, call)


def test_a_mask_that_breaks_the_halves_of_dimension_0_is_named_per_input() -> None:
    """The same layout where the (batch, seq) mask, left whole beside features cut along their
    sequence, makes the halves of dimension 0 raise: before, the check said nothing and
    training failed later on a shape error naming neither the layout nor batch_dim."""
    model = nn.Identity()

    def call(named: Mapping[str, Any]) -> Any:
        x, mask = named["x"], named["mask"]
        return x.cumsum(0) * mask.T.float()[:, :, None]

    named = {"x": X, "mask": torch.rand(4, 6) > 0.5}
    with pytest.raises(PipelineInputError, match=r"fails on the halves of dimension 0 of input "
                                                 r"'x' \(6, 4, 3\).*batch_dim=\{'x': 1, "
                                                 r"'mask': 0\}"):
        check_samples_apart(model, named, call)


def test_a_model_whose_halves_fail_either_way_is_left_alone() -> None:
    """A model fixed to the example's batch size fails on halves whichever way it is cut:
    nothing tells the layout, so training says what is wrong."""
    _check(lambda x: x.reshape(6, 4, 3) * 2, X)
