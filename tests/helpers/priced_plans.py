"""Random graphs where one output feeds several later nodes, and random convex plans of them
with replicated stages on two-level clusters (the pricing consistency tests)."""

from __future__ import annotations

import networkx as nx
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph, topological_order
from pdcompile.plan import Plan, Stage


@st.composite
def fanned_graphs(draw: st.DrawFn) -> nx.DiGraph:
    """A chain of 3-8 blocks behind an input, with extra edges that skip ahead: one node's
    output read by several later nodes, often of one later stage."""
    n = draw(st.integers(3, 8))
    graph = new_cost_graph("fanned")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=draw(st.floats(1e5, 1e7)), params=0.0)
    for i in range(n):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-3, 1e-2)),
                  bwd=draw(st.floats(1e-3, 2e-2)), act=draw(st.floats(1e5, 5e7)),
                  params=draw(st.floats(0, 1e8)))
    graph.add_edge("x", "n0")
    for j in range(1, n):
        graph.add_edge(f"n{j - 1}", f"n{j}")
        for i in draw(st.lists(st.integers(0, max(0, j - 2)), max_size=2, unique=True)):
            if i < j - 1:
                graph.add_edge(f"n{i}", f"n{j}")
    return graph


@st.composite
def plans(draw: st.DrawFn, graph: nx.DiGraph) -> tuple[Plan, Cluster]:
    """A random convex plan of `graph` with replicated stages on a two-level cluster."""
    cluster = Cluster.parse(draw(st.sampled_from(["2x2@1e10,1e9~5us,20us",
                                                  "2x3@1e10,1e8~5us,20us",
                                                  "4x2@1e9,1e8~5us,20us"])))
    order = topological_order(graph)
    count = draw(st.integers(1, min(4, len(order) - 1)))
    cuts = sorted(draw(st.lists(st.integers(2, len(order) - 1), min_size=count - 1,
                                max_size=count - 1, unique=True)))
    replicas = [1] * count
    for _ in range(draw(st.integers(0, cluster.workers - count))):
        replicas[draw(st.integers(0, count - 1))] += 1
    bounds = [0, *cuts, len(order)]
    stages, rank = [], 0
    for i, r in enumerate(replicas):
        stages.append(Stage(tuple(order[bounds[i]:bounds[i + 1]]), r,
                            tuple(range(rank, rank + r))))
        rank += r
    return Plan(stages=tuple(stages), time_per_minibatch=0.0, dp_time=0.0, workers=rank), \
        cluster
