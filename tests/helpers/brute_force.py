"""Brute-force partitioner for tiny graphs: every chain of downsets x every replica split.

Independent of the DP and CP-SAT code (it shares only the one cost model: the planning objective
`costmodel.planning_objective` by default, or any pricing function with its signature):
stages are the differences of a strictly growing chain of downsets of the graph (so every convex
ordered partition is tried), inputs (costmodel.input_nodes) sit on the first stage as the cost
model requires,
ranks are consecutive, and all workers are used (straight: one worker per stage, any number of
stages up to the workers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import networkx as nx

from pdcompile.cost.costgraph import topological_order
from pdcompile.cost.crossing import input_nodes
from pdcompile.machine.cluster import Cluster
from pdcompile.planner.costmodel import ModelOptions, evaluate, planning_objective


def _downsets(graph: nx.DiGraph, nodes: list[str]) -> list[frozenset[str]]:
    out = []
    for size in range(len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(u in chosen or u not in nodes for v in chosen for u in graph.predecessors(v)):
                out.append(frozenset(chosen))
    return out


def _chains(downsets: list[frozenset[str]], current: frozenset[str], full: frozenset[str],
            ) -> Iterator[list[frozenset[str]]]:
    if current == full:
        yield []
        return
    for nxt in downsets:
        if current < nxt:
            for rest in _chains(downsets, nxt, full):
                yield [nxt - current, *rest]


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def brute_force(graph: nx.DiGraph, cluster: Cluster, *, options: ModelOptions,
                memory: float | None, straight: bool = False,
                objective: Callable[..., float] | None = None,
                ) -> tuple[float, list[tuple[list[str], tuple[int, ...]]]] | None:
    """The best (objective, stages) over all plans, or None if no plan fits memory.

    `objective(graph, stages, cluster, options=, memory=)`: default the planning objective
    (inf where a stage does not fit); the pipedream model is priced with `evaluate` and its
    memory checked per stage."""
    order = topological_order(graph)
    pinned = [v for v in order if v in set(input_nodes(graph))]
    core = [v for v in order if v not in pinned]
    full = frozenset(core)
    workers = cluster.workers
    best: tuple[float, list[tuple[list[str], tuple[int, ...]]]] | None = None
    for chain in _chains(_downsets(graph, core), frozenset(), full):
        count = len(chain)
        if count > workers:
            continue
        splits = [tuple([1] * count)] if straight else list(_compositions(workers, count))
        for reps in splits:
            start, stages = 0, []
            for part, r in zip(chain, reps, strict=True):
                nodes = [v for v in order if v in part]
                stages.append((nodes, tuple(range(start, start + r))))
                start += r
            stages[0] = ([*pinned, *stages[0][0]], stages[0][1])
            if objective is not None:
                time = objective(graph, stages, cluster, options=options, memory=memory)
            elif options.cost_model == "pipedream":
                priced, time = evaluate(graph, stages, cluster, options=options)
                if memory is not None and any(s.memory > memory * (1 + 1e-12) for s in priced):
                    continue
            else:
                time = planning_objective(graph, stages, cluster, options=options,
                                          memory=memory)
            if not math.isfinite(time):
                continue
            if best is None or time < best[0] - 1e-15:
                best = (time, stages)
    return best
