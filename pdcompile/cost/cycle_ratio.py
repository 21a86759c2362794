"""The largest cycle ratio of a weighted graph: the period of a timed event graph.

A steady state in which every event waits for others (x_v(n + tokens) >= x_u(n) + weight per
edge u -> v) settles, after its warm-up, to one period per token: the largest weight / tokens
over the graph's cycles (max-plus algebra; Baccelli, Cohen, Olsder and Quadrat, "Synchronization
and Linearity", 1992, ch. 3). Howard's policy iteration finds it (Cochet-Terrasson, Cohen,
Gaubert, McGettrick and Quadrat, "Numerical computation of spectral elements in max-plus
algebra", 1998): each node follows one edge, the cycles of that choice are evaluated, and nodes
switch to edges that reach a larger ratio, or the same ratio with a larger value, until none
gains. Edges may carry zero or negative tokens (an event of a later index that precedes one of an
earlier index, as a warm-up makes) so long as every cycle carries a positive number: a graph
without one deadlocks, and its caller must not build it.
"""

from __future__ import annotations

import numpy as np

Edges = list[list[tuple[int, float, int]]]  # per node, (target, weight, tokens) per edge out


def largest_cycle_ratio(edges: Edges) -> tuple[float, list[int]]:
    """(the largest weight / tokens over the cycles of `edges`, the nodes of one such cycle).
    Every node needs an edge out (see the module docstring).

    The improvement steps look at every edge of every node: they run on arrays of the edges
    padded to the most edges of a node (a node's first best edge wins, as in a loop over its
    edges in order), so that the planner's thousands of steady-cycle prices (cost/
    steady_cycle.py: a 16-rank plan has graphs of hundreds of nodes) do not loop in Python."""
    count = len(edges)
    widest = max(len(out) for out in edges)
    target = np.zeros((count, widest), dtype=np.intp)
    weight = np.full((count, widest), -np.inf)
    tokens = np.zeros((count, widest))
    real = np.zeros((count, widest), dtype=bool)  # an edge, not padding
    for u, out in enumerate(edges):
        for i, (v, w, t) in enumerate(out):
            target[u, i], weight[u, i], tokens[u, i], real[u, i] = v, w, t, True
    # start from each node's heaviest edge: the slow circuits first, fewer improvements
    policy = np.argmax(weight, axis=1)
    scale = float(np.max(np.abs(weight[real]))) if real.any() else 0.0
    eps = 1e-12 * scale + 1e-300
    rows = np.arange(count)
    ratio, value, cycles = _evaluate(edges, policy.tolist())
    for _ in range(8 * count + 64):
        here = np.asarray(ratio)
        reached = np.where(real, here[target], -np.inf)
        # first a larger ratio, where any edge reaches one
        pick = np.argmax(reached, axis=1)
        larger = reached[rows, pick] > here + eps
        changed = bool(larger.any())
        if changed:
            policy = np.where(larger, pick, policy)
        else:  # then, among edges of the same ratio, a larger value
            worth = np.asarray(value)
            with np.errstate(invalid="ignore"):
                same = real & (np.abs(reached - here[:, None]) <= eps)
                gain = weight - here[:, None] * tokens + worth[target]
                gain = np.where(same & ~np.isnan(gain), gain, -np.inf)
                pick = np.argmax(gain, axis=1)
                # a value of -inf (a cycle without tokens ahead) gives NaN here: never better
                better = (gain[rows, pick] > worth + eps * (1.0 + np.abs(worth))) \
                    & (pick != policy)
            changed = bool(better.any())
            if changed:
                policy = np.where(better, pick, policy)
        if not changed:
            break
        ratio, value, cycles = _evaluate(edges, policy.tolist())
    top = max(range(count), key=lambda u: ratio[u])
    return ratio[top], cycles[top]


def _evaluate(edges: Edges, policy: list[int]) -> tuple[list[float], list[float], list[list[int]]]:
    """Per node of the graph where each node follows its `policy` edge: the ratio of the cycle
    it reaches, its value (weight less ratio x tokens to that cycle, 0 at the cycle's first
    node found) and the cycle's nodes."""
    count = len(edges)
    # each node's (target, w, tokens)
    chosen = [out[pick] for out, pick in zip(edges, policy, strict=True)]
    ratio, value = [0.0] * count, [0.0] * count
    cycle_of: list[list[int]] = [[] for _ in range(count)]
    state = [0] * count  # 0 not seen, 1 on the path being walked, 2 evaluated
    for origin in range(count):
        if state[origin]:
            continue  # evaluated from an earlier origin's path
        path, node = [], origin
        while state[node] == 0:
            state[node] = 1
            path.append(node)
            node = chosen[node][0]
        if state[node] == 1:  # a new cycle, from `node`
            at = path.index(node)
            cycle = path[at:]
            weight = sum(chosen[u][1] for u in cycle)
            tokens = sum(chosen[u][2] for u in cycle)
            eta = weight / tokens if tokens > 0 else float("inf")
            for u in cycle:
                ratio[u], state[u], cycle_of[u] = eta, 2, cycle
            value[node] = 0.0
            for u in reversed(cycle[1:]):
                target, w, t = chosen[u]
                value[u] = w - eta * t + value[target]
            path = path[:at]
        for u in reversed(path):
            target, w, t = chosen[u]
            ratio[u], cycle_of[u] = ratio[target], cycle_of[target]
            value[u] = w - ratio[u] * t + value[target]
            state[u] = 2
    return ratio, value, cycle_of


__all__ = ["Edges", "largest_cycle_ratio"]
