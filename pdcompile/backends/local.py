"""The local backend: every rank's generated loop in one process, in a fixed interleaving.

The reference semantics of a pipeline. Ranks take turns in rank order; each runs until its
generated `run_rank(rt)` yields (it waits for a message or a collective), then the next rank runs.
Messages go through in-memory mailboxes (runtime/local_transport.py). A round in which no rank
finishes an action is a deadlock and raises ScheduleError naming what each rank waits for.
`run_program` is the driver `Pipeline.step` and `Pipeline.train` call: one run of a RunProgram
(backends/program.py), every rank's runtime over in-memory mailboxes.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.backends.program import MicrobatchData, RunProgram
from pdcompile.errors import ScheduleError
from pdcompile.runtime.chunks import ChunkRuntimes
from pdcompile.runtime.finite_loss import LossGuard, guard_runtime
from pdcompile.runtime.local_transport import LocalTransport, Mailboxes
from pdcompile.runtime.rank_function import RankFn
from pdcompile.runtime.stage_runtime import StageRuntime
from pdcompile.timeline import Recorder, Timeline


def run_local(functions: Mapping[int, RankFn], runtimes: Mapping[int, Any]) -> None:
    """Run `functions[r](runtimes[r])` for all ranks to completion, interleaved deterministically.

    A runtime exposes `completed` (actions finished so far), which is how progress is seen.
    """
    running: dict[int, Generator[Any, None, None]] = {
        rank: functions[rank](runtimes[rank]) for rank in sorted(functions)}
    waiting_on: dict[int, Any] = {}
    while running:
        progressed = False
        for rank in list(running):
            before = runtimes[rank].completed
            try:
                waiting_on[rank] = next(running[rank])
            except StopIteration:
                del running[rank]
                waiting_on.pop(rank, None)
                progressed = True
                continue
            if runtimes[rank].completed != before:
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {rank} after {runtimes[rank].completed} actions waits for "
                              f"{waiting_on.get(rank)!r}" for rank in running)
            raise ScheduleError(f"the pipeline cannot make progress (deadlock): {stuck}")


@dataclass
class LocalRun:
    """What one run on the local backend leaves: the last stage's microbatch losses, every
    rank's runtime (for inspection), and the measured timeline when recorded."""

    losses: dict[int, torch.Tensor]
    runtimes: dict[int, StageRuntime | ChunkRuntimes]
    timeline: Timeline | None = None


def run_program(program: RunProgram, data: MicrobatchData, microbatches: int,
                per_minibatch: int, *, record: bool = False, first_step: int = 0,
                allow_nonfinite: bool = False,
                slowdown: Sequence[float] | str | None = None) -> LocalRun:
    """All ranks' generated loops over a run of `microbatches` on the local backend.

    Each rank gets its runtime over the in-memory mailboxes; a message sent but never received
    is a schedule error. `record`: time every action into a merged, measured timeline.
    A NaN or infinite loss stops the run naming its step (the run's first minibatch is
    `first_step`), rank and stage, unless `allow_nonfinite` (runtime/finite_loss.py).
    `slowdown`: per rank, the factor its compute is stretched by, an emulated slower device
    (runtime/slowdown.py; default: the program's own, none).
    """
    if slowdown is not None:
        program = program.with_slowdowns(slowdown)
    config = program.run_config(per_minibatch)
    boxes = Mailboxes()
    ranks = program.all_ranks
    recorders = {r: Recorder(r) for r in ranks} if record else {}
    runtimes = {r: program.runtime(r, config=config, transport=LocalTransport(r, boxes),
                                   data=data, recorder=recorders.get(r)) for r in ranks}
    guard = None if allow_nonfinite else LossGuard(first_step, per_minibatch)
    for rt in runtimes.values():
        guard_runtime(rt, guard)
    run_local(program.rank_functions(microbatches, per_minibatch), runtimes)
    for rt in runtimes.values():
        rt.finish()
    left = boxes.pending()
    if left:
        raise ScheduleError(f"the schedule sent messages nobody received: {left[:4]}")
    timeline = None
    if recorders:
        timeline = Timeline.merge([rec.timeline() for rec in recorders.values()],
                                  source="measured")
        timeline.meta.update(schedule=program.schedule_name,
                             microbatches_per_minibatch=per_minibatch, backend="local")
    losses: dict[int, torch.Tensor] = {}
    for stage_rank in program.plan.stages[-1].ranks:
        losses.update(runtimes[stage_rank].losses)
    return LocalRun(losses, runtimes, timeline)


__all__ = ["LocalRun", "run_local", "run_program"]
