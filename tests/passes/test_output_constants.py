"""A model whose output holds None (or another literal) beside its tensors trains as a pipeline.

`{"logits": x, "aux": None}`, `(out, None)` (what `nn.MultiheadAttention(need_weights=False)`
returns) and tuples with a flag in them train in one process, the loss function ignoring the
constant; compile refused them ("output None is neither an input nor computed by a stage"). Now
the last stage returns each constant (passes/output_constants.py): the loss function, `evaluate`
and an exported pipeline receive the model's own structure, constants included.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

import pdcompile
from tests.helpers.processes import run_export_losses
from tests.helpers.schedule_cuts import flush_reference

STEPS, BATCH, MICRO = 2, 8, 2
TENSOR = "tensor"  # where a shape puts one of the model's tensors

_leaves = st.sampled_from([TENSOR, TENSOR, None, 3, "aux", 0.5, True])
shapes = st.recursive(_leaves, lambda inner: st.lists(inner, min_size=1, max_size=3).map(tuple)
                      | st.lists(inner, min_size=1, max_size=3)
                      | st.dictionaries(st.sampled_from(["logits", "aux", "mask"]), inner,
                                        min_size=1),
                      max_leaves=5).filter(lambda shape: TENSOR in pytree.tree_leaves(shape))


class Shaped(nn.Module):
    """Three layers whose output has the structure `shape`: its i-th tensor is the hidden value
    times i + 1, the other leaves are themselves."""

    def __init__(self, shape: Any) -> None:
        super().__init__()
        self.shape = shape
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        leaves, spec = pytree.tree_flatten(self.shape)
        made, count = [], 0
        for leaf in leaves:
            if leaf == TENSOR and isinstance(leaf, str):
                count += 1
                made.append(h * count)
            else:
                made.append(leaf)
        return pytree.tree_unflatten(made, spec)


def _loss_of(shape: Any) -> Any:
    """The loss over the output's tensors, which first checks that the output has the model's
    structure and constants (a wrong one would train on other values, or none)."""
    want_leaves, want_spec = pytree.tree_flatten(shape)

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        leaves, spec = pytree.tree_flatten(output)
        assert spec == want_spec, (spec, want_spec)
        tensors = []
        for got, want in zip(leaves, want_leaves, strict=True):
            if isinstance(got, torch.Tensor):
                assert want == TENSOR, (got, want)
                tensors.append(got)
            else:
                assert got == want and type(got) is type(want), (got, want)
        return sum(nn.functional.mse_loss(t, target) for t in tensors)  # type: ignore[return-value]
    return loss_fn


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _data() -> tuple[tuple[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(BATCH, 6, dtype=torch.float64),), torch.randn(BATCH, 3,
                                                                       dtype=torch.float64)


def _compile(model: nn.Module, shape: Any, **options: Any) -> pdcompile.Pipeline:
    inputs, target = _data()
    return pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, example_target=target,
                             loss_fn=_loss_of(shape), optimizer=_sgd, cost="analytic",
                             microbatches=MICRO, **options)


@settings(max_examples=12, deadline=None)
@given(shape=shapes, stages=st.integers(2, 3))
def test_an_output_with_constant_leaves_trains_and_evaluates_like_one_process(
        shape: Any, stages: int) -> None:
    torch.manual_seed(1)
    model = Shaped(shape).double()
    inputs, target = _data()
    pipe = _compile(model, shape, stages=stages, schedule="1f1b-flush")
    want, state = flush_reference(model, inputs, target, _loss_of(shape), MICRO, STEPS, _sgd)
    got = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64))
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, state[name])
    model.load_state_dict(state)
    with torch.no_grad():
        expected = model.eval()(*inputs)
    evaluated = pipe.evaluate(*inputs)
    assert pytree.tree_structure(evaluated) == pytree.tree_structure(expected)
    for got_leaf, want_leaf in zip(pytree.tree_leaves(evaluated), pytree.tree_leaves(expected),
                                   strict=True):
        if isinstance(want_leaf, torch.Tensor):
            torch.testing.assert_close(got_leaf, want_leaf)
        else:
            assert got_leaf == want_leaf and type(got_leaf) is type(want_leaf)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "interleaved-1f1b", "zb-v", "gpipe",
                                      "zb-h1"])
@settings(max_examples=3, deadline=None)
@given(shape=shapes)
def test_constant_leaves_change_nothing_a_schedule_trains(shape: Any, schedule: str) -> None:
    """Under every kind of schedule (asynchronous, interleaved, V-shaped) the structured model
    trains exactly as the same layers returning their tensors alone."""
    torch.manual_seed(1)
    model = Shaped(shape).double()
    plain_shape = tuple(leaf for leaf in pytree.tree_leaves(shape) if leaf == TENSOR
                        and isinstance(leaf, str))
    plain = Shaped(plain_shape).double()
    plain.load_state_dict(model.state_dict())
    inputs, target = _data()
    pipes = [_compile(m, s, stages=2, schedule=schedule)
             for m, s in ((model, shape), (plain, plain_shape))]
    losses = [[p.step(*inputs, target=target) for _ in range(STEPS + 1)] for p in pipes]
    assert losses[0] == losses[1]
    for name, value in pipes[1].state_dict().items():
        torch.testing.assert_close(pipes[0].state_dict()[name], value)


class Attention(nn.Module):
    """Returns what `nn.MultiheadAttention(need_weights=False)` returns: (output, None)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        h = torch.tanh(self.inp(x))
        return self.attn(h, h, h, need_weights=False)


def first_mse(output: tuple[torch.Tensor, None], target: torch.Tensor) -> torch.Tensor:
    """The loss of `Attention`: reads out[0], and checks that out[1] is the None it returned."""
    assert output[1] is None, output[1]
    return nn.functional.mse_loss(output[0], target)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_exported_attention_returning_none_loads_and_runs_like_one_process(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Attention()
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 8)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), example_target=y,
                             loss_fn=first_mse, optimizer=_sgd, stages=2, cost="analytic",
                             schedule="1f1b-flush", microbatches=MICRO)
    want, _ = flush_reference(model, (x,), y, first_mse, MICRO, STEPS, _sgd)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=first_mse)
    out, weights = loaded.evaluate(x)
    assert weights is None and out.shape == (4, 5, 8)
    got = [loaded.step(x, target=y) for _ in range(STEPS)]
    assert got == pytest.approx(want, rel=1e-5)
    assert run_export_losses(tmp_path / "pipe", nproc=2, steps=STEPS) == pytest.approx(want,
                                                                                      rel=1e-5)
