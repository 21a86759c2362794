"""run_distributed runs the interleaved and zero-bubble schedules and recomputing stages with the
local backend's losses and weights (and so those of plain gradient accumulation,
tests/pipeline/test_schedules_transparency.py).

Interleaved pipelines put 2 chunks on each of 2 processes (each process one generated loop
calling `rt.chunk(s)`), V-shaped ones (ZB-V, DualPipeV) 2 chunks in a V; zero-bubble ones defer
weight gradients to W on 2 and 3 processes; one case recomputes every stage. gloo over
127.0.0.1, one thread per process, bounded by timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.backends.launch import Worker, launch
from tests.helpers.small_pipes import assert_ranks_trained_alike, rank_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, BATCH, MICRO = 12, 8, 4


@dataclass(frozen=True)
class Case:
    """A schedule on `ranks` processes holding `chunks` stages each; `steps` minibatches."""

    schedule: str
    ranks: int
    chunks: int = 1
    steps: int = 2
    recompute: bool = False
    record: bool = False


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Dropout(0.1), nn.Linear(WIDTH, 3))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen),
             torch.randint(0, 3, (BATCH,), generator=gen)) for _ in range(steps)]


def _pipeline(case: Case) -> Any:
    from pdcompile.passes.split import even_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner.interleave import fold_v, interleave
    from pdcompile.schedule.kinds import kind

    model = _model()
    plan = even_plan(trace(model), case.ranks * case.chunks)
    if case.recompute:
        plan = replace(plan, stages=tuple(replace(s, recompute=True) for s in plan.stages))
    if kind(case.schedule).v_shape:
        plan = fold_v(plan)
    elif case.chunks > 1:
        plan = interleave(plan, case.ranks)
    example = _batches(1)[0]
    return pdcompile.compile(model, example_inputs=(example[0],), example_target=example[1],
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                             schedule=case.schedule, microbatches=MICRO, plan=plan)


def _train(worker: Worker, cases: list[Case]) -> list[dict[str, Any]]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out = []
    for case in cases:
        torch.manual_seed(7)  # the dropout masks: every process and the local run alike
        pipe = _pipeline(case)
        batches = iter(_batches(case.steps)) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, batches, monitor=worker.monitor, record=case.record)
        out.append({"losses": run.losses, "weights": rank_weights(pipe, worker.rank),
                    "timeline": run.timeline})
    return out


def _counting_train(worker: Worker, cases: list[Case]) -> list[dict[str, Any]]:
    """`_train`, also counting the point-to-point sends this rank starts, by destination."""
    from pdcompile.backends import distributed

    isend = distributed.dist.isend
    out = []
    for case in cases:
        sent: dict[int, int] = {}

        def counting(tensor: torch.Tensor, dst: int, *args: Any, sent: dict[int, int] = sent,
                     **kwargs: Any) -> Any:
            sent[dst] = sent.get(dst, 0) + 1
            return isend(tensor, dst, *args, **kwargs)

        distributed.dist.isend = counting  # type: ignore[assignment]
        try:
            out.append({**_train(worker, [case])[0], "sent": sent})
        finally:
            distributed.dist.isend = isend  # type: ignore[assignment]
    return out


def _check(cases: list[Case], nproc: int, train: Any = _train) -> list[list[dict[str, Any]]]:
    results = launch(train, nproc, args=(cases,), timeout=240)
    for index, case in enumerate(cases):
        torch.manual_seed(7)
        pipe = _pipeline(case)
        assert_ranks_trained_alike(results, index, pipe, pipe.train(_batches(case.steps)),
                                   case)
    return results


def test_two_processes_interleaved_and_zero_bubble() -> None:
    cases = [Case("interleaved-1f1b", 2, chunks=2, steps=1, record=True), Case("zb-h1", 2),
             Case("interleaved-zb", 2, chunks=2), Case("zb-h1", 2, recompute=True),
             Case("interleaved-1f1b", 2, chunks=3, recompute=True)]
    results = _check(cases, 2)
    timeline = results[0][0]["timeline"]  # rank 0 merges every rank's measured timeline
    timeline.check_schedule(_pipeline(cases[0]).schedule(MICRO, MICRO))


def test_two_processes_v_shaped() -> None:
    """ZB-V and DualPipeV: rank 0 holds the first and the last chunk (it reads the data and
    computes the loss), rank 1 the two middle ones, which hand over in memory."""
    cases = [Case("zb-v", 2, chunks=2, steps=1, record=True), Case("dualpipev", 2, chunks=2),
             Case("zb-v", 2, chunks=2, recompute=True)]
    results = _check(cases, 2)
    timeline = results[0][0]["timeline"]
    timeline.check_schedule(_pipeline(cases[0]).schedule(MICRO, MICRO))


def test_the_target_rides_to_the_last_stages_rank_in_the_first_activation_message() -> None:
    """Interleaved on 2 processes: rank 1 holds the last stage and reads no data, and rank 0
    sends it activations (stage 0's to stage 1, on rank 1): the target rides in that message,
    so each rank sends one message a microbatch per chunk boundary each way and nothing else
    (a message of its own for the target made rank 0's 4 a microbatch on 2 chunks, 6 on 3).
    Training is unchanged."""
    cases = [Case("interleaved-1f1b", 2, chunks=2), Case("interleaved-zb", 2, chunks=2),
             Case("interleaved-1f1b", 2, chunks=3)]
    results = _check(cases, 2, train=_counting_train)
    for index, case in enumerate(cases):
        crossings = 2 * case.chunks - 1  # boundaries between the 2 x chunks stages
        for rank in (0, 1):
            assert results[rank][index]["sent"] == {1 - rank: crossings * MICRO * case.steps}, \
                (case, rank)


def test_three_processes_zero_bubble() -> None:
    _check([Case("zb-h1", 3, steps=3), Case("interleaved-zb", 3, chunks=2),
            Case("zb-v", 3, chunks=2)], 3)
