"""PipeDream's antichain linearisation of a DAG (Narayanan et al., SOSP 2019, section 3.1).

A branching graph cannot be cut by a single index, so PipeDream plans over *states*: each state is
a downset (a set of nodes closed under predecessors) named by its antichain of maximal nodes. A
stage is the difference of two nested states, which is always convex (no edge leaves it and comes
back). The states are generated as PipeDream does: start from the first source, and repeatedly
replace a node of the *augmented* antichain (the antichain plus the ancestors whose outputs are
still needed outside their own branch) by one of its successors. The augmented antichain's output
bytes are what PipeDream charges for a cut there.

Downsets are Python ints used as bitsets over the nodes in topological order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import networkx as nx

from pdcompile.cost.costgraph import topological_order, validate
from pdcompile.errors import CostGraphError


@dataclass(frozen=True)
class AntichainStates:
    """The states of a graph, sorted by downset size; state 0 is the empty set, the last is all.

    `downsets[s]`: bitset of nodes (bit i = `order[i]`) in state s. `frontier[s]`: node indices of
    the augmented antichain (PipeDream's `states[s].antichain`). `reach[s]`: bitset over states of
    the states from which s is reachable in PipeDream's antichain DAG (the empty state reaches all).
    """

    order: tuple[str, ...]
    downsets: tuple[int, ...]
    frontier: tuple[tuple[int, ...], ...]
    reach: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.downsets)

    def members(self, state: int) -> list[int]:
        """Node indices in a state's downset."""
        bits, out, i = self.downsets[state], [], 0
        while bits:
            if bits & 1:
                out.append(i)
            bits >>= 1
            i += 1
        return out

    def stage_nodes(self, before: int, after: int) -> list[str]:
        """Node ids of the stage between two nested states, in topological order."""
        bits = self.downsets[after] & ~self.downsets[before]
        return [self.order[i] for i in range(len(self.order)) if bits >> i & 1]


def antichain_states(graph: nx.DiGraph, *, complete: bool = False,
                     max_states: int = 20000) -> AntichainStates:
    """Enumerate PipeDream's antichain states of `graph` (see the module docstring).

    With `complete=True`, every downset instead (so that a DP over them is exact over all convex
    stage sequences; PipeDream's generation can miss some). `reach` is then the strict-subset
    relation. Raises CostGraphError when the graph has more than `max_states` states (coarsen it
    first).
    """
    validate(graph)
    order = tuple(topological_order(graph))
    index = {node: i for i, node in enumerate(order)}
    n = len(order)
    succ = [[index[v] for v in graph.successors(u)] for u in order]
    pred = [[index[u] for u in graph.predecessors(v)] for v in order]
    anc = [0] * n  # strict ancestors
    for v in range(n):
        for u in pred[v]:
            anc[v] |= anc[u] | (1 << u)
    desc = [0] * n  # strict descendants
    for u in reversed(range(n)):
        for v in succ[u]:
            desc[u] |= desc[v] | (1 << v)
    out_bits = [sum(1 << v for v in succ[u]) for u in range(n)]

    # leaky[a]: ancestors of a that feed something outside a's own ancestry (PipeDream's
    # "extra nodes" of an augmented antichain, which depend only on each antichain member)
    leaky: dict[int, int] = {}

    def leaky_of(a: int) -> int:
        if a not in leaky:
            keep, found = anc[a] | (1 << a), 0
            for p in _bit_list(anc[a]):
                if out_bits[p] & ~keep:
                    found |= 1 << p
            leaky[a] = found
        return leaky[a]

    def augment(antichain: frozenset[int]) -> tuple[int, ...]:
        bits = 0
        for a in antichain:
            bits |= leaky_of(a) | (1 << a)
        return _bit_list(bits)

    def deaugment(nodes: list[int]) -> frozenset[int]:
        present = 0
        for x in nodes:
            present |= 1 << x
        return frozenset(x for x in nodes if not desc[x] & present)

    if complete:
        return _all_downsets(graph, order, pred, succ, max_states)
    sources = [i for i in range(n) if not pred[i]]
    first = [index[node] for node in graph.nodes if not pred[index[node]]][0] if sources else 0
    start = frozenset([first])
    augmented: dict[frozenset[int], tuple[int, ...]] = {start: augment(start)}
    parents: dict[frozenset[int], set[frozenset[int]]] = {start: set()}
    queue: deque[frozenset[int]] = deque([start])
    expanded: set[frozenset[int]] = set()
    while queue:
        antichain = queue.popleft()
        if antichain in expanded:
            continue
        expanded.add(antichain)
        aug = augmented[antichain]
        aug_bits = sum(1 << x for x in aug)
        for x in aug:
            for y in succ[x]:
                if y in antichain or desc[y] & aug_bits:
                    continue
                nxt = deaugment([y if z == x else z for z in aug])
                if nxt not in augmented:
                    if len(augmented) >= max_states:
                        raise CostGraphError(
                            f"graph {graph.graph.get('name', '')!r} has more than {max_states} "
                            "antichain states; coarsen it first (costgraph.coarsen) or use the "
                            "CP-SAT planner")
                    augmented[nxt] = augment(nxt)
                    parents[nxt] = set()
                parents[nxt].add(antichain)
                queue.append(nxt)

    def downset(antichain: frozenset[int]) -> int:
        bits = 0
        for a in antichain:
            bits |= anc[a] | (1 << a)
        return bits

    keyed = sorted(augmented, key=lambda a: (bin(downset(a)).count("1"), sorted(a)))
    position = {a: i + 1 for i, a in enumerate(keyed)}
    downsets = [0] + [downset(a) for a in keyed]
    frontier: list[tuple[int, ...]] = [()] + [augmented[a] for a in keyed]
    reach = [0] * (len(keyed) + 1)
    for a in keyed:
        s = position[a]
        bits = 1  # the empty state precedes everything
        for p in parents[a]:
            bits |= reach[position[p]] | (1 << position[p])
        reach[s] = bits
    full = (1 << n) - 1
    if downsets[-1] != full:
        return _with_prefixes(graph, order, downsets, frontier, succ, max_states)
    return AntichainStates(order=order, downsets=tuple(downsets), frontier=tuple(frontier),
                           reach=tuple(reach))


def _with_prefixes(graph: nx.DiGraph, order: tuple[str, ...], downsets: list[int],
                   frontier: list[tuple[int, ...]], succ: list[list[int]],
                   max_states: int) -> AntichainStates:
    """Where the generation stopped short of the whole graph (it starts from one source, and no
    antichain joins several sinks: a read of the input's shape that only an assert uses, a
    second source's branch), the states it found joined by the prefixes of the topological
    order, everything among them, each reachable from every state it strictly contains.
    A final state of everything alone left the DP a jump from the first branch's states to
    the whole graph: a 4-block eva02 (timm, 112 px) in 4 stages put its whole model on the last
    stage (4.0 ms a minibatch, where one block per stage is 2.7 ms by the planner's own price)."""
    n = len(order)
    fronts = dict(zip(downsets, frontier, strict=True))
    fronts.setdefault((1 << n) - 1, tuple(i for i in range(n) if not succ[i]))  # its sinks
    joined = sorted(set(downsets) | {(1 << i) - 1 for i in range(n + 1)},
                    key=lambda bits: (bin(bits).count("1"), bits))
    if len(joined) > max_states:
        raise _too_many(graph, max_states)
    fronts_all = [fronts[bits] if bits in fronts else _out_frontier(bits, succ)
                  for bits in joined]
    return AntichainStates(order=order, downsets=tuple(joined), frontier=tuple(fronts_all),
                           reach=_strict_subsets(joined, n))


def _too_many(graph: nx.DiGraph, max_states: int) -> CostGraphError:
    return CostGraphError(
        f"graph {graph.graph.get('name', '')!r} has more than {max_states} antichain states; "
        "coarsen it first (costgraph.coarsen) or use the CP-SAT planner")


def _bit_list(bits: int) -> tuple[int, ...]:
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return tuple(out)


def _all_downsets(graph: nx.DiGraph, order: tuple[str, ...], pred: list[list[int]],
                  succ: list[list[int]], max_states: int) -> AntichainStates:
    n = len(order)
    need = [sum(1 << u for u in pred[v]) for v in range(n)]
    sources = sum(1 << v for v in range(n) if not pred[v])
    out_bits = [sum(1 << v for v in succ[u]) for u in range(n)]
    # each downset with the union of its nodes' successors: its only possible growth points
    seen = {0}
    frontier_sets = [(0, sources)]
    while frontier_sets:
        nxt = []
        for bits, grows in frontier_sets:
            for v in _bit_list(grows & ~bits):
                if need[v] & bits == need[v]:
                    grown = bits | (1 << v)
                    if grown not in seen:
                        if len(seen) >= max_states:
                            raise _too_many(graph, max_states)
                        seen.add(grown)
                        nxt.append((grown, grows | out_bits[v]))
        frontier_sets = nxt
    downsets = sorted(seen, key=lambda b: (bin(b).count("1"), b))
    frontier = [_out_frontier(bits, succ) for bits in downsets]
    return AntichainStates(order=order, downsets=tuple(downsets), frontier=tuple(frontier),
                           reach=_strict_subsets(downsets, n))


def _out_frontier(bits: int, succ: list[list[int]]) -> tuple[int, ...]:
    """The nodes of a downset with a successor outside it: what its stage boundary sends."""
    return tuple(u for u in range(len(succ)) if bits >> u & 1
                 and any(not bits >> v & 1 for v in succ[u]))


def _strict_subsets(downsets: list[int], n: int) -> tuple[int, ...]:
    """For each set, the bitset (over the list) of the sets strictly inside it."""
    import numpy as np

    width = (n + 7) // 8
    member = np.unpackbits(
        np.frombuffer(b"".join(d.to_bytes(width, "little") for d in downsets), dtype=np.uint8)
        .reshape(len(downsets), width), axis=1, bitorder="little")[:, :n].astype(np.float32)
    outside = (member @ (1.0 - member).T) == 0  # [k, j]: k has nothing outside j
    np.fill_diagonal(outside, False)
    packed = np.packbits(outside.T, axis=1, bitorder="little")  # row j: bits k
    return tuple(int.from_bytes(row.tobytes(), "little") for row in packed)


def prefix_states(graph: nx.DiGraph, *, most: int | None = None) -> AntichainStates:
    """The prefixes of one topological order as states: a linearisation that has len(graph) + 1
    states (stages are then runs of consecutive nodes in that order). A fallback for graphs too
    branched for `antichain_states`; it may miss the best plan. With `most`, at most that many
    states: the empty one, everything, and the prefixes that cut the order where they spread
    its compute most evenly (every node weighing at least 1% of an average node, so that
    graphs without compute are cut evenly by count)."""
    validate(graph)
    order = tuple(topological_order(graph))
    index = {node: i for i, node in enumerate(order)}
    n = len(order)
    cuts = list(range(n + 1))
    if most is not None and n + 1 > most:
        import numpy as np

        work = np.array([float(graph.nodes[x]["fwd"]) + float(graph.nodes[x]["bwd"])
                         for x in order])
        work = work + max(float(work.sum()), 1.0) / (100.0 * n)
        ends = np.cumsum(work)  # ends[i - 1]: the work of the prefix of i nodes
        targets = ends[-1] * np.arange(1, max(most, 2) - 1) / (max(most, 2) - 1)
        inner = np.unique(np.clip(np.searchsorted(ends, targets) + 1, 1, n - 1))
        cuts = [0, *(int(i) for i in inner if 0 < i < n), n]
    downsets = [(1 << i) - 1 for i in cuts]
    last_use = [max((index[v] for v in graph.successors(u)), default=-1) for u in order]
    frontier = [tuple(u for u in range(i) if last_use[u] >= i) for i in cuts]
    reach = [(1 << s) - 1 for s in range(len(cuts))]
    return AntichainStates(order=order, downsets=tuple(downsets), frontier=tuple(frontier),
                           reach=tuple(reach))
