"""Checkpoints of run_distributed: a run stopped and started again from its checkpoints reaches
the same losses and weights as an uninterrupted one (asynchronous schedules, which drain at each
checkpoint), through the Python launcher `train_processes` on an exported pipeline."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.runtime.checkpoint import Checkpointer
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WIDTH, BATCH = 12, 8


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(n)]


def _export(folder: Path, schedule: str) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, 3))
    x, y = batches(1)[0]
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    pipe.export(str(folder))
    return folder


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resumed_run_equals_uninterrupted(tmp_path: Path, schedule: str) -> None:
    export = _export(tmp_path / "pipe", schedule)
    data = functools.partial(batches, 6)
    # uninterrupted, the stream drains at each checkpoint: Pipeline.train once per interval
    local = pdcompile.load(str(export))
    data_all = batches(6)
    want = [loss for k in range(0, 6, 2) for loss in local.train(data_all[k:k + 2])]

    seen: list[tuple[int, float]] = []
    first = train_processes(export, 2, data, steps=4, timeout=120, fault_timeout=5,
                            checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2,
                            progress=lambda step, loss: seen.append((step, loss)))
    assert first.resumed_from is None and first.steps == 4
    assert seen == list(enumerate(first.losses))  # relayed to this process, in order
    second = train_processes(export, 2, data, steps=6, timeout=120, fault_timeout=5,
                             checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.resumed_from == 4 and second.steps == 2 and second.losses[:4] == first.losses
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(want))
    for rank in (0, 1):
        saved = Checkpointer(tmp_path / "ckpt", rank=rank, every=2).load(6)
        assert saved["data_position"] == 6 and saved["losses"] == second.losses
        for key, value in local.stage_modules[rank].state_dict().items():
            torch.testing.assert_close(saved["model"][key], value)
