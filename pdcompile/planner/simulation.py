"""Simulate a plan: its stage costs, its schedule (`schedule.build`) and the simulator, in one call.

Used by the planner (to choose among its best candidates), `refine_plan`, `pdcompile simulate`,
the demo and the benchmarks, so that all of them simulate a plan the same way: the plan's own
schedule, microbatches and warm-up depths unless told otherwise, and for streaming schedules a
stream long enough for the steady state (`steady_minibatches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from pdcompile.backends.simulate import SimResult, simulate
from pdcompile.cost.costgraph import topological_order
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner.search_cache import SearchCache
from pdcompile.schedule.build import build, stream_length
from pdcompile.schedule.ir import Schedule
from pdcompile.schedule.kinds import kind

DEFAULT_MICROBATCHES = 8


STEADY_TOLERANCE = 0.02  # a stream's time per minibatch moved less than this: steady
STEADY_LONGEST = 4  # the longest stream, in multiples of steady_minibatches


def steady_minibatches(plan: Plan, minimum: int = 64) -> int:
    """A stream long enough to measure a streaming schedule's steady state: at least `minimum`
    minibatches, 8 rounds of every replica count and 4 per stage (warm-up and drain are cut
    off by the timeline's steady window, the middle half of the completions; where that is not
    yet the steady state, `simulate_steady` runs longer streams)."""
    replicas = [s.round_size for s in plan.stages]
    return stream_length(replicas, max(minimum, 8 * math.lcm(*replicas), 4 * len(replicas)))


def simulate_plan(graph: nx.DiGraph, plan: Plan, cluster: Cluster, *,
                  schedule: str | None = None, microbatches: int | None = None,
                  minibatches: int | None = None, warmup: str | Sequence[int] = "plan",
                  timeline: bool = True, costs: StageCosts | None = None,
                  cache: SearchCache | None = None) -> tuple[Schedule, SimResult]:
    """Simulate `plan` of `graph` on `cluster`.

    `schedule` / `microbatches`: default the plan's. Streaming schedules ('1f1b', '2bw') run
    `minibatches` minibatches (default `steady_minibatches`); flush schedules one minibatch.
    `warmup`: "plan" (the depths the planner chose, else NOAM), "noam", "latency"
    (`schedule.generators.latency_aware_warmup`) or one depth per stage. `costs`: stage costs to use
    instead of the CostGraph's (e.g. measured ones). A streaming schedule without `minibatches`
    runs streams of doubling length until its steady state holds (`simulate_steady`), so that
    `pdcompile simulate` and the planner report the same figure for the same plan. `cache`:
    the schedules a search has built already (planner/search_cache.py; None: build anew)."""
    if minibatches is not None and (isinstance(minibatches, bool)
                                    or not isinstance(minibatches, int) or minibatches < 1):
        # 0 fell back to the default and -1 simulated one minibatch, each reported as the plan's
        raise PdcompileError(f"minibatches={minibatches!r}: give a positive number of "
                             "minibatches to stream (e.g. 32), or leave it out for enough to "
                             "reach the steady state")
    name = schedule or plan.schedule
    if minibatches is None and not kind(name).flush:
        return _steady(graph, plan, cluster, schedule=name, microbatches=microbatches,
                       warmup=warmup, timeline=timeline, costs=costs, cache=cache)
    return _simulate_once(graph, plan, cluster, schedule=name, microbatches=microbatches,
                          minibatches=minibatches, warmup=warmup, timeline=timeline,
                          costs=costs, cache=cache)


def _simulate_once(graph: nx.DiGraph, plan: Plan, cluster: Cluster, *, schedule: str,
                   microbatches: int | None, minibatches: int | None,
                   warmup: str | Sequence[int], timeline: bool, costs: StageCosts | None,
                   cache: SearchCache | None = None) -> tuple[Schedule, SimResult]:
    """`simulate_plan` of one stream (`minibatches`, default `steady_minibatches`)."""
    name = schedule
    row = kind(name)
    per = (microbatches or (plan.microbatches if plan.schedule == name
                            else DEFAULT_MICROBATCHES)) if row.microbatched else 1
    if not row.microbatched and microbatches not in (None, 1):
        raise PdcompileError(f"{name!r} runs whole minibatches; use schedule '2bw' or "
                             f"'1f1b-flush' for {microbatches} microbatches per minibatch")
    costs = costs or StageCosts.from_plan(graph, plan, microbatches=per)
    stage_ranks = [list(s.ranks) for s in plan.stages]
    depths = _warmup(warmup, plan, costs, cluster, name)
    run = row.run_length([s.round_size for s in plan.stages], microbatches=per,
                         minibatches=minibatches or steady_minibatches(plan))
    recompute = [i for i, s in enumerate(plan.stages) if s.recompute]
    if cache is None:
        lowered = build(name, stage_ranks, run, per_minibatch=per,
                        stage_edges=costs.stage_edges(), warmup=depths, recompute=recompute,
                        shares=plan.shares())
        return lowered, simulate(lowered, costs, cluster, timeline=timeline)
    lowered, prepared = cache.schedule(name, stage_ranks, run, per_minibatch=per,
                                       stage_edges=costs.stage_edges(), warmup=depths,
                                       recompute=recompute, shares=plan.shares())
    return lowered, simulate(lowered, costs, cluster, timeline=timeline, prepared=prepared)


def simulate_steady(graph: nx.DiGraph, plan: Plan, cluster: Cluster, *,
                    tolerance: float = STEADY_TOLERANCE, longest: int = STEADY_LONGEST,
                    cache: SearchCache | None = None) -> tuple[Schedule, SimResult]:
    """`simulate_plan` of a streaming schedule on streams of doubling length until the time per
    minibatch moves by less than `tolerance` (at most `longest` times `steady_minibatches`):
    where replicas of different counts meet, a backlog can build over dozens of rounds before
    the steady state shows. A flush schedule is simulated once."""
    if kind(plan.schedule).flush:
        return simulate_plan(graph, plan, cluster, timeline=False, cache=cache)
    return _steady(graph, plan, cluster, schedule=plan.schedule, microbatches=None,
                   warmup="plan", timeline=False, costs=None, tolerance=tolerance,
                   longest=longest, cache=cache)


def _steady(graph: nx.DiGraph, plan: Plan, cluster: Cluster, *, schedule: str,
            microbatches: int | None, warmup: str | Sequence[int], timeline: bool,
            costs: StageCosts | None, tolerance: float = STEADY_TOLERANCE,
            longest: int = STEADY_LONGEST,
            cache: SearchCache | None = None) -> tuple[Schedule, SimResult]:
    """Streams of doubling length until the time per minibatch holds (`simulate_steady`)."""
    length = steady_minibatches(plan)

    def once(count: int) -> tuple[Schedule, SimResult]:
        return _simulate_once(graph, plan, cluster, schedule=schedule,
                              microbatches=microbatches, minibatches=count, warmup=warmup,
                              timeline=timeline, costs=costs, cache=cache)

    schedule_, result = once(length)
    factor = 1
    while factor < longest:
        factor *= 2
        longer = once(length * factor)
        moved = _moved(result.time_per_minibatch, longer[1].time_per_minibatch)
        schedule_, result = longer
        if moved < tolerance:
            break
    return schedule_, result


def _moved(before: float, after: float) -> float:
    """How far a longer stream moved the time per minibatch, relative to the shorter's; a
    graph that costs nothing (every node free) takes 0 s on both and has not moved."""
    if before == after:
        return 0.0
    return abs(after - before) / before if before > 0 else math.inf


def _warmup(warmup: str | Sequence[int], plan: Plan, costs: StageCosts, cluster: Cluster,
            name: str) -> list[int] | None:
    if not isinstance(warmup, str):
        return [int(w) for w in warmup]
    if warmup == "plan":
        return plan.warmup() if plan.schedule == name else None
    if warmup == "noam":
        return None
    if warmup == "latency":
        if not kind(name).chosen_warmup:
            return None
        from pdcompile.schedule.generators import latency_aware_warmup

        stage_ranks = [list(s.ranks) for s in plan.stages]
        return latency_aware_warmup(stage_ranks, costs.round_trips(stage_ranks, cluster),
                                    costs.period(stage_ranks, cluster))
    raise PdcompileError(f"warmup must be 'plan', 'noam', 'latency' or one depth per stage, "
                         f"not {warmup!r}")


def data_parallel_plan(graph: nx.DiGraph, cluster: Cluster) -> Plan:
    """Plain data parallelism as a Plan: every node in one stage replicated on every worker."""
    workers = cluster.workers
    stage = Stage(tuple(topological_order(graph)), workers, tuple(range(workers)))
    return Plan(stages=(stage,), time_per_minibatch=0.0, dp_time=0.0, workers=workers,
                planner="data-parallel")


__all__ = ["data_parallel_plan", "simulate_plan", "simulate_steady", "steady_minibatches"]
