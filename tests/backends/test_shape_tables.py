"""A distributed run over a stream whose minibatches keep changing shape (another sequence
length, another batch size) keeps a bounded number of message tables on every rank
(backends/distributed_announce.py, SHAPE_TABLES_KEPT), and forgetting them changes nothing:
a shape seen again after its table was forgotten is announced anew, and the losses are those of
the local backend. Every rank once kept one table per shape ever seen."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.backends.launch import Worker, launch

FEATURES = 4
KEPT = 3  # tables kept beyond a run's own, small so that shapes are forgotten and seen again


class Tokens(nn.Module):
    """Per-position layers over (batch, length, features): any batch size and length runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def _shapes(seed: int, count: int) -> list[tuple[int, int]]:
    """(batch size, length) of each minibatch: 4-7 samples of 1-12 positions, drawn so that
    some shapes come back after many others."""
    rng = random.Random(seed)
    return [(rng.randint(4, 7), rng.randint(1, 12)) for _ in range(count)]


def _stream(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for seed, (batch, length) in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed)
        out.append((torch.randn(batch, length, FEATURES, generator=gen),
                    torch.randint(0, 3, (batch, length), generator=gen)))
    return out


def _pipeline(schedule: str) -> Any:
    torch.manual_seed(0)
    x, y = _stream([(4, 5)])[0]
    return pdcompile.compile(Tokens(), example_inputs=(x,), example_target=y, loss_fn=loss_fn,
                             schedule=schedule, stages=[1, 1],
                             microbatches=2 if schedule != "1f1b" else None,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05))


# schedule, seed of the shapes, minibatches, checkpoint interval (which cuts an asynchronous
# stream into runs, so that tables are forgotten between them too)
CASES = [("1f1b-flush", 0, 60, None), ("1f1b", 1, 40, 5)]


def _microbatch_shapes(shapes: list[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(len(part), length) for batch, length in shapes
            for part in torch.tensor_split(torch.arange(batch), 2)}


def _train(worker: Worker, folder: str) -> list[tuple[list[float], int]]:
    torch.set_num_threads(1)
    from pdcompile.backends import distributed_announce
    from pdcompile.backends.distributed import reads_data, run_distributed

    distributed_announce.SHAPE_TABLES_KEPT = KEPT
    most = [0]
    plain_next = distributed_announce.Announcements.next

    def counted(self: Any, index: int, first: bool = False) -> Any:
        out = plain_next(self, index, first)
        most[0] = max(most[0], len(self.tables))
        return out

    distributed_announce.Announcements.next = counted  # type: ignore[method-assign]
    out = []
    for schedule, seed, count, every in CASES:
        most[0] = 0
        pipe = _pipeline(schedule)
        data = _stream(_shapes(seed, count)) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, data, monitor=worker.monitor, checkpoint_every=every,
                              checkpoint_dir=f"{folder}/{schedule}" if every else None)
        out.append((run.losses, most[0]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stream_of_ever_new_shapes_keeps_few_tables_and_trains_as_locally(
        tmp_path: Path) -> None:
    from pdcompile.backends.distributed_announce import ANNOUNCE_AHEAD

    results = launch(_train, 2, args=(str(tmp_path),), timeout=200)
    for (schedule, seed, count, every), *per_rank in zip(CASES, *results, strict=True):
        stream = _stream(_shapes(seed, count))
        local = _pipeline(schedule)
        step = every or count  # the local backend drains where the checkpoints do
        want = [loss for at in range(0, count, step) for loss in local.train(stream[at:at + step])]
        for losses, most in per_rank:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want),
                                       msg=lambda m, s=schedule: f"{s}: {m}")
            if schedule == "1f1b-flush":  # a run per minibatch, ANNOUNCE_AHEAD announced at once
                bound = KEPT + 2 * ANNOUNCE_AHEAD
                assert bound < len(_microbatch_shapes(_shapes(seed, count)))
                assert most <= bound, (schedule, most)
