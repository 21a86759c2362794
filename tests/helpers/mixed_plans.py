"""Every plan of a small chain on a small mixed cluster of two servers, one device kind each:
the brute force that the mixed planner is held to.

Independent of planner/mixed.py's candidates: stages are contiguous runs of the chain (the
input in the first), and each stage takes any number of each server's ranks (ranks of one
server are alike, so which ones does not matter: each stage takes the next free ones), not
every rank need be used. Each plan is priced by `price_plan` (the simulator) with its
replicas taking microbatches in turn, and again with shares in proportion to speed where a
stage mixes kinds (`with_shares`); the cheapest that fits every rank's memory wins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import networkx as nx
from hypothesis import strategies as st

from pdcompile.cost.costgraph import add_block, new_cost_graph, topological_order
from pdcompile.errors import PlanError, ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.planner.mixed import with_shares
from pdcompile.planner.simulation import simulate_plan

Block = tuple[float, float, float, float]  # fwd, bwd, activation bytes, parameter bytes


def block_chain(source: float, blocks: list[Block]) -> nx.DiGraph:
    """An input of `source` bytes, then one block per entry of `blocks`, in a chain."""
    graph = new_cost_graph("chain")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=source, params=0.0)
    for i, (fwd, bwd, act, params) in enumerate(blocks):
        add_block(graph, f"n{i}", fwd=fwd, bwd=bwd, act=act, params=params)
        graph.add_edge("x" if i == 0 else f"n{i - 1}", f"n{i}")
    return graph


def block_lists(most: int) -> st.SearchStrategy[list[Block]]:
    """2 to `most` blocks of 1-10 ms forward, 1-20 ms backward, up to 100 MB of activations and
    of parameters."""
    return st.lists(st.tuples(st.floats(1e-3, 1e-2), st.floats(1e-3, 2e-2), st.floats(1e5, 1e8),
                              st.floats(0.0, 1e8)), min_size=2, max_size=most)


def fast_and_slow(network: str, slow: float) -> Cluster:
    """Two fast ranks then two `slow` times as fast (one server each on two levels)."""
    return Cluster(levels=Cluster.parse(network).levels,
                   groups=(DeviceGroup(DEVICES["a100"], 2, 1.0),
                           DeviceGroup(DEVICES["a100"], 2, slow)))


def _takes(stages: int, fast: int, slow: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Per stage (fast ranks, slow ranks), at least one each, at most the servers' ranks."""
    options = [(a, b) for a in range(fast + 1) for b in range(slow + 1) if a + b]
    for takes in itertools.product(options, repeat=stages):
        if sum(a for a, _ in takes) <= fast and sum(b for _, b in takes) <= slow:
            yield takes


def every_plan(graph: nx.DiGraph, cluster: Cluster, *, schedule: str,
               microbatches: int) -> Iterator[Plan]:
    """Every plan of the chain `graph` (its first node the input) on `cluster`: two groups,
    group 0's ranks first."""
    order = topological_order(graph)
    fast, slow = (cluster.groups[g].workers for g in (0, 1))
    for count in range(1, len(order)):
        for cuts in itertools.combinations(range(2, len(order)), count - 1):
            bounds = (0, *cuts, len(order))
            for takes in _takes(count, fast, slow):
                nxt = [0, fast]
                stages = []
                for i, (a, b) in enumerate(takes):
                    ranks = (*range(nxt[0], nxt[0] + a), *range(nxt[1], nxt[1] + b))
                    nxt = [nxt[0] + a, nxt[1] + b]
                    stages.append(Stage(tuple(order[bounds[i]:bounds[i + 1]]), len(ranks),
                                        ranks))
                yield Plan(stages=tuple(stages), time_per_minibatch=0.0, dp_time=0.0,
                           workers=max(r for s in stages for r in s.ranks) + 1,
                           schedule=schedule, microbatches=microbatches)


def tied_block_chain(source: float, blocks: list[Block], tie: float) -> nx.DiGraph:
    """`block_chain` with a parameter of `tie` bytes read by the first and the last block (an
    embedding read again by the output head), counted in the first block's `params`."""
    graph = block_chain(source, blocks)
    first, last = "n0", f"n{len(blocks) - 1}"
    graph.nodes[first]["params"] = float(graph.nodes[first]["params"]) + tie
    graph.graph["ties"] = [{"bytes": tie, "nodes": [first, last]}]
    return graph


def runs(graph: nx.DiGraph, plan: Plan, cluster: Cluster) -> bool:
    """Whether the simulator runs `plan` (it refuses stages sharing a tie that update a
    different number of times, as the runtime does)."""
    try:
        simulate_plan(graph, plan, cluster, timeline=False)
    except ScheduleError:
        return False
    return True


def fastest_plan(graph: nx.DiGraph, cluster: Cluster, *, schedule: str,
                 microbatches: int) -> Plan | None:
    """The cheapest of `every_plan`, round robin or with shares, that fits and runs (None:
    none does)."""
    best: Plan | None = None
    tied = bool(graph.graph.get("ties"))
    for plan in every_plan(graph, cluster, schedule=schedule, microbatches=microbatches):
        shared = with_shares(plan, cluster)
        for candidate in (plan,) if shared is None else (plan, shared):
            if tied and not runs(graph, candidate, cluster):
                continue
            try:
                priced = price_plan(graph, candidate, cluster, simulate=True)
            except PlanError:
                continue
            if priced.extra.get("fits", True) and math.isfinite(priced.time_per_minibatch) \
                    and (best is None or priced.time_per_minibatch < best.time_per_minibatch):
                best = priced
    return best


WITHIN = 1.10  # the mixed planner's plan at most this many times the fastest plan
NETWORKS = ["2x2@1e11,1e9~5us,20us", "2x2@1e11,1e10~5us,20us", "4@1e9~5us", "4@1e10~5us"]
