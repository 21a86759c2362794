"""An emulated slower rank on real processes: the same training, and the slowed rank's compute
recorded that many times longer (train_processes(slowdown=...), runtime/slowdown.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.timeline import stage_figures
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WIDTH, BATCH = 1024, 64  # actions of milliseconds, which a loaded machine does not drown


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(n)]


def test_a_slowed_rank_trains_alike_and_computes_longer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 3))
    x, y = batches(1)[0]
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy, schedule="1f1b-flush",
                             microbatches=2, stages=[1, 1])
    pipe.export(str(tmp_path / "pipe"))
    data = functools.partial(batches, 8)
    plain = train_processes(tmp_path / "pipe", 2, data, steps=8, timeout=120, record=True)
    slowed = train_processes(tmp_path / "pipe", 2, data, steps=8, timeout=120, record=True,
                             slowdown=[1, 4])
    assert slowed.losses == pytest.approx(plain.losses, rel=1e-6)
    assert plain.timeline is not None and slowed.timeline is not None
    before, after = stage_figures(plain.timeline), stage_figures(slowed.timeline)
    # stage 1 on rank 1: four times as long; stage 0 unchanged. Each run's stage 1 against its
    # own stage 0 (the two ranks compute side by side), so that a load on the machine that
    # comes or goes between the runs (the sleep stretches whatever the compute took) cancels
    def work(figures: dict[int, dict[str, float]], stage: int) -> float:
        return figures[stage]["fwd"] + figures[stage]["bwd"]

    slow = (work(after, 1) / work(after, 0)) / (work(before, 1) / work(before, 0))
    assert slow > 2.0, (f"stage 1 / stage 0 compute: {work(before, 1) / work(before, 0):.2f} "
                        f"at full speed, {work(after, 1) / work(after, 0):.2f} with rank 1 "
                        f"slowed 4x")
    with pytest.raises(PipelineInputError, match="3 factors for 2 ranks"):
        train_processes(tmp_path / "pipe", 2, data, steps=2, timeout=60, slowdown=[1, 2, 2])
