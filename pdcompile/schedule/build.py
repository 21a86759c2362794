"""`build`: the one way to make a lowered, validated schedule for a plan's stages.

The pipeline (its generated loops), the simulator, the planner's candidates, the command line and
the demo all call this, so they agree on a run's length and shape: for streaming schedules a
run of `minibatches` minibatches (rounded up so every replica gets whole rounds), for flush
schedules one minibatch of `microbatches`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdcompile.errors import ScheduleError
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Schedule
from pdcompile.schedule.kinds import kind
from pdcompile.schedule.lower import lower
from pdcompile.schedule.validate import validate


def stream_length(replicas: Sequence[int], minibatches: int) -> int:
    """`minibatches` rounded up to a multiple of every replica count (each replica of a stage
    takes one minibatch per round)."""
    step = math.lcm(*replicas)
    return max(step, math.ceil(minibatches / step) * step)


def build(name: str, stage_ranks: Sequence[Sequence[int]], *, microbatches: int,
          minibatches: int = 1, stage_edges: Sequence[tuple[int, int]] | None = None,
          warmup: Sequence[int] | None = None, vertical_sync: bool = False,
          recompute: Sequence[int] = ()) -> Schedule:
    """The lowered and validated schedule `name` for stages on `stage_ranks`.

    '1f1b': a stream of `minibatches` minibatches (rounded up, `stream_length`); '2bw': a stream
    of `minibatches` minibatches of `microbatches` microbatches; '1f1b-flush', 'gpipe': one
    minibatch of `microbatches`. `warmup`: forwards before the first backward per stage (default
    PipeDream's NOAM - 1); `stage_edges`: (src, dst) stage pairs that exchange tensors (default:
    the chain); `recompute`: the stages that recompute their activations in the backward."""
    row = kind(name)
    if microbatches < 1 or minibatches < 1:
        raise ScheduleError(f"a run needs at least one minibatch of at least one microbatch "
                            f"(got minibatches={minibatches}, microbatches={microbatches})")
    replicas = [len(r) for r in stage_ranks]
    extra: dict[str, object] = {}
    if vertical_sync:
        extra["vertical_sync"] = True
    if warmup is not None and row.chosen_warmup:
        extra["warmup"] = list(warmup)
    if recompute:
        extra["recompute"] = list(recompute)
    if row.flush:
        compute = generate(name, stage_ranks, microbatches, **extra)  # type: ignore[arg-type]
    elif row.microbatched:  # 2bw: minibatches of `microbatches` each
        compute = generate(name, stage_ranks, microbatches * minibatches,
                           microbatches_per_minibatch=microbatches,
                           **extra)  # type: ignore[arg-type]
    else:
        compute = generate(name, stage_ranks, stream_length(replicas, minibatches),
                           **extra)  # type: ignore[arg-type]
    lowered = lower(compute, stage_edges)
    validate(lowered)
    return lowered


__all__ = ["build", "stream_length"]
