"""Plans as cut positions in one topological order, and the moves from one such plan to its
neighbours: what the local searches (refine.py by simulation, polish.py by the closed form)
walk.

A plan is a State: the index in the order where each stage starts, and each stage's replica
count; stages are contiguous in the order (so they stay convex) and hold consecutive ranks.
"""

from __future__ import annotations

from collections import deque
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
            plateau: int = 0) -> tuple[float, State, list[str]]:
    """Steepest descent from `state` (priced `best`) by `score` until no neighbour is cheaper
    or the budget is spent (`more()` false; a neighbour already priced, `is_known`, is still
    looked at): the price reached, the plan, one line per move taken. `floor(s, above)`: for a
    neighbour not yet priced, a lower bound on its price where that bound is above `above`,
    else None to price it; descend asks above the plan's price and every price as close as
    _SAME, so such a neighbour is neither cheaper nor as cheap (no member of a plateau) and
    the walk is that of pricing it.

    `plateau`: where no neighbour is cheaper, the most plans of the same price (a plateau:
    a price that is a maximum, such as a server interface's load, stays where a move leaves
    its busiest term alone) whose neighbours are looked at, breadth first from the plan, for
    a cheaper one; the walk goes on from there (`plateau_exit`). 0: stop at once."""
    moves: list[str] = []

    def price(s: State, at: float) -> float:
        if floor is not None and not is_known(s):
            bounded = floor(s, at * (1 + _SAME))
            if bounded is not None:
                return bounded
        return score(s)

    # a plan of no time cannot be beaten: on a graph that costs nothing every plan is, and its
    # whole neighbourhood a plateau (927 free nodes on h100-4node: 5,400 prices walked)
    while best > 0.0 and more():
        scored = [(price(s, best), name, s) for name, s in neighbours(state, nodes)
                  if more() or is_known(s)]
        if not scored:
            break
        value, name, chosen = min(scored, key=lambda c: c[0])
        if value < best * (1 - _SAME):
            best, state = value, chosen
            moves.append(f"{name}: {config(chosen[1])} {value * 1e3:.2f} ms")
            continue
        found = plateau_exit(state, best, lambda s: price(s, best), more, is_known,
                             nodes=nodes, most=plateau)
        if found is None:
            break
        path, (value, name, chosen) = found
        moves += [f"{step} (as fast): {config(s[1])} {best * 1e3:.2f} ms" for step, s in path]
        best, state = value, chosen
        moves.append(f"{name}: {config(chosen[1])} {value * 1e3:.2f} ms")
    return best, state, moves


_SAME = 1e-9  # relative: prices this close are the same price


def plateau_exit(state: State, best: float, price: Callable[[State], float],
                 more: Callable[[], bool], is_known: Callable[[State], bool], *, nodes: int,
                 most: int) -> tuple[list[tuple[str, State]], tuple[float, str, State]] | None:
    """A cheaper plan one move from the plateau of `state` (the plans priced `best`, to
    _SAME, that moves of that price reach from it), breadth first over at most `most` of its
    plans: the moves of that price to the plan it leaves from, and (price, move, plan) of the
    cheapest neighbour of that plan; None where none is cheaper, `most` plans were looked at
    or the budget is spent. Why: steepest descent stops on a plateau even where a plan of the
    same price has a cheaper neighbour. VGG-16 with 1F1B-flush on cluster A stopped at
    11-2-1-1-1 (90.63 ms, bound by the last server's interface): merging its stages 2 and 3
    leaves that load as it is, and from 11-2-2-1 a replica moved to stage 0 gives 87.24 ms,
    then 12-3-1 at 82.21 ms."""
    queue: deque[tuple[State, list[tuple[str, State]]]] = deque([(state, [])])
    members = {state}
    looked = 0
    while queue and looked < most:
        here, path = queue.popleft()
        looked += 1
        cheaper: tuple[float, str, State] | None = None
        for name, s in neighbours(here, nodes):
            if not (more() or is_known(s)):
                return None
            value = price(s)
            if value < best * (1 - _SAME):
                if cheaper is None or value < cheaper[0]:
                    cheaper = (value, name, s)
            elif value <= best * (1 + _SAME) and s not in members:
                members.add(s)
                queue.append((s, [*path, (name, s)]))
        if cheaper is not None:
            return path, cheaper
    return None


__all__ = ["State", "config", "descend", "linearised", "neighbours", "plateau_exit", "positions",
           "runs_nothing", "stages_of"]
