"""PipeDream's augmented antichain of a downset, for pricing plans under the original's cost model.

The original charges a cut between stages the output bytes of the cut's augmented antichain: the
downset's maximal nodes, plus each maximal node's ancestors that feed something outside that
node's own ancestry (antichain.py generates states the same way). Pricing a plan asks this for
every stage boundary, so it is computed here once per graph over numpy arrays: each node's
ancestors as a bitset, the edges as index arrays, and the ancestors that leak past a maximal node
cached per node. A boundary then costs a few passes over the edges, not a graph search per node.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
import numpy as np

from pdcompile.cost.costgraph import topological_order


class AugmentedFrontiers:
    """The augmented antichains of the downsets of one graph (nodes named as in the graph)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.order = tuple(topological_order(graph))
        index = {node: i for i, node in enumerate(self.order)}
        self.index = index
        n = len(self.order)
        edges = [(index[u], index[v]) for u, v in graph.edges]
        self.tail = np.array([u for u, _ in edges], dtype=np.int64)
        self.head = np.array([v for _, v in edges], dtype=np.int64)
        self.ancestors: list[int] = [0] * n  # strict ancestors of each node, as a bitset
        for v in range(n):
            bits = 0
            for u in graph.predecessors(self.order[v]):
                i = index[u]
                bits |= self.ancestors[i] | (1 << i)
            self.ancestors[v] = bits
        self._leaky: dict[int, np.ndarray] = {}

    def _ancestor_mask(self, node: int) -> np.ndarray:
        n = len(self.order)
        raw = self.ancestors[node].to_bytes((n + 7) // 8, "little")
        return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n].astype(bool)

    def leaky(self, node: int) -> np.ndarray:
        """The ancestors of `node` with a successor outside its ancestry (node included)."""
        if node not in self._leaky:
            strict = self._ancestor_mask(node)
            keep = strict.copy()
            keep[node] = True
            self._leaky[node] = np.unique(self.tail[strict[self.tail] & ~keep[self.head]])
        return self._leaky[node]

    def frontier(self, member: np.ndarray) -> np.ndarray:
        """Node indices (topological order) of the augmented antichain of the downset whose
        nodes are `member` (a bool array over `order`)."""
        inside = np.bincount(self.tail[member[self.head]], minlength=len(self.order))
        maximal = np.flatnonzero(member & (inside == 0))
        parts = [maximal, *(self.leaky(int(a)) for a in maximal)]
        return np.unique(np.concatenate(parts))

    def of(self, downset: Iterable[str]) -> set[str]:
        """The augmented antichain of a downset given by node names."""
        member = np.zeros(len(self.order), dtype=bool)
        member[[self.index[x] for x in downset]] = True
        return {self.order[i] for i in self.frontier(member)}


def augmented_frontier(graph: nx.DiGraph, downset: Iterable[str]) -> set[str]:
    """PipeDream's augmented antichain of a downset of `graph` (one-off: see
    AugmentedFrontiers for many downsets of one graph)."""
    return AugmentedFrontiers(graph).of(downset)


__all__ = ["AugmentedFrontiers", "augmented_frontier"]
