"""Which ranks each stage holds on a mixed cluster: a descent over the stages' rank sets, the
stages' nodes fixed, every neighbour priced on the mixed cluster itself.

Why: the other candidates of planner/mixed.py place a plan's stages on ranks in rank order
(fast groups first) or deal them so that each stage runs at a mean or by its work alone; none
weighs where the parameters are. A chain over 2 fast and 2 slow ranks whose first stage is
heavy compute without parameters and whose second holds 30 MB of them runs fastest as 3-1
with the heavy stage on one fast and both slow ranks and the parameters alone on the other
fast rank (no all-reduce): 15.8 ms, where the candidates' best was data parallelism with
shares, 18.2 ms, and the local search of refine.py (consecutive ranks from 0) found 1-3 with
the fast rank on the first stage, 25.6 ms. The moves:

- give two stages each other's rank sets (their replica counts swap);
- exchange two ranks of different device groups between two stages;
- move one rank from a replicated stage to another (or an unused rank to a stage).

Each neighbour, with its replicas taking minibatches in turn and again with shares in
proportion to speed where a stage mixes kinds, is screened by the closed form, and the few
best are priced by the simulator; steepest descent while one of them is faster and the
budget of simulations lasts. (Pricing every neighbour by simulation took 17-28 s of 60-85 s
of planning on 16-rank mixed-A rows; the closed form is about ten times cheaper and ranks
the round-robin neighbours as the simulator does, shares optimistically, hence a few.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan

RankSets = tuple[tuple[int, ...], ...]  # each stage's ranks, sorted
Price = Callable[[Plan], Plan]  # a plan priced on the mixed cluster (PlanError: cannot)
Shares = Callable[[Plan], Plan | None]  # the plan with shares by speed (None: no change)
KEEP = 4  # neighbours per step priced by the simulator, the best by the closed form
SCREENS = 8  # closed-form pricings per simulated one, at most


def rank_set_neighbours(sets: RankSets, cluster: Cluster) -> Iterator[RankSets]:
    """The rank sets one move from `sets` (module docstring), each once: ranks of one group on
    one server are alike, so rank sets that differ only in such ranks count once, and `sets`
    itself not at all."""
    def alike(candidate: RankSets) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, the (group, server) of each rank: rank sets alike here price alike."""
        return tuple(tuple(sorted((cluster.group_of(r), _server(cluster, r)) for r in s))
                     for s in candidate)

    seen = {alike(sets)}
    unused = tuple(sorted(set(range(cluster.workers)) - {r for s in sets for r in s}))

    def new(candidate: list[tuple[int, ...]]) -> Iterator[RankSets]:
        made = tuple(tuple(sorted(s)) for s in candidate)
        key = alike(made)
        if key not in seen:
            seen.add(key)
            yield made

    def kinds(ranks: tuple[int, ...]) -> list[int]:
        """One rank of each (group, server) among `ranks`."""
        first: dict[tuple[int, int], int] = {}
        for r in ranks:
            first.setdefault((cluster.group_of(r), _server(cluster, r)), r)
        return list(first.values())

    count = len(sets)
    for i in range(count):
        for j in range(i + 1, count):
            swapped = list(sets)
            swapped[i], swapped[j] = sets[j], sets[i]
            yield from new(swapped)
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            for a in kinds(sets[i]):
                if j > i:
                    for b in kinds(sets[j]):
                        if cluster.group_of(a) != cluster.group_of(b):
                            exchanged = list(sets)
                            exchanged[i] = tuple(r for r in sets[i] if r != a) + (b,)
                            exchanged[j] = tuple(r for r in sets[j] if r != b) + (a,)
                            yield from new(exchanged)
                if len(sets[i]) > 1:
                    moved = list(sets)
                    moved[i] = tuple(r for r in sets[i] if r != a)
                    moved[j] = sets[j] + (a,)
                    yield from new(moved)
    for a in kinds(unused):
        for j in range(count):
            added = list(sets)
            added[j] = sets[j] + (a,)
            yield from new(added)


def _server(cluster: Cluster, rank: int) -> int:
    """Which innermost group of the network `rank` sits in (ranks of one are alike to it)."""
    return rank // cluster.group_size(0) if cluster.levels else 0


def with_rank_sets(plan: Plan, sets: RankSets) -> Plan:
    """`plan` with stage i on `sets[i]` (replicas, shares and in-flight counts cleared for the
    pricer to choose); its workers: up to the highest rank it uses, as `price_plan` counts
    them (a move may take a rank past the plan's old highest)."""
    stages = tuple(replace(s, ranks=ranks, replicas=len(ranks), shares=(), in_flight=0)
                   for s, ranks in zip(plan.stages, sets, strict=True))
    workers = 1 + max(r for ranks in sets for r in ranks)
    return replace(plan, stages=stages, extra={}, workers=workers)


def descend_rank_sets(plan: Plan, cluster: Cluster, *, price: Price, screen: Price,
                      shares: Shares, evaluations: int, keep: int = KEEP) -> Plan | None:
    """The fastest plan found by steepest descent over `plan`'s stages' rank sets (module
    docstring); None where none beats `plan` or `plan` has one stage. Each step screens every
    neighbour, round robin and with `shares`, by `screen` (the closed form, about a tenth of
    a simulation) and prices the `keep` best by `price` (the simulator); `evaluations`:
    `price` calls at most, `plan`'s own included (the screen's: SCREENS times as many)."""
    if len(plan.stages) < 2 or evaluations < 1:
        return None
    priced_calls, screened_calls = 0, 0

    def variants(sets: RankSets) -> list[Plan]:
        base = with_rank_sets(plan, sets)
        shared = shares(base)
        return [base] if shared is None else [base, shared]

    def fitting(made: Plan) -> bool:
        return bool(made.extra.get("fits", True)) and math.isfinite(made.time_per_minibatch)

    def priced(candidates: list[Plan]) -> Plan | None:
        nonlocal priced_calls
        best: Plan | None = None
        for candidate in candidates:
            priced_calls += 1
            try:
                made = price(candidate)
            except PlanError:
                continue
            if fitting(made) and (best is None
                                  or made.time_per_minibatch < best.time_per_minibatch):
                best = made
        return best

    sets: RankSets = tuple(tuple(sorted(s.ranks)) for s in plan.stages)
    current: Plan | None = priced(variants(sets))
    start = current
    while priced_calls < evaluations and screened_calls < SCREENS * evaluations:
        screened: list[tuple[float, int, RankSets, Plan]] = []
        for neighbour in rank_set_neighbours(sets, cluster):
            if screened_calls >= SCREENS * evaluations:
                break
            for candidate in variants(neighbour):
                screened_calls += 1
                try:
                    made = screen(candidate)
                except PlanError:
                    continue
                if fitting(made):
                    screened.append((made.time_per_minibatch, len(screened), neighbour,
                                     candidate))
        step: tuple[RankSets, Plan] | None = None
        for _, _, neighbour, candidate in sorted(screened)[:keep]:
            if priced_calls >= evaluations:
                break
            simulated = priced([candidate])
            bar = current if step is None else step[1]
            if simulated is not None and (bar is None or simulated.time_per_minibatch
                                          < bar.time_per_minibatch * (1 - 1e-9)):
                step = (neighbour, simulated)
        if step is None:
            break
        sets, current = step
    if current is None or current is start:
        return None
    return current


__all__ = ["descend_rank_sets", "rank_set_neighbours", "with_rank_sets"]
