"""Tied parameters across stages: the all-reduce that keeps their copies equal, priced.

A parameter read by nodes that a plan puts on several stages (a language model's token
embedding, read again by its output head) is copied into each of those stages by the split
(passes/split.py). At every update the runtime sums the copies' gradients over the ranks
holding them: one all-reduce per group of stages sharing ties, inside the update before the
optimizer steps (`StageRuntime.reduce_tie`; a rank holding several of the stages joins once,
runtime/rank_ties.py). Ranks reach it at their own update, so the first to arrive waits for
the others.

The CostGraph lists the parameters read by several of its nodes in its `ties` attribute, each
`{"bytes": ..., "nodes": [...]}` (cost/node_costs.py `to_cost_graph`; node names may be
members of fused blocks; the first is the reader whose `params` count the bytes, since the
CostGraph counts a parameter once). Here: which stages share them under a plan
(`shared_weights`), the bytes of the copies that the other holders keep (`copied_bytes`: each
is a whole parameter with its gradient, optimizer state and stashed versions, which the
stages' parameter bytes must count), and the seconds of their all-reduce, a ring over the
union of those stages' ranks on the slowest level it spans (cost/links.py
`stage_allreduce_seconds`, the formula of a replicated stage's all-reduce): 0 where one rank
holds every copy. The simulator (backends/action_costs.py) and
the closed form (cost/pipeline_time.py `stage_terms`) both price the update with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.cost.costgraph import topological_order
from pdcompile.cost.links import stage_allreduce_seconds
from pdcompile.machine.cluster import Cluster


@dataclass(frozen=True)
class SharedWeights:
    """Tied parameters shared by `stages` (sorted, at least two): `nbytes` in all, all-reduced
    together at each update, as the runtime groups them by the stages sharing them."""

    stages: tuple[int, ...]
    nbytes: float

    def ranks(self, stage_ranks: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The ranks joining the all-reduce: every rank of every sharing stage, once."""
        return tuple(sorted({r for s in self.stages for r in stage_ranks[s]}))

    def seconds(self, stage_ranks: Sequence[Sequence[int]], cluster: Cluster) -> float:
        """One all-reduce of the tied gradients over `ranks` (0 where one rank holds them)."""
        return stage_allreduce_seconds(self.nbytes, self.ranks(stage_ranks), cluster)


def shared_weights(graph: Any, stage_of: dict[str, int]) -> tuple[SharedWeights, ...]:
    """The CostGraph's ties that `stage_of` (node -> stage, every node) puts on several
    stages, grouped by the stages sharing them; () for a graph without ties."""
    ties = graph.graph.get("ties", ())
    if not ties:
        return ()
    block_of = {member: node for node, data in graph.nodes(data=True)
                for member in data.get("members", [node])}
    groups: dict[tuple[int, ...], float] = {}
    for tie in ties:
        stages = tuple(sorted({stage_of[block_of[n]] for n in tie["nodes"] if n in block_of}))
        if len(stages) > 1:
            groups[stages] = groups.get(stages, 0.0) + float(tie["bytes"])
    return tuple(SharedWeights(stages, nbytes) for stages, nbytes in sorted(groups.items()))


def updates_apart(ties: Sequence[SharedWeights], replicas: Sequence[int],
                  flush: bool) -> SharedWeights | None:
    """The first tie whose stages update a different number of times, or None. Outside flush
    schedules a replica updates once per round of its stage's replicas, so stages sharing a
    tie on unequal replicas leave update k of one rank without a partner on the other: the
    runtime refuses such a plan and the simulator raises (backends/tie_updates.py); a planner
    pricing by the closed form alone must not return it either."""
    if flush:
        return None
    return next((tie for tie in ties if len({replicas[s] for s in tie.stages}) > 1), None)


def copied_bytes(graph: Any, stage_of: dict[str, int], stages: int) -> list[float]:
    """Per stage, the bytes of tied parameters it holds a copy of but the CostGraph counts at
    another stage: that of the tie's owner (`tie_owners`: its first reader, whose node's
    `params` hold them). The split gives every stage reading a tie a copy of its own
    (passes/split.py; on one rank too, runtime/rank_ties.py), so each such stage keeps those
    bytes, their gradient, optimizer state and weight versions as it keeps its own parameters'.
    Zeros for a graph without ties."""
    out = [0.0] * stages
    ties = graph.graph.get("ties", ())
    if not ties:
        return out
    block_of = _block_of(graph)
    for tie, owner in zip(ties, _owners(graph, block_of), strict=True):
        if owner is None:
            continue
        counted = stage_of[owner]
        for stage in sorted({stage_of[block_of[n]] for n in tie["nodes"] if n in block_of}
                            - {counted}):
            out[stage] += float(tie["bytes"])
    return out


@dataclass(frozen=True)
class TieReaders:
    """One tie as the nodes of a graph reading it, for planners that place nodes one by one:
    `owner` is the node whose `params` count the tie's `nbytes` (`tie_owners`); a stage
    holding one of `others` but not `owner` keeps a copy (`copied_bytes`)."""

    nbytes: float
    owner: str
    others: tuple[str, ...]


def tie_owners(graph: Any) -> list[str | None]:
    """Per tie of the CostGraph, the node (block) whose `params` count its bytes: its first
    reader's, or where that one is not in the graph (a graph cut from a larger one), its reader
    first in topological order; None for a tie none of whose readers is in the graph. The one
    rule that `copied_bytes`, `tie_readers`, the DP's tables (planner/dp.py `state_tables`)
    and CP-SAT's model follow."""
    return _owners(graph, _block_of(graph))


def _block_of(graph: Any) -> dict[str, str]:
    """Every node name of the graph's blocks' members (and the blocks'): its block."""
    return {member: node for node, data in graph.nodes(data=True)
            for member in data.get("members", [node])}


def _owners(graph: Any, block_of: dict[str, str]) -> list[str | None]:
    """`tie_owners`, with the graph's `_block_of`; the topological order only where a first
    reader is missing (it costs a sort of the graph, and the pricing asks for every plan)."""
    position: dict[str, int] = {}
    out: list[str | None] = []
    for tie in graph.graph.get("ties", ()):
        first = tie["nodes"][0] if tie["nodes"] else None
        if first in block_of:
            out.append(block_of[first])
            continue
        blocks = {block_of[n] for n in tie["nodes"] if n in block_of}
        if blocks and not position:
            position = {node: i for i, node in enumerate(topological_order(graph))}
        out.append(min(blocks, key=position.__getitem__) if blocks else None)
    return out


def tie_readers(graph: Any) -> tuple[TieReaders, ...]:
    """The CostGraph's ties as its nodes (blocks) reading them, each reader once, in
    topological order after the owner (`tie_owners`); ties read by one node only, or by none
    of the graph's, are left out."""
    ties = graph.graph.get("ties", ())
    if not ties:
        return ()
    block_of = _block_of(graph)
    position: dict[str, int] = {}
    out = []
    for tie, owner in zip(ties, _owners(graph, block_of), strict=True):
        blocks = {block_of[n] for n in tie["nodes"] if n in block_of}
        if len(blocks) < 2 or owner is None:
            continue
        if not position:
            position = {node: i for i, node in enumerate(topological_order(graph))}
        others = tuple(sorted(blocks - {owner}, key=position.__getitem__))
        out.append(TieReaders(float(tie["bytes"]), owner, others))
    return tuple(out)


def stage_tie_seconds(ties: Sequence[SharedWeights], stage_ranks: Sequence[Sequence[int]],
                      cluster: Cluster) -> list[float]:
    """Per stage, the seconds of the tie all-reduces it joins at each update."""
    out = [0.0] * len(stage_ranks)
    for tie in ties:
        seconds = tie.seconds(stage_ranks, cluster)
        for s in tie.stages:
            out[s] += seconds
    return out


def rank_tie_seconds(ties: Sequence[SharedWeights], stage_ranks: Sequence[Sequence[int]],
                     cluster: Cluster) -> dict[int, float]:
    """Per rank, the seconds of the tie all-reduces it joins at each update (a rank holding
    several of a tie's stages joins it once); ranks that join none are left out."""
    out: dict[int, float] = {}
    for tie in ties:
        seconds = tie.seconds(stage_ranks, cluster)
        if seconds > 0.0:
            for rank in tie.ranks(stage_ranks):
                out[rank] = out.get(rank, 0.0) + seconds
    return out


def tie_partners(ties: Sequence[SharedWeights],
                 stage_ranks: Sequence[Sequence[int]]) -> dict[int, set[int]]:
    """Per rank, the other ranks it all-reduces tied gradients with at each update."""
    out: dict[int, set[int]] = {}
    for tie in ties:
        ranks = tie.ranks(stage_ranks)
        if len(ranks) > 1:
            for rank in ranks:
                out.setdefault(rank, set()).update(r for r in ranks if r != rank)
    return out


__all__ = ["SharedWeights", "TieReaders", "copied_bytes", "rank_tie_seconds", "shared_weights",
           "stage_tie_seconds", "tie_owners", "tie_partners", "tie_readers"]
