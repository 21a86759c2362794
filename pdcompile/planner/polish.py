"""A local search by the closed form from the planner's best candidates, where the servers'
network interfaces bind.

Why: the DP's objective is a maximum over stages, but a server's interface carries the sum of
what every stage on that server sends and receives across it (`cost.links.nic_busy_seconds`):
where several stages share a server the objective sees each of them alone, and its optimum can
be a plan whose interface is busier than a neighbouring plan's. On VGG-16 with 1F1B-flush on
cluster A it returned 11-2-2-1 (its objective 77.2 ms; the interface makes it 90.6 ms) over
12-3-1 (82.2 ms both ways), two moves away. The closed form sees the sum, and prices a plan
in about a millisecond, so the planner walks from its best plans to better neighbours
(moves.py: merge, move a replica, move a boundary, split) while the closed form falls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

from pdcompile.planner.moves import State, descend, linearised, stages_of

Stages = list[tuple[list[str], tuple[int, ...]]]
# where no neighbour is cheaper, the most plans of the same price whose neighbours the walk
# prices for a cheaper one (a plan of a few stages has about a hundred neighbours)
PLATEAU_STATES = 4


def as_state(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
             ) -> tuple[list[str], State] | None:
    """The order and State of a plan given as (nodes, ranks) per stage, or None where it is
    not one the moves walk: a node placed in no stage or twice, or ranks that are not
    consecutive from 0 in pipeline order."""
    stage_of: dict[str, int] = {}
    rank = 0
    for index, (nodes, ranks) in enumerate(stages):
        if tuple(ranks) != tuple(range(rank, rank + len(ranks))):
            return None
        rank += len(ranks)
        for node in nodes:
            if node in stage_of:
                return None
            stage_of[node] = index
    if set(stage_of) != set(graph.nodes):
        return None
    order, starts = linearised(graph, stage_of, len(stages))
    return order, (starts, tuple(len(ranks) for _, ranks in stages))


def polish(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
           price: Callable[[Stages], float], *, budget: int,
           floor: Callable[[Stages], float] | None = None,
           ) -> tuple[Stages, float, list[str]] | None:
    """Steepest descent from `stages` by `price` (seconds per minibatch; inf where a plan
    does not fit), at most `budget` prices: the best plan reached, its price and the moves
    taken; None where the plan is not one the moves walk (`as_state`) or no neighbour is
    cheaper. Where no neighbour is cheaper, the walk looks for one from plans of the same
    price (at most PLATEAU_STATES of them: `moves.plateau_exit`). `floor`: a cheap lower
    bound on `price`; a neighbour whose floor is above the current plan's price cannot be
    taken and is not priced, but counts against the budget as if it were (so the walk, and
    the plan, are those of pricing every one)."""
    walked = as_state(graph, stages)
    if walked is None:
        return None
    order, state = walked
    cache: dict[State, float] = {}

    def cost(candidate: State) -> float:
        if candidate not in cache:
            cache[candidate] = price(stages_of(candidate, order))
        return cache[candidate]

    def bounded(candidate: State, above: float) -> float | None:
        if floor is None:
            return None
        value = floor(stages_of(candidate, order))
        if not value > above:
            return None
        cache[candidate] = value  # counted, never taken: its price is at least this
        return value

    best, state, moves = descend(state, cost(state), cost, lambda: len(cache) < budget,
                                 cache.__contains__, nodes=len(order), floor=bounded,
                                 plateau=PLATEAU_STATES)
    if not moves:
        return None
    return stages_of(state, order), best, moves


__all__ = ["PLATEAU_STATES", "as_state", "polish"]
