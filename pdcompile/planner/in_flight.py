"""How many microbatches each stage keeps in flight, and which stages recompute their
activations, within the memory: what makes a cut of the graph into stages a plan that runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from pdcompile.cost.memory import max_in_flight
from pdcompile.cost.pipeline_time import fewest_in_flight, runnable_in_flight, work_period
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.planner.costmodel import (
    IN_FLIGHT_CAP,
    ModelOptions,
    default_in_flight,
    evaluate,
    evaluate_timed,
    plan_costs,
    plan_terms,
)
from pdcompile.schedule.kinds import kind


def choose_recompute(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
                     cluster: Cluster, *, options: ModelOptions,
                     memory: float | None, costs: StageCosts | None = None,
                     ) -> tuple[list[bool], list[int]]:
    """Which stages recompute their activations (pdcompile.cost.recompute), and the
    microbatches each stage then keeps in flight (`choose_in_flight`): recomputing are those
    that cannot keep even one microbatch's activations otherwise; then those whose memory holds
    fewer microbatches in flight than their circuits want, all at once (then each of them back
    where that is faster); then, one at a time, any whose recomputation makes the plan faster
    in closed form (it frees memory for more microbatches in flight, for one more forward
    each). A stage whose memory does not bind (it keeps fewer in flight than it could) is not
    tried: more room changes no in-flight count there, and its forward only adds time (GPT-2
    XL on 128 H100s: 37 in-flight choices of 8-stage candidates, half the planning time); nor
    is one after every stage of the circuit that bounds the plan (`PipelineTime.binding`: a
    later stage holding more in flight leaves that circuit fewer tokens, and its forward is
    not on it), nor any where a stage's work, a link or a server's interface bounds it (no
    memory moves those).
    `costs`: `plan_costs` of these stages and options, where the caller has them.
    Raises PlanError when a stage fits neither way."""
    again = [False] * len(stages)
    # the stages' costs, the same under every in-flight count and recomputation tried here
    costs = costs if costs is not None else plan_costs(graph, stages, options=options)
    plain = _memory_limits(graph, stages, options, memory, again, cluster, costs=costs)
    again = [n < 1 for n in plain]
    if any(again) and min(_memory_limits(graph, stages, options, memory, again, cluster,
                                         costs=costs)) < 1:
        raise PlanError("a stage does not fit the memory, even recomputing its activations")
    if memory is None or kind(options.schedule).flush:
        return again, _in_flight(graph, stages, cluster, options=options, memory=memory,
                                 recompute=again, costs=costs)[0]
    chosen: dict[tuple[bool, ...], tuple[list[int], list[int], list[int]]] = {}
    binding: dict[tuple[bool, ...], tuple[int, ...]] = {}
    ratios: dict[tuple, float] = {}  # the circuits' ratios, which the trials share

    def closed(flags: list[bool]) -> float:
        try:
            choice = _in_flight(graph, stages, cluster, options=options, memory=memory,
                                recompute=flags, costs=costs, ratios=ratios)
        except PlanError:  # recomputing a stage can hold more: its inputs and one microbatch
            return math.inf
        chosen[tuple(flags)] = choice
        if options.cost_model != "native":
            return evaluate(graph, stages, cluster, options=options, in_flight=choice[0],
                            recompute=flags)[1]
        _, seconds, timed = evaluate_timed(graph, stages, cluster, options=options,
                                           in_flight=choice[0], recompute=flags, costs=costs)
        binding[tuple(flags)] = timed.binding
        return seconds

    best = closed(again)
    # first every stage whose memory holds fewer in flight than its circuits want, together:
    # recomputing one of them alone may gain nothing while a circuit through another binds
    # (NASNet-A large's 2-3-3-1-2-1-1-1-1-1 on 16 workers: stage 0 alone 469 ms, stages 0-2
    # 72 ms)
    want = _in_flight(graph, stages, cluster, options=options, memory=None, recompute=again,
                      costs=costs, ratios=ratios)[0]
    starved = [a or n < w for a, n, w in zip(again, plain, want, strict=True)]
    if starved != again:
        value = closed(starved)
        if value < best * (1 - 0.01):
            forced, again, best = again, starved, value
            for s in range(len(stages)):  # then each of them back, where its forward costs
                if again[s] and not forced[s]:  # more than its in-flight microbatches gain
                    trial = again[:s] + [False] + again[s + 1:]
                    value = closed(trial)
                    if value < best * (1 - 0.01):
                        again, best = trial, value
    for s in range(len(stages)):
        if again[s] or _room_to_spare(chosen.get(tuple(again)), stages, s) \
                or s > max(binding.get(tuple(again), (len(stages),)), default=-1):
            continue
        trial = again[:s] + [True] + again[s + 1:]
        value = closed(trial)
        if value < best * (1 - 0.01):
            again, best = trial, value
    if tuple(again) not in chosen:  # every choice with these flags raised PlanError
        raise PlanError("a stage does not fit the memory")
    return again, chosen[tuple(again)][0]


def _room_to_spare(choice: tuple[list[int], list[int], list[int]] | None,
                   stages: list[tuple[list[str], tuple[int, ...]]], s: int) -> bool:
    """Whether stage s keeps fewer microbatches in flight than its memory holds (`choice`: the
    in-flight counts, the memory's limits, those limits where earlier stages must feed later
    ones), on ranks that no other stage shares (chunks of one rank share its memory), and no
    later stage is held at a limit that an earlier stage's memory sets (more room at s could
    lift it)."""
    if choice is None:
        return False
    flight, limits, runnable = choice
    ranks = set(stages[s][1])
    fed = all(flight[k] < runnable[k] or runnable[k] >= limits[k]
              for k in range(s + 1, len(stages)))
    return flight[s] < limits[s] and fed and not any(
        ranks & set(r) for k, (_, r) in enumerate(stages) if k != s)


def choose_in_flight(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
                     cluster: Cluster, *, options: ModelOptions, memory: float | None,
                     recompute: Sequence[bool] | None = None,
                     costs: StageCosts | None = None) -> list[int]:
    """Microbatches each stage keeps in flight. Streaming schedules: PipeDream's NOAM, deeper
    where the round trips need more to fill the pipeline's period
    (`cost.pipeline_time.fewest_in_flight`), never more than the memory holds (so below NOAM
    where it must: the plan still runs, its round trips exposed). Flush schedules: NOAM, at
    most what fits. `recompute`: the stages that recompute their activations. Raises PlanError
    when a stage cannot hold even one. `costs`: `plan_costs` of these stages and options."""
    return _in_flight(graph, stages, cluster, options=options, memory=memory,
                      recompute=recompute, costs=costs)[0]


def _in_flight(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
               cluster: Cluster, *, options: ModelOptions, memory: float | None,
               recompute: Sequence[bool] | None = None, costs: StageCosts | None = None,
               ratios: dict[tuple, float] | None = None,
               ) -> tuple[list[int], list[int], list[int]]:
    """`choose_in_flight`'s counts, the memory's limits on them (`_memory_limits`; 2BW's
    own cap included) and those limits lowered where an earlier stage cannot feed a later one
    (`runnable_in_flight`). `costs`: the stages' (`plan_terms`); `ratios`: circuits priced
    before (`fewest_in_flight`)."""
    row = kind(options.schedule)
    again = list(recompute) if recompute is not None else [False] * len(stages)
    defaults = [default_in_flight(len(r), sum(len(x) for _, x in stages[i:]), options)
                for i, (_, r) in enumerate(stages)]
    limits = _memory_limits(graph, stages, options, memory, again, cluster, costs=costs)
    if any(n < 1 for n in limits) or (row.forwards_first
                                      and any(n < d for n, d in zip(limits, defaults,
                                                                    strict=True))):
        raise PlanError("a stage does not fit the memory")
    if row.flush:
        return [min(n, d) for n, d in zip(limits, defaults, strict=True)], limits, limits
    replicas = [len(r) for _, r in stages]
    if row.double_buffered:  # 2BW: a replica's forwards of minibatch t follow its backwards of
        # t-2, so it runs at most its own microbatches of a minibatch ahead (schedule.generators)
        limits = [min(n, max(1, options.per_minibatch // r) + 1)
                  for n, r in zip(limits, replicas, strict=True)]
    memory_limits = limits
    limits = runnable_in_flight(limits, replicas)
    built = plan_terms(graph, stages, cluster, options=options, in_flight=limits,
                       recompute=again, costs=costs)
    edges = dict(built.costs.edges)
    target = work_period(built.terms, edges, built.ranks, cluster, schedule=options.schedule,
                         microbatches=options.per_minibatch)
    fewest = fewest_in_flight(built.terms, edges, built.ranks, cluster,
                              schedule=options.schedule, microbatches=options.per_minibatch,
                              period=target, limits=limits, ratios=ratios)
    return runnable_in_flight([min(n, max(f, d)) for n, f, d in zip(limits, fewest, defaults,
                                                                     strict=True)],
                              replicas), memory_limits, limits


def _memory_limits(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
                   options: ModelOptions, memory: float | None, recompute: Sequence[bool],
                   cluster: Cluster, *, costs: StageCosts | None = None) -> list[int]:
    """The most microbatches each stage can keep in flight within `memory` (capped): with
    weight stashing each one adds a weight version; a recomputing stage keeps only what it
    received per microbatch, plus one microbatch's activations."""
    row = kind(options.schedule)
    costs = costs if costs is not None else plan_costs(graph, stages, options=options)
    if memory is None:
        return [IN_FLIGHT_CAP] * len(stages)
    out = []
    for s in range(len(stages)):
        keep = costs.activations[s]
        per, fixed = (costs.received(s), keep) if recompute[s] else (keep, 0.0)
        fits = max_in_flight(
            costs.params[s], per, versions_per_flight=row.stashed_versions == "in-flight",
            fixed_versions=1 if row.stashed_versions == "in-flight"
            else int(row.stashed_versions), optimizer_state=options.optimizer_state,
            limit=rank_memory(memory, cluster, stages[s][1]) - fixed)
        out.append(min(IN_FLIGHT_CAP, fits))
    return out


def rank_memory(limit: float, cluster: Cluster, ranks: Sequence[int]) -> float:
    """Bytes a stage on `ranks` may use: `limit`, and on a mixed cluster no more than the
    smallest device among them holds (a homogeneous cluster's limit may exceed its device's:
    planning for more memory than the preset's is allowed)."""
    return min(limit, cluster.memory_of(ranks)) if cluster.is_mixed else limit


__all__ = ["choose_in_flight", "choose_recompute", "rank_memory"]
