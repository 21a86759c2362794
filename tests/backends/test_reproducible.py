"""Runs are reproducible by default: every worker is seeded (the export's seed, or the one
given), so two identical runs are bit-equal; a resumed run reads its data from where it stopped
when the data can say where (state_dict / load_state_dict), and equals an uninterrupted run."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, BATCH = 8, 4


def noisy() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Minibatches drawn from the process's global generator (as many data loaders do)."""
    while True:
        yield torch.randn(BATCH, WIDTH), torch.randint(0, 3, (BATCH,))


class Resumable:
    """Minibatch i is a function of i alone; the source says where it is, and logs where each
    iteration starts (to `log`), so a test sees that a resumed run read nothing before."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.at = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with open(self.log, "a") as out:
            out.write(f"{self.at}\n")
        for i in itertools.count(self.at):
            self.at = i + 1
            gen = torch.Generator().manual_seed(i)
            yield torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,),
                                                                           generator=gen)

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = int(state["at"])


def resumable(log: str) -> Resumable:
    return Resumable(log)


def _export(folder: Path, schedule: str) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3), nn.ReLU(),
                          nn.Linear(WIDTH, 3))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(BATCH, WIDTH),),
                             example_target=torch.randint(0, 3, (BATCH,)),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    pipe.export(str(folder))
    return folder


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush"])
def test_two_identical_runs_are_bit_equal(tmp_path: Path, schedule: str) -> None:
    export = _export(tmp_path / "pipe", schedule)
    assert pdcompile.load(str(export)).seed == 0  # recorded in the export
    runs = [train_processes(export, 2, noisy, steps=10, timeout=120).losses for _ in range(2)]
    assert runs[0] == runs[1]  # bit-equal, dropout and data drawn from the seeded generators
    other = train_processes(export, 2, noisy, steps=10, timeout=120, seed=1).losses
    assert other != runs[0]


def test_a_resumed_run_continues_the_data_where_it_stopped(tmp_path: Path) -> None:
    export = _export(tmp_path / "pipe", "1f1b")
    whole = train_processes(export, 2, functools.partial(resumable, str(tmp_path / "a.log")),
                            steps=8, timeout=120, checkpoint_dir=tmp_path / "ck-a",
                            checkpoint_every=4)
    log = tmp_path / "b.log"
    data = functools.partial(resumable, str(log))
    first = train_processes(export, 2, data, steps=4, timeout=120,
                            checkpoint_dir=tmp_path / "ck-b", checkpoint_every=4)
    second = train_processes(export, 2, data, steps=8, timeout=120,
                             checkpoint_dir=tmp_path / "ck-b", checkpoint_every=4)
    assert second.resumed_from == 4 and second.losses[:4] == first.losses
    assert second.losses == whole.losses  # bit-equal to the uninterrupted run
    assert log.read_text().split() == ["0", "4"]  # the second read from minibatch 4 on
