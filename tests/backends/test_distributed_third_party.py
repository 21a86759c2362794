"""Third-party models on two gloo processes: torch.nn's TransformerEncoder with a key padding
mask and a tied head, Hugging Face BART (an encoder-decoder given three inputs by name, its head
tied to the shared embedding) and timm's Swin (torch.roll, window reshapes), each compiled by
the planner into two stages and exported: the processes' losses equal one process's gradient
accumulation."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.worker import train_processes
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.third_party import POOL, repeated
from tests.helpers.transparency import momentum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BATCH, MICRO, STEPS = 4, 2, 2


@pytest.mark.parametrize("name", ["torch-transformer", "hf-bart", "timm-swin"])
def test_third_party_models_train_on_two_processes_as_in_one(name: str, tmp_path: Path) -> None:
    model, inputs, target, loss_fn = POOL[name](BATCH)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, stages=2, schedule="1f1b-flush",
                             microbatches=MICRO, cost="analytic")
    pipe.export(str(tmp_path / "pipe"))
    run = train_processes(tmp_path / "pipe", 2, functools.partial(repeated, name, BATCH, STEPS),
                          steps=STEPS, timeout=200)
    want, _ = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
