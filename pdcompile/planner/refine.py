"""Plan refinement by simulation: a local search from a planner's plan, scored by the simulator.

Why: the planners rank plans by a closed form (the slowest stage, with communication and
all-reduce folded in) that does not see what the schedule does with them: how many minibatches
a stage may hold in flight, or replicated stages all-reducing in lockstep rounds. The simulator
runs the lowered 1F1B schedule and sees both. On PipeDream's own VGG-16 profile for cluster A
the native DP's 8-7-1 simulates at 0.46x of data parallelism, while the paper's 15-1 simulates
at 2.38x. `refine_plan` starts from a plan and takes, while one exists, the move whose simulated
time per minibatch is lowest, if it beats the current plan:

- merge two neighbouring stages (their replicas add up);
- split a replicated stage in two (replicas r-1 and 1, 1 and r-1, or halves);
- move one replica from a stage to another;
- move a boundary between two stages (to every position on small spans, else about 24).

Stages stay contiguous in one topological order of the graph (so they stay convex) and keep
consecutive ranks; plans whose simulated peak memory exceeds the device's are skipped. The
input plan and plain data parallelism are both seeds (a descent from each, sharing the budget),
so the result never simulates slower than either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx

from pdcompile.cost.crossing import stage_of_every_node
from pdcompile.errors import PlanError, ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner.costmodel import ModelOptions, evaluate
from pdcompile.planner.in_flight import choose_in_flight
from pdcompile.planner.moves import State, config, descend, linearised, stages_of
from pdcompile.planner.search_cache import SearchCache


@dataclass(frozen=True)
class Refined:
    """The refined plan, its simulated time per minibatch and the input plan's, and the moves."""

    plan: Plan
    simulated: float
    start: float
    evaluations: int
    moves: tuple[str, ...]

    @property
    def gain(self) -> float:
        """Simulated time of the input plan over that of the result (>= 1)."""
        return self.start / self.simulated if self.simulated > 0 else 1.0


def refine_plan(plan: Plan, graph: nx.DiGraph, cluster: Cluster, *, minibatches: int = 64,
                warmup: str = "plan", max_evaluations: int = 1000,
                from_data_parallel: bool = True, cache: SearchCache | None = None) -> Refined:
    """Local search from `plan` (of `graph` on `cluster`) under asynchronous 1F1B, scored by the
    simulator's steady-state time per minibatch (see the module docstring).

    `minibatches`: the stream simulated per candidate (raised to 4x the replica counts' least
    common multiple, so every replica reaches steady state); `warmup`: "plan" (each
    candidate's in-flight counts chosen within the memory, as the planner chooses them),
    "noam" or "latency"
    (schedule.generators); `max_evaluations`: simulations at most, the input plan's included;
    `from_data_parallel`: descend from data parallelism too, on half the budget (a caller that
    prices data parallelism itself may give the plan's descent all of it); `cache`: the
    schedules of the search this refinement is part of (planner/search_cache.py)."""
    idle = plan.workers < cluster.workers and "idle_workers" in plan.extra
    if plan.workers != cluster.workers and not idle:
        raise PlanError(f"the plan is for {plan.workers} workers but the cluster has "
                        f"{cluster.workers}; plan for this cluster first")
    used = plan.workers
    # a plan the planner left workers idle in (fewer were faster): the search may use them
    plan = replace(plan, workers=cluster.workers)
    if max_evaluations < 1:
        raise PlanError(f"max_evaluations must be a positive integer (got {max_evaluations})")
    order, state = _linearise(plan, graph)
    search = _Search(graph, cluster, order, plan, minibatches=minibatches, warmup=warmup,
                     cache=cache)
    start = search.score(state)
    seeds = [("the plan", state, start)]
    # data parallelism is a seed too: the search never ends below it
    if max_evaluations > 1 and from_data_parallel:
        whole: State = ((0,), (cluster.workers,))
        if whole != state:
            seeds.append(("data parallelism", whole, search.score(whole)))
    if not any(math.isfinite(value) for _, _, value in seeds):
        raise PlanError("neither the plan to refine nor data parallelism fits the device memory "
                        "in simulation; plan with a memory limit first")
    # descend from each seed that fits, the first on half the budget, the last on what is left
    results = []
    runnable = [seed for seed in seeds if math.isfinite(seed[2])]
    for index, (label, seed, value) in enumerate(runnable):
        share = max_evaluations if index == len(runnable) - 1 else \
            search.evaluations + (max_evaluations - search.evaluations) // 2
        results.append(_descend(search, seed, value, label, limit=share, nodes=len(order)))
    best, state, moves = min(results, key=lambda r: r[0])
    refined = search.plan_of(state, simulated=best, start=start)
    held = 1 + max(r for s in refined.stages for r in s.ranks)
    if held < cluster.workers:  # the ranks it uses, as the planner counts them
        refined = replace(refined, workers=max(held, used))
    return Refined(refined, best, start, search.evaluations, tuple(moves))


def _descend(search: _Search, state: State, best: float, label: str, *, limit: int,
             nodes: int) -> tuple[float, State, list[str]]:
    """Steepest descent from `state` until no neighbour is faster or `limit` simulations ran."""
    start = f"from {label}: {config(state[1])} {best * 1e3:.2f} ms"
    best, state, moves = descend(state, best, search.score,
                                 lambda: search.evaluations < limit,
                                 search.cache.__contains__, nodes=nodes)
    return best, state, [start, *moves]


def _linearise(plan: Plan, graph: nx.DiGraph) -> tuple[list[str], State]:
    """One topological order with every stage contiguous, and the plan as a State. Nodes the
    plan does not place join the stage of their first placed successor (stage 0 if none)."""
    stage_of = stage_of_every_node(graph, plan.stage_of())
    order, starts = linearised(graph, stage_of, len(plan.stages))
    return order, (starts, tuple(s.replicas for s in plan.stages))


class _Search:
    """Scores States by simulation, with a cache."""

    def __init__(self, graph: nx.DiGraph, cluster: Cluster, order: list[str], plan: Plan, *,
                 minibatches: int, warmup: str, cache: SearchCache | None) -> None:
        self.graph, self.cluster, self.order, self.base = graph, cluster, order, plan
        self.minibatches, self.warmup = minibatches, warmup
        self.schedules = cache
        self.cache: dict[State, float] = {}
        self.evaluations = 0

    def plan_of(self, state: State, *, simulated: float | None = None,
                start: float | None = None) -> Plan:
        stages = stages_of(state, self.order)
        options = ModelOptions(cost_model=self.base.cost_model)
        flight: list[int] | None = None
        if self.warmup == "plan" and options.cost_model == "native":
            try:
                flight = choose_in_flight(self.graph, stages, self.cluster, options=options,
                                          memory=self.cluster.device.memory)
            except PlanError:  # does not fit: simulated with the default and refused
                flight = None
        if simulated is None:  # a candidate: the simulator needs nodes, ranks, in-flight counts
            return replace(self.base, stages=tuple(
                Stage(tuple(n), len(r), r, in_flight=flight[i] if flight else 0)
                for i, (n, r) in enumerate(stages)), schedule="1f1b", microbatches=1)
        priced, predicted = evaluate(self.graph, stages, self.cluster, options=options,
                                     in_flight=flight)
        extra = dict(self.base.extra) | {"simulated_time_per_minibatch": simulated,
                                         "simulated_before_refine": start}
        return replace(self.base, stages=priced, time_per_minibatch=predicted, extra=extra,
                       planner=f"{self.base.planner}+simulation", schedule="1f1b",
                       microbatches=1)

    def score(self, state: State) -> float:
        if state in self.cache:
            return self.cache[state]
        from pdcompile.planner.simulation import simulate_plan

        self.evaluations += 1
        plan = self.plan_of(state)
        stream = max(self.minibatches, 4 * math.lcm(*state[1]))
        try:
            _, result = simulate_plan(self.graph, plan, self.cluster, minibatches=stream,
                                      warmup=self.warmup, timeline=False,
                                      cache=self.schedules)
        except ScheduleError:  # it cannot run (stages sharing a tie on unequal replicas)
            self.cache[state] = math.inf
            return math.inf
        fits = all(used.total <= self.cluster.device_of(rank).memory
                   for rank, used in result.memory.items())
        value = result.time_per_minibatch if fits else math.inf
        self.cache[state] = value
        return value
