"""compile(batch_dim=1) on gloo processes: a sequence-first `nn.TransformerEncoder` language
model and `nn.LSTM`, fed (seq, batch, ...), exported and trained by two processes (two stages;
one stage replicated over both), cut along the batch dimension 1 into microbatches and the
replicas' shares; losses equal one process's gradient accumulation (flush) and the
local backend (asynchronous 1F1B). Before, the export had no batch dimension to keep and every
rank cut the sequence. tests/pipeline/test_batch_dim.py covers the local backend."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.worker import train_processes
from tests.helpers.seq_first_models import MODELS, fresh, minibatches, one_process, sgd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BATCH, STEPS, MICRO = 8, 3, 2  # pieces of equal size: one process cuts them alike


def _pipeline(name: str, layout: str, schedule: str) -> pdcompile.pipeline.Pipeline:
    model = fresh(name)
    if layout == "two stages":
        plan = manual_plan(trace(model), lambda n: 1 if n.name.startswith(("head", "out"))
                           else 0)
    else:
        plan = manual_plan(trace(model), lambda n: 0, replicas=[2])
    (x, y), = minibatches(name, BATCH, 1)
    return pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=MODELS[name][1], optimizer=sgd, schedule=schedule,
                             microbatches=MICRO if schedule != "1f1b" else None, plan=plan,
                             batch_dim=1)


@pytest.mark.parametrize(("name", "layout", "schedule"), [
    ("transformer", "two stages", "1f1b-flush"),
    ("transformer", "replicated", "1f1b-flush"),
    ("lstm", "replicated", "1f1b"),
])
def test_sequence_first_models_train_on_processes_as_in_one(
        tmp_path: Path, name: str, layout: str, schedule: str) -> None:
    pipe = _pipeline(name, layout, schedule)
    pipe.export(str(tmp_path / "pipe"))
    data = functools.partial(minibatches, name, BATCH, STEPS)
    run = train_processes(tmp_path / "pipe", 2, data, steps=STEPS, timeout=200)
    assert run.samples == BATCH * STEPS  # counted along dimension 1, not the sequence
    if schedule == "1f1b":  # asynchronous: as the local backend runs it
        want = pipe.train(minibatches(name, BATCH, STEPS))
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
        return
    parts = MICRO * (2 if layout == "replicated" else 1)
    want, _ = one_process(name, minibatches(name, BATCH, STEPS), parts)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
