"""Plans as cut positions in one topological order, and the moves from one such plan to its
neighbours: what the local searches (refine.py by simulation, polish.py by the closed form)
walk.

A plan is a State: the index in the order where each stage starts, and each stage's replica
count; stages are contiguous in the order (so they stay convex) and hold consecutive ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence

import networkx as nx

from pdcompile.cost.costgraph import topological_order

State = tuple[tuple[int, ...], tuple[int, ...]]  # (stage start indices into the order, replicas)


def linearised(graph: nx.DiGraph, stage_of: dict[str, int], count: int,
               ) -> tuple[list[str], tuple[int, ...]]:
    """One topological order of `graph` with each of the `count` stages contiguous (`stage_of`
    places every node), and the index where each stage starts."""
    topo = topological_order(graph)
    position = {n: i for i, n in enumerate(topo)}
    order = sorted(topo, key=lambda n: (stage_of[n], position[n]))
    starts, at = [], 0
    for index in range(count):
        starts.append(at)
        at += sum(1 for n in order if stage_of[n] == index)
    return order, tuple(starts)


def stages_of(state: State, order: Sequence[str]) -> list[tuple[list[str], tuple[int, ...]]]:
    """A State as (nodes, ranks) per stage, ranks consecutive from 0."""
    starts, reps = state
    ends = starts[1:] + (len(order),)
    stages, rank = [], 0
    for a, b, r in zip(starts, ends, reps, strict=True):
        stages.append((list(order[a:b]), tuple(range(rank, rank + r))))
        rank += r
    return stages


def positions(lo: int, hi: int) -> range:
    """Cut positions strictly inside (lo, hi): every one on small spans, else about 24 evenly."""
    step = max(1, (hi - lo) // 24)
    return range(lo + 1, hi, step)


def neighbours(state: State, nodes: int, *, splits: bool = True) -> Iterator[tuple[str, State]]:
    """The States one move from `state` (of a graph of `nodes` nodes), each with its name:
    merge two neighbouring stages (their replicas add up); move one replica from a stage to
    another; move a boundary between two stages; and (`splits`) split a replicated stage in
    two (replicas r-1 and 1, 1 and r-1, or halves)."""
    starts, reps = state
    count = len(reps)
    ends = starts[1:] + (nodes,)
    for i in range(count - 1):  # merge stage i and i + 1
        merged = reps[:i] + (reps[i] + reps[i + 1],) + reps[i + 2:]
        yield f"merge stages {i} and {i + 1}", (starts[:i + 1] + starts[i + 2:], merged)
    for i in range(count):  # one replica from stage i to stage j
        if reps[i] < 2:
            continue
        for j in range(count):
            if j != i:
                moved = list(reps)
                moved[i] -= 1
                moved[j] += 1
                yield f"replica from stage {i} to {j}", (starts, tuple(moved))
    for b in range(1, count):  # move the boundary between stage b - 1 and b
        for at in positions(starts[b - 1], ends[b]):
            if at != starts[b]:
                yield f"boundary {b} to node {at}", (starts[:b] + (at,) + starts[b + 1:], reps)
    if not splits:
        return
    for i in range(count):  # split stage i in two, sharing its replicas
        r = reps[i]
        if r < 2:
            continue
        shares = sorted({(r - 1, 1), (1, r - 1), (r // 2, r - r // 2)})
        for at in positions(starts[i], ends[i]):
            for first, second in shares:
                yield (f"split stage {i} at node {at}",
                       (starts[:i + 1] + (at,) + starts[i + 1:],
                        reps[:i] + (first, second) + reps[i + 1:]))


def config(reps: Sequence[int]) -> str:
    """Replica counts as PipeDream writes a configuration, e.g. 12-3-1."""
    return "-".join(str(r) for r in reps)



def runs_nothing(stages: Sequence[tuple[Sequence[str], object]], inputs: Collection[str]) -> bool:
    """Whether some stage holds only the graph's inputs (`cost.crossing.input_nodes`): nothing
    to run there, which the split refuses."""
    return any(all(n in inputs for n in nodes) for nodes, _ in stages)


def descend(state: State, best: float, score: Callable[[State], float],
            more: Callable[[], bool], is_known: Callable[[State], bool], *, nodes: int,
            floor: Callable[[State, float], float | None] | None = None,
            ) -> tuple[float, State, list[str]]:
    """Steepest descent from `state` (priced `best`) by `score` until no neighbour is cheaper
    or the budget is spent (`more()` false; a neighbour already priced, `is_known`, is still
    looked at): the price reached, the plan, one line per move taken. `floor(s, best)`: a
    value for a neighbour not yet priced that cannot beat `best` (a lower bound at or above
    it), or None to price it; such a neighbour is never taken, so the walk is the same."""
    moves: list[str] = []

    def price(s: State) -> float:
        if floor is not None and not is_known(s):
            bounded = floor(s, best)
            if bounded is not None:
                return bounded
        return score(s)

    while more():
        scored = [(price(s), name, s) for name, s in neighbours(state, nodes)
                  if more() or is_known(s)]
        if not scored:
            break
        value, name, chosen = min(scored, key=lambda c: c[0])
        if not value < best * (1 - 1e-9):
            break
        best, state = value, chosen
        moves.append(f"{name}: {config(chosen[1])} {value * 1e3:.2f} ms")
    return best, state, moves


__all__ = ["State", "config", "descend", "linearised", "neighbours", "positions", "runs_nothing",
           "stages_of"]
