"""Constants built from sizes alone, with elements sharing memory (`arange(n).expand(b, n)`).

Tracing baked them into the graph with their strides; putting the graph's buffers back after
the shape pass failed with "more than one element of the written-to tensor refers to a single
memory location" under torch.fx (at compile) and in every loaded export (its stage graphs are
traced again), where the message blamed the target.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.passes.dense_constants import shares_memory_within
from tests.helpers.one_process import train_one_process

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class Positions(nn.Module):
    """Indices by `expand`, as many sequence models build their positions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(4.0)[None, :].expand(4, 4)  # every row one memory location
        h = torch.tanh(self.a(x) @ positions / 10)
        return self.out(self.b(h))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("stages", [1, [1, 1]])
def test_expanded_constants_train_like_one_process_also_exported(
        frontend: str, stages: object, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, y = Positions(), torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=SGD, microbatches=2, stages=stages, frontend=frontend)
    pipe.export(str(tmp_path / "p"))
    loaded = pdcompile.load(str(tmp_path / "p"))
    want, _ = train_one_process(model, SGD(model.parameters()), (x,), y, F.cross_entropy,
                                micro=2, steps=3)
    for trained in (pipe, loaded):
        got = [trained.step(x, target=y) for _ in range(3)]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())


def test_a_model_failing_on_a_minibatch_shaped_like_the_example_does_not_blame_the_target(
        tmp_path: Path) -> None:
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=SGD, stages=[1, 1])
    pipe.export(str(tmp_path / "p"))
    loaded = pdcompile.load(str(tmp_path / "p"))

    def fails(*args: object) -> None:
        raise RuntimeError("the stage's own complaint")

    loaded.parts.stages[0].module.forward = fails  # as a graph that cannot run would
    with pytest.raises(pdcompile.errors.PipelineInputError) as caught:
        loaded.step(x, target=y)
    message = str(caught.value)
    assert "the target is" not in message, message
    assert "inputs are shaped like the example's" in message, message
    assert "model cannot run on it" in message and "the stage's own complaint" in message


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       data=st.data())
def test_shares_memory_within_agrees_with_torch(sizes: list[int], data: st.DataObject) -> None:
    """Against torch's own check on views drawn by expand, transpose and slicing."""
    t = torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes)
    view = t
    if data.draw(st.booleans(), "expand a new dimension"):
        view = view.unsqueeze(0).expand(data.draw(st.integers(1, 3), "copies"), *sizes)
    if view.dim() > 1 and data.draw(st.booleans(), "transpose"):
        view = view.transpose(0, view.dim() - 1)
    step = data.draw(st.integers(1, 2), "step")
    view = view[..., ::step]
    overlap = torch._debug_has_internal_overlap(view)  # 0: none, 1: yes, 2: cannot tell
    if overlap != 2:
        assert shares_memory_within(view) == (overlap == 1)
