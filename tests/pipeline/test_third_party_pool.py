"""Every model of the third-party pool (tests/helpers/third_party.py: torchvision, timm, Hugging
Face transformers, torch.nn) compiled by the planner into two stages trains as one process does
(losses and every weight and buffer after two updates of gradient accumulation), and its export,
loaded back, goes on training as the pipeline it was written from does.
tests/pipeline/test_schedule_cuts.py draws random cuts of the same pool under every schedule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import pdcompile
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.third_party import POOL
from tests.helpers.transparency import momentum

BATCH, MICRO, STEPS = 4, 2, 2
FAST = {"torch-transformer"}  # a second or two; the others take 3-30 s each


def _given(inputs: Any) -> tuple[Any, ...]:
    return (inputs,) if isinstance(inputs, dict) else tuple(inputs)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in POOL])
def test_two_planned_stages_train_like_one_process_and_export(name: str,
                                                              tmp_path: Path) -> None:
    model, inputs, target, loss_fn = POOL[name](BATCH)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, stages=2, schedule="1f1b-flush",
                             microbatches=MICRO, cost="analytic")
    losses = [pipe.step(*_given(inputs), target=target) for _ in range(STEPS)]
    want, state = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum)
    assert losses == pytest.approx(want, rel=1e-9)
    got = pipe.state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, msg=key)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=loss_fn, optimizer=momentum)
    for key, value in got.items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)
    assert loaded.step(*_given(inputs), target=target) == \
        pytest.approx(pipe.step(*_given(inputs), target=target), rel=1e-12)
