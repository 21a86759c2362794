"""run_distributed on random cuts of random models under the schedules with chunks.

Each case: a random model drawn from a seed (tests/helpers/schedule_cuts.seeded_random_net:
skips, LSTMs, in-place changes, views, shared and frozen layers, in float64), a random valid cut
of it placed as the schedule places chunks (interleaved 1F1B and zero bubble: 2-3 chunks per
rank on a random permutation of the ranks; ZB-V and DualPipeV: a V), two minibatches. Every
process's losses and the weights it holds equal the local backend's, which the fast lane's
tests/pipeline/test_schedule_cuts.py holds to single-process training. gloo over 127.0.0.1, one
thread per process, bounded by timeouts.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

import pdcompile
from pdcompile.backends.launch import Worker, launch
from tests.helpers.random_models import squared_error
from tests.helpers.schedule_cuts import (
    cut_graph,
    fits,
    micro_options,
    placed_cut,
    seeded_random_net,
)
from tests.helpers.small_pipes import assert_ranks_trained_alike, rank_weights
from tests.helpers.transparency import crossed_ties, crossed_ties_plan, momentum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BATCH, STEPS = 12, 2
CHUNKED = ("interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipev")

Case = tuple[int, str, int]  # (model seed, schedule, cut seed)


def _trains(seed: int) -> bool:
    """Whether autograd accepts the drawn model at all (an in-place change of a value its
    backward needs is refused by PyTorch itself, pipelined or not)."""
    model, inputs, target = seeded_random_net(seed, BATCH)
    try:
        squared_error(model(*inputs), target).backward()
    except RuntimeError as err:
        if "modified by an inplace operation" in str(err):
            return False
        raise
    return True


def _pipeline(case: Case, ranks: int) -> tuple[Any, list[tuple[Any, torch.Tensor]]]:
    seed, schedule, cut_seed = case
    model, inputs, target = seeded_random_net(seed, BATCH)
    rng = random.Random(cut_seed)
    plan = placed_cut(cut_graph(model, inputs), rng, schedule, ranks=ranks)
    micro = rng.choice(micro_options(schedule, plan, BATCH))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=squared_error,
                             optimizer=momentum, schedule=schedule, microbatches=micro,
                             plan=plan, example_target=target)
    batches = [(inputs, target * (step + 1)) for step in range(STEPS)]
    return pipe, batches


def _train(worker: Worker, cases: list[Case]) -> list[dict[str, Any]]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out = []
    for case in cases:
        pipe, batches = _pipeline(case, worker.world_size)
        data = iter(batches) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, data, monitor=worker.monitor)
        out.append({"losses": run.losses, "weights": rank_weights(pipe, worker.rank)})
    return out


def _cases(ranks: int, count: int, first_seed: int) -> list[Case]:
    """`count` cases on `ranks` ranks: models autograd trains, cuts with enough operations for
    the chunks."""
    cases: list[Case] = []
    seed = first_seed
    while len(cases) < count:
        seed += 1
        schedule = CHUNKED[len(cases) % len(CHUNKED)]  # each in turn
        if not _trains(seed):
            continue
        model, inputs, _ = seeded_random_net(seed, BATCH)
        plan = placed_cut(cut_graph(model, inputs), random.Random(seed), schedule, ranks=ranks)
        if fits(plan, schedule) and micro_options(schedule, plan, BATCH):
            cases.append((seed, schedule, seed))
    return cases


@pytest.mark.parametrize(("ranks", "count", "first_seed"), [(2, 8, 0), (3, 4, 1000)])
def test_random_cuts_run_distributed_as_locally(ranks: int, count: int, first_seed: int
                                                ) -> None:
    cases = _cases(ranks, count, first_seed)
    assert {schedule for _, schedule, _ in cases} == set(CHUNKED)
    results = launch(_train, ranks, args=(cases,), timeout=540)
    for index, case in enumerate(cases):
        pipe, batches = _pipeline(case, ranks)
        assert_ranks_trained_alike(results, index, pipe, pipe.train(batches), case)


def _crossed(schedule: str) -> Any:
    model, x, y = crossed_ties()
    return pdcompile.compile(model, example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss,
                             optimizer=momentum, schedule=schedule, microbatches=2,
                             plan=crossed_ties_plan(model), example_target=y), [(x, y)] * STEPS


def _train_crossed(worker: Worker, schedules: list[str]) -> list[dict[str, Any]]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out = []
    for schedule in schedules:
        pipe, batches = _crossed(schedule)
        data = iter(batches) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, data, monitor=worker.monitor)
        out.append({"losses": run.losses, "weights": rank_weights(pipe, worker.rank)})
    return out


def test_ties_over_the_same_ranks_reduce_in_one_order_on_gloo() -> None:
    """Two ties over the same two processes in crossed chunk order
    (tests/pipeline/test_schedules_transparency.py): gloo paired one tie's all-reduce with the
    other's, as the local transport did."""
    schedules = ["interleaved-1f1b", "interleaved-zb"]
    results = launch(_train_crossed, 2, args=(schedules,), timeout=240)
    for index, schedule in enumerate(schedules):
        pipe, batches = _crossed(schedule)
        want = pipe.train(batches)
        weights = {**results[0][index]["weights"], **results[1][index]["weights"]}
        for rank in (0, 1):
            torch.testing.assert_close(torch.tensor(results[rank][index]["losses"]),
                                       torch.tensor(want))
        for name, value in pipe.named_parameters().items():
            torch.testing.assert_close(weights[name], value.detach(), msg=name)
