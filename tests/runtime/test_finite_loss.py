"""A NaN or infinite loss stops a local run at once, naming its step, rank and stage;
`allow_nonfinite=True` keeps going."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PdcompileError
from pdcompile.runtime.finite_loss import NonFiniteLoss


def _pipe(schedule: str) -> object:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    return pdcompile.compile(model, example_inputs=(torch.randn(4, 6),),
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule=schedule, microbatches=2)


def _batches(count: int, bad: int, value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for index in range(count):
        x = torch.randn(4, 6, generator=gen)
        if index == bad:
            x[0, 0] = value
        out.append((x, torch.randint(0, 3, (4,), generator=gen)))
    return out


@settings(max_examples=6, deadline=None)
@given(schedule=st.sampled_from(["1f1b-flush", "gpipe", "1f1b"]), bad=st.integers(0, 3))
def test_a_non_finite_loss_stops_train_naming_step_rank_and_stage(schedule: str,
                                                                   bad: int) -> None:
    """A NaN in minibatch `bad`'s inputs: its loss is the first that is not finite."""
    pipe = _pipe(schedule)
    batches = _batches(4, bad, math.nan)
    with pytest.raises(NonFiniteLoss) as info:
        pipe.train([((x,), y) for x, y in batches])  # type: ignore[attr-defined]
    message = str(info.value)
    assert isinstance(info.value, PdcompileError) and "\n" not in message
    assert re.match(rf"step {bad}: the loss is nan on rank 1 \(stage 1, microbatch", message)
    assert "allow_nonfinite=True" in message
    kept = _pipe(schedule).train([((x,), y) for x, y in batches],  # type: ignore[attr-defined]
                                 allow_nonfinite=True)
    assert len(kept) == 4 and math.isnan(kept[bad])


def test_step_stops_on_an_infinite_loss() -> None:
    pipe = _pipe("1f1b-flush")

    def inf_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.sum() * math.inf

    pipe.loss_fn = inf_loss  # type: ignore[attr-defined]
    with pytest.raises(NonFiniteLoss, match=r"step 0: the loss is inf on rank 1 \(stage 1"):
        pipe.step(torch.randn(4, 6), target=torch.zeros(4, dtype=torch.long))  # type: ignore
