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

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Edges = list[list[tuple[int, float, int]]]  # per node, (target, weight, tokens) per edge out
WALKED_BELOW = 1024  # nodes: smaller graphs' policies are evaluated by walking them in Python


def largest_cycle_ratio(edges: Edges) -> tuple[float, list[int]]:
    """(the largest weight / tokens over the cycles of `edges`, the nodes of one such cycle).
    Every node needs an edge out (see the module docstring).

    The improvement steps look at every edge of every node: they run on arrays of all the
    edges, node after node (a node's first best edge wins, as in a loop over its edges in
    order), and on large graphs each policy's evaluation too (`_doubled`), so that the
    planner's thousands of steady-cycle prices (cost/steady_cycle.py: a 16-rank plan has graphs
    of hundreds of nodes, 128 ranks in 19 stages of up to 20 replicas tens of thousands) do not
    loop in Python."""
    solved = policy_iteration(edges)
    return solved.ratio, solved.cycle


@dataclass(frozen=True)
class Solved:
    """What `policy_iteration` ends with: `ratio` and `cycle` as `largest_cycle_ratio`'s, the
    edge each node follows (`policy`, an index into all the edges, node after node) and each
    node's number of edges (`degree`: a graph of the same shape can start from `policy`).
    `stopped`: it stopped at a policy whose cycle of `ratio` reaches `stop` (the graph's largest
    ratio is at least that)."""

    ratio: float
    cycle: list[int]
    policy: np.ndarray
    degree: np.ndarray
    stopped: bool = False


def policy_iteration(edges: Edges, *, start: Solved | None = None,
                     stop: float = math.inf) -> Solved:
    """`largest_cycle_ratio`, with what it ended on (`Solved`). `start`: another graph's
    result, whose policy this one starts from where every node has as many edges as there
    (else from each node's heaviest edge, as without it): a graph that differs from that one in
    a few edges' targets or tokens (the planner's deepening trials, cost/pipeline_time.py) then
    needs few improvements. Its cycle may differ from a cold start's where several cycles share
    the largest ratio (the ratio may then differ in its last bits): callers that need the cold
    start's cycle use a start only to decide. `stop`: end as soon as a policy has a cycle of
    ratio `stop` or more (`Solved.stopped`), which proves the graph's largest ratio at least
    that: a trial that had to beat `stop` fails without the remaining improvements."""
    degree = np.array([len(out) for out in edges])
    to, seconds, held = zip(*(edge for out in edges for edge in out), strict=True)
    return policy_iteration_on(degree, np.array(to, dtype=np.intp),
                               np.array(seconds, dtype=float), np.array(held, dtype=float),
                               start=start, stop=stop)


def policy_iteration_on(degree: np.ndarray, target: np.ndarray, weight: np.ndarray,
                        tokens: np.ndarray, *, start: Solved | None = None,
                        stop: float = math.inf) -> Solved:
    """`policy_iteration` on a graph given as arrays: every edge's target, weight and tokens,
    node after node (each node's edges in order), and each node's number of edges (`degree`);
    what a graph built on arrays (cost/steady_cycle.py) hands over without a list per node."""
    count = len(degree)
    first = np.cumsum(degree) - degree  # each node's first edge
    source = np.repeat(np.arange(count), degree)
    first_best = _first_best(degree, first)

    if start is not None and np.array_equal(start.degree, degree):
        policy = start.policy
    else:  # start from each node's heaviest edge: the slow circuits first, fewer improvements
        policy = first_best(weight)
    scale = float(np.max(np.abs(weight)))
    eps = 1e-12 * scale + 1e-300
    evaluate = _walked if count < WALKED_BELOW else _doubled

    def evaluated(chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Cycles]:
        return evaluate(target[chosen], weight[chosen], tokens[chosen])

    here, worth, cycles = evaluated(policy)
    for _ in range(8 * count + 64):
        if stop < math.inf and float(np.max(here)) >= stop:
            top = int(np.argmax(here))
            return Solved(float(here[top]), cycles.nodes(top), policy, degree, stopped=True)
        reached = here[target]
        # first a larger ratio, where any edge reaches one
        pick = first_best(reached)
        larger = reached[pick] > here + eps
        changed = bool(larger.any())
        if changed:
            policy = np.where(larger, pick, policy)
        else:  # then, among edges of the same ratio, a larger value
            with np.errstate(invalid="ignore"):
                ratio = here[source]
                same = np.abs(reached - ratio) <= eps
                gain = weight - ratio * tokens + worth[target]
                gain = np.where(same & ~np.isnan(gain), gain, -np.inf)
                pick = first_best(gain)
                # a value of -inf (a cycle without tokens ahead) gives NaN here: never better
                better = (gain[pick] > worth + eps * (1.0 + np.abs(worth))) & (pick != policy)
            changed = bool(better.any())
            if changed:
                policy = np.where(better, pick, policy)
        if not changed:
            break
        here, worth, cycles = evaluated(policy)
    top = int(np.argmax(here))  # the first node of the largest ratio
    return Solved(float(here[top]), cycles.nodes(top), policy, degree)


def _first_best(degree: np.ndarray, first: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A function giving per node its first edge of the largest of `values` (one per edge, node
    after node; no NaN among them): a node of one edge has it; of two (most events of a
    schedule's graph), the second where it is larger; of more, a reduction over their edges."""
    pairs = np.flatnonzero(degree == 2)
    second = first[pairs] + 1
    wide = np.flatnonzero(degree > 2)
    spans = degree[wide]
    starts = np.cumsum(spans) - spans  # each wide node's first edge among theirs
    index = np.arange(int(spans.sum()))
    edges = np.repeat(first[wide] - starts, spans) + index  # theirs, node after node
    owner = np.repeat(np.arange(len(wide)), spans)

    def first_best(values: np.ndarray) -> np.ndarray:
        out = first.copy()
        out[pairs] = np.where(values[second] > values[second - 1], second, second - 1)
        if len(wide):
            mine = values[edges]
            best = np.maximum.reduceat(mine, starts)
            out[wide] = edges[np.minimum.reduceat(
                np.where(mine == best[owner], index, len(index)), starts)]
        return out

    return first_best


class _Cycles:
    """The cycles of a policy: per node the root of the cycle it reaches, and the policy's
    steps to walk it."""

    def __init__(self, root: list[int] | np.ndarray, step: list[int] | np.ndarray) -> None:
        self.root = root
        self.step = step

    def nodes(self, node: int) -> list[int]:
        """The nodes of the cycle that `node` reaches, from its root on."""
        root, step = int(self.root[node]), self.step
        if isinstance(step, np.ndarray):
            step = step.tolist()
        cycle, u = [root], step[root]
        while u != root:
            cycle.append(u)
            u = step[u]
        return cycle


def _walked(step: np.ndarray, weight: np.ndarray,
            tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Cycles]:
    """Per node of the graph where node u follows one edge (to step[u], of weight[u] and
    tokens[u]): the ratio of the cycle it reaches, its value (weight less ratio x tokens to
    that cycle's root, 0 at the root) and the cycles, by walking from each node in turn: a
    cycle's root is where the walk from the smallest node reaching it enters it, its ratio
    sums its edges from there in order, and a value is the edge's own plus the next node's."""
    count = len(step)
    steps, weights, counts = step.tolist(), weight.tolist(), tokens.tolist()
    ratio, value, root = [0.0] * count, [0.0] * count, [0] * count
    state = [0] * count  # 0 not seen, 1 on the path being walked, 2 evaluated
    for origin in range(count):
        if state[origin]:
            continue  # evaluated from an earlier origin's path
        path, node = [], origin
        while state[node] == 0:
            state[node] = 1
            path.append(node)
            node = steps[node]
        if state[node] == 1:  # a new cycle, from `node`
            at = path.index(node)
            cycle = path[at:]
            total = held = 0.0  # in order, one addition at a time: Python 3.12's sum()
            for u in cycle:     # compensates its rounding, which numpy's cumsum does not
                total += weights[u]
                held += counts[u]
            eta = total / held if held > 0 else float("inf")
            for u in cycle:
                ratio[u], state[u], root[u] = eta, 2, node
            value[node] = 0.0
            for u in reversed(cycle[1:]):
                value[u] = weights[u] - eta * counts[u] + value[steps[u]]
            path = path[:at]
        for u in reversed(path):
            target = steps[u]
            ratio[u], root[u] = ratio[target], root[target]
            value[u] = weights[u] - ratio[u] * counts[u] + value[target]
            state[u] = 2
    return np.array(ratio), np.array(value), _Cycles(root, steps)


def _doubled(step: np.ndarray, weight: np.ndarray,
             tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Cycles]:
    """`_walked`'s figures to the last bit (the improvement steps' ties need them so), on
    arrays: every sum is taken in the walk's order (a cycle's weights from its root on, a
    value as the edge's own plus the next node's), and what the walk finds (each node's cycle,
    the smallest node reaching it, where that walk enters it, the edges from each node to its
    root) comes from pointer doubling: after k doublings each node knows the node 2^k edges
    ahead. Each doubling stops once it has what it needs (the nodes on cycles, each walk's
    entry), and those over the cycles run on their nodes alone (the planner's policies: 18,707
    events, 2,541 of them on 18 cycles, walks of at most 3 edges to a cycle)."""
    count = len(step)
    nodes = np.arange(count)
    # the nodes on cycles: those 2^k edges ahead of any node, once the policy maps them
    # one to one (it maps that set into itself; onto itself only when no walk's way in is left)
    ahead = step
    while True:
        on_cycle = np.zeros(count, dtype=bool)
        on_cycle[ahead] = True
        cyclic = np.flatnonzero(on_cycle)
        hit = np.zeros(count, dtype=bool)
        hit[step[cyclic]] = True
        if int(np.count_nonzero(hit)) == len(cyclic):
            break
        ahead = ahead[ahead]
    # where each walk enters its cycle, and its edges to there
    entry = np.where(on_cycle, nodes, step)
    tail = (~on_cycle).astype(np.intp)
    while not on_cycle[entry].all():
        tail = tail + tail[entry]
        entry = entry[entry]
    # on the cycles alone (`at`: a cycle node's place among them): each cycle's smallest node
    at = np.empty(count, dtype=np.intp)
    at[cyclic] = np.arange(len(cyclic))
    doublings = max(1, len(cyclic).bit_length())  # 2^doublings > the longest cycle
    ahead, least = at[step[cyclic]], cyclic.copy()
    for _ in range(doublings):
        least = np.minimum(least, least[ahead])
        ahead = ahead[ahead]
    label = least[at[entry]]
    labels, origins = np.unique(label, return_index=True)  # the smallest node reaching each
    roots = entry[origins]
    # on a cycle, the edges ahead to its root
    ahead = at[step[cyclic]]
    ahead[at[roots]] = at[roots]
    around = np.ones(len(cyclic), dtype=np.intp)
    around[at[roots]] = 0
    for _ in range(doublings):
        around = around + around[ahead]
        ahead = ahead[ahead]
    ratio_of = np.empty(count)
    value = np.empty(count)
    # each cycle's nodes from its root on: by label, then the edges to the root, fewest last
    ordered = cyclic[np.lexsort((-around, label[cyclic]))]
    bounds = np.flatnonzero(np.diff(label[ordered])) + 1
    with np.errstate(invalid="ignore", over="ignore"):
        for name, cycle in zip(labels.tolist(), np.split(ordered, bounds), strict=True):
            cycle = np.concatenate((cycle[-1:], cycle[:-1]))  # the root (none to itself) first
            total = float(np.cumsum(weight[cycle])[-1])
            held = float(np.cumsum(tokens[cycle])[-1])
            eta = total / held if held > 0 else float("inf")
            ratio_of[name] = eta
            # values back from the root: each the edge's own plus the next node's
            back = cycle[:0:-1]
            value[cycle[0]] = 0.0
            value[back] = np.cumsum(weight[back] - eta * tokens[back])
        ratio = ratio_of[label]
        # off the cycles, level by level away from them
        deepest = int(tail.max())
        if deepest:
            own = weight - ratio * tokens
            if deepest <= 16:  # few levels: each one's nodes found directly
                levels = [np.flatnonzero(tail == depth) for depth in range(1, deepest + 1)]
            else:
                off = np.flatnonzero(~on_cycle)
                off = off[np.argsort(tail[off], kind="stable")]
                ends = np.cumsum(np.bincount(tail[off])).tolist()
                levels = [off[start:end] for start, end in zip(ends[:-1], ends[1:], strict=True)]
            for level in levels:
                value[level] = own[level] + value[step[level]]
    root_of = np.empty(count, dtype=np.intp)
    root_of[labels] = roots
    return ratio, value, _Cycles(root_of[label], step)


__all__ = ["Edges", "Solved", "largest_cycle_ratio", "policy_iteration",
           "policy_iteration_on"]
