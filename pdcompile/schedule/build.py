"""`build`: the one way to make a lowered, validated schedule for a plan's stages.

The pipeline (its generated loops), the simulator, the planner's candidates, the command line and
the demo all call this, so a schedule is generated, lowered and validated one way, with the
same options: warm-up depths where the kind lets them be chosen, vertical sync, recomputation,
the stages' edges. How many microbatches a run has is the kind's rule
(`ScheduleKind.run_length`, with `stream_length` rounding a stream of whole minibatches to
whole rounds of the replicas).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.errors import ScheduleError
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Schedule
from pdcompile.schedule.kinds import kind, stream_length
from pdcompile.schedule.lower import lower
from pdcompile.schedule.validate import validate


def build(name: str, stage_ranks: Sequence[Sequence[int]], microbatches: int, *,
          per_minibatch: int = 1, stage_edges: Sequence[tuple[int, int]] | None = None,
          warmup: Sequence[int] | None = None, vertical_sync: bool = False,
          recompute: Sequence[int] = (),
          shares: Sequence[Sequence[int]] | None = None, progress: bool = True) -> Schedule:
    """The lowered and validated schedule `name` for stages on `stage_ranks`.

    `microbatches`: the run's microbatches as the generator counts them (`ScheduleKind.
    run_length`: '1f1b' a stream of that many minibatches, '2bw' a stream of minibatches of
    `per_minibatch` microbatches, flush schedules one minibatch). `warmup`: forwards before the
    first backward per stage (default PipeDream's NOAM - 1; ignored by kinds that fix their
    own); `stage_edges`: (src, dst) stage pairs that exchange tensors (default: the chain);
    `recompute`: the stages that recompute their activations in the backward; `shares`: per
    stage, the microbatches each replica takes per round (`schedule.shares`; default round
    robin). `progress=False`: the deadlock run of `validate` is left to the caller, which works
    out an execution order next (`validate`)."""
    row = kind(name)
    if microbatches < 1 or per_minibatch < 1:
        raise ScheduleError(f"a run needs at least one minibatch of at least one microbatch "
                            f"(got microbatches={microbatches}, per_minibatch={per_minibatch})")
    per = per_minibatch if row.microbatched_stream else None  # the others fix their own
    compute = generate(name, stage_ranks, microbatches, microbatches_per_minibatch=per,
                       vertical_sync=vertical_sync,
                       warmup=list(warmup) if warmup is not None and row.chosen_warmup else None,
                       recompute=list(recompute), shares=shares)
    lowered = lower(compute, stage_edges)
    validate(lowered, progress=progress)
    return lowered


__all__ = ["build", "stream_length"]
