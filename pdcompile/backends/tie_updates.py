"""The updates at which ranks all-reduce tied gradients, for the simulator.

The runtime sums the gradients of parameters that stages on several ranks share at the update,
before the optimizer steps (runtime/stage_runtime.py; cost/ties.py prices it): a rank joins the
all-reduce of update k at its first `STEP k` (a rank holding several chunks reduces every tie
of the rank there, runtime/chunks.py), and the all-reduce starts when every rank sharing a tie
with it has reached its own. Here: those STEP actions (`tie_steps`), and the dependency lists
with each of them waiting for the action before its partners' (`with_tie_waits`), as
schedule/deps.py makes the replicas of a stage wait for each other at ALLREDUCE k.
"""

from __future__ import annotations

from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import tie_partners
from pdcompile.errors import ScheduleError
from pdcompile.schedule.deps import Ref
from pdcompile.schedule.ir import Kind, Schedule


def tie_steps(schedule: Schedule, costs: StageCosts) -> dict[int, dict[int, int]]:
    """Per rank that all-reduces tied gradients with another rank: update index -> the
    position of its first STEP of that index (where it joins the all-reduce)."""
    partners = tie_partners(costs.ties, schedule.stage_ranks)
    out: dict[int, dict[int, int]] = {}
    for rank in partners:
        firsts: dict[int, int] = {}
        for index, action in enumerate(schedule.actions.get(rank, ())):
            if action.kind == Kind.STEP:
                firsts.setdefault(action.microbatch, index)
        out[rank] = firsts
    return out


def with_tie_waits(schedule: Schedule, costs: StageCosts,
                   deps: dict[int, list[tuple[Ref, ...]]]) -> dict[int, list[tuple[Ref, ...]]]:
    """`deps` (schedule/deps.py `dependency_lists`) with each rank's first STEP k also waiting
    for the action before the first STEP k of every rank it shares a tie with; `deps` itself
    where no tie crosses ranks. ScheduleError where two such ranks update a different number
    of times ('1f1b' with unequal replicas of the sharing stages, which the runtime refuses)."""
    partners = tie_partners(costs.ties, schedule.stage_ranks)
    if not partners:
        return deps
    steps = tie_steps(schedule, costs)
    for rank, others in sorted(partners.items()):
        for other in sorted(others):
            if set(steps[rank]) != set(steps[other]):
                stages = [t.stages for t in costs.ties
                          if {rank, other} <= set(t.ranks(schedule.stage_ranks))]
                raise ScheduleError(
                    f"schedule {schedule.name!r}: ranks {rank} and {other} share tied "
                    f"parameters (stages {stages[0]}) but update {len(steps[rank])} and "
                    f"{len(steps[other])} times, so the all-reduce of update k has no partner; "
                    "give the stages sharing a tie equal replicas or use a flush schedule")
    out = {rank: list(lists) for rank, lists in deps.items()}
    for rank, firsts in steps.items():
        for update, index in firsts.items():
            waits = list(out[rank][index])
            for other in sorted(partners[rank]):
                at = steps.get(other, {}).get(update)
                if at is not None and at > 0:
                    waits.append((other, at - 1))
            out[rank][index] = tuple(waits)
    return out


__all__ = ["tie_steps", "with_tie_waits"]
