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

Edges = list[list[tuple[int, float, int]]]  # per node, (target, weight, tokens) per edge out


def largest_cycle_ratio(edges: Edges) -> tuple[float, list[int]]:
    """(the largest weight / tokens over the cycles of `edges`, the nodes of one such cycle).
    Every node needs an edge out (see the module docstring)."""
    count = len(edges)
    # start from each node's heaviest edge: the slow circuits first, fewer improvements
    policy = [max(range(len(out)), key=lambda i: out[i][1]) for out in edges]
    scale = max((abs(w) for out in edges for _, w, _ in out), default=0.0)
    eps = 1e-12 * scale + 1e-300
    ratio, value, cycles = _evaluate(edges, policy)
    targets = [[target for target, _, _ in out] for out in edges]
    for _ in range(8 * count + 64):
        changed = False
        for u, ends in enumerate(targets):  # first a larger ratio, where any edge reaches one
            best, pick = ratio[u] + eps, -1
            for i, target in enumerate(ends):
                if ratio[target] > best:
                    best, pick = ratio[target], i
            if pick >= 0:
                policy[u], changed = pick, True
        if not changed:  # then, among edges of the same ratio, a larger value
            for u, out in enumerate(edges):
                here = ratio[u]
                best, pick = value[u] + eps * (1.0 + abs(value[u])), -1
                for i, (target, w, t) in enumerate(out):
                    if abs(ratio[target] - here) <= eps:
                        gain = w - here * t + value[target]
                        if gain > best:
                            best, pick = gain, i
                if pick >= 0 and pick != policy[u]:
                    policy[u], changed = pick, True
        if not changed:
            break
        ratio, value, cycles = _evaluate(edges, policy)
    top = max(range(count), key=lambda u: ratio[u])
    return ratio[top], cycles[top]


def _evaluate(edges: Edges, policy: list[int]) -> tuple[list[float], list[float], list[list[int]]]:
    """Per node of the graph where each node follows its `policy` edge: the ratio of the cycle
    it reaches, its value (weight less ratio x tokens to that cycle, 0 at the cycle's first
    node found) and the cycle's nodes."""
    count = len(edges)
    chosen = [out[pick] for out, pick in zip(edges, policy)]  # each node's (target, w, tokens)
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
