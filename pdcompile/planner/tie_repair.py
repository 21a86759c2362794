"""Plans whose tied stages update apart, mended by giving those stages equal replicas.

Under a streaming schedule a replica updates once per round of its stage's replicas, so the
stages sharing a tie must hold equal replica counts or the tie's all-reduce loses its partner
(cost/ties.py `updates_apart`; the runtime and the simulator refuse such a plan). The DP and
CP-SAT may still propose one, and polishing may reach one: its cuts are often good, only its
replicas are not runnable. `equalized` keeps the cuts and sets every stage sharing a tie to one
replica count, each count held by one of them that the workers allow (the smallest is always
possible: it frees workers), so that the planner prices these variants like any candidate and
lets them compete (planner/search.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from pdcompile.cost.ties import shared_weights, updates_apart

Stages = list[tuple[list[str], tuple[int, ...]]]


def equalized(graph: nx.DiGraph, stages: Stages, workers: int, *, flush: bool) -> list[Stages]:
    """Variants of `stages` (nodes and ranks per stage, every node of `graph` placed) whose
    stages sharing a tie hold one replica count: for each count among those stages, from the
    smallest up, the plan with every such stage lowered to it (keeping its first ranks) or
    raised to it (with ranks no stage uses, of the first `workers`), where there are enough.
    [] where the stages already update together (or the schedule flushes, `flush`)."""
    stage_of = {node: i for i, (nodes, _) in enumerate(stages) for node in nodes}
    if any(node not in stage_of for node in graph.nodes):
        return []
    ties = shared_weights(graph, stage_of)
    replicas = [len(ranks) for _, ranks in stages]
    if updates_apart(ties, replicas, flush) is None:
        return []
    tied = sorted({s for tie in ties for s in tie.stages})
    out = []
    for count in sorted({replicas[s] for s in tied}):
        ranks = _with_replicas(stages, tied, count, workers)
        if ranks is not None:
            out.append([(list(nodes), ranks[i]) for i, (nodes, _) in enumerate(stages)])
    return out


def _with_replicas(stages: Stages, tied: Sequence[int], count: int,
                   workers: int) -> list[tuple[int, ...]] | None:
    """Each stage's ranks with the `tied` stages on `count` replicas: a larger stage keeps its
    first `count` ranks (a symmetric plan lists one rank per server first, so it stays spread
    over the servers), a smaller one takes the lowest ranks left free; None where too few are."""
    ranks = [tuple(r) if i not in tied else tuple(r)[:count] for i, (_, r) in enumerate(stages)]
    used = {rank for stage in ranks for rank in stage}
    free = iter(rank for rank in range(workers) if rank not in used)
    for i in tied:
        short = count - len(ranks[i])
        if short > 0:
            extra = [rank for _, rank in zip(range(short), free, strict=False)]
            if len(extra) < short:
                return None
            ranks[i] = ranks[i] + tuple(extra)
    return ranks


__all__ = ["equalized"]
