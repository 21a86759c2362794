"""Hypothesis strategies for the planner's tests: tiny random DAGs and small clusters (flat,
or two servers of two; some with DDP's bucketed all-reduce)."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph


def _whole_bytes(draw: st.DrawFn, most: int) -> float:
    """A tensor's size: whole bytes. A float draw gave activations of 1.4e-228 bytes, which
    the DP's cumulative sums round to nothing sent while the objective of the same plan sent a
    message and charged its two latencies (the same as the edges' bytes below)."""
    return float(draw(st.integers(0, most)))


@st.composite
def small_dags(draw: st.DrawFn, max_nodes: int = 6) -> nx.DiGraph:
    """Random DAGs (edges only from lower to higher index), sometimes with an input node."""
    n = draw(st.integers(1, max_nodes) | st.integers(3, max_nodes))
    graph = new_cost_graph("random")
    with_input = draw(st.booleans()) and n >= 2
    for i in range(n):
        if with_input and i == 0:
            # an input; its forward time (data loading in PipeDream profiles) is not compute
            add_block(graph, "n0", fwd=draw(st.sampled_from([0.0, 5e-3])), bwd=0.0,
                      act=_whole_bytes(draw, 50_000_000), params=0.0)
            continue
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-4, 1e-2)), bwd=draw(st.floats(1e-4, 2e-2)),
                  act=_whole_bytes(draw, 50_000_000),
                  params=draw(st.floats(0, 1e6) | st.floats(0, 1e8)))
    for j in range(1, n):
        parents = draw(st.lists(st.integers(0, j - 1), max_size=2, unique=True))
        if not parents and draw(st.booleans()):
            parents = [j - 1]
        for i in parents:
            if draw(st.booleans()):  # whole bytes: a tensor is never 6.5e-156 bytes (that
                # drew a message one side charged two latencies for and the other did not)
                graph.add_edge(f"n{i}", f"n{j}", bytes=float(draw(st.integers(0, 50_000_000))))
            else:
                graph.add_edge(f"n{i}", f"n{j}")
    return graph


def _cluster(workers: int | str, bandwidth: str, latency: str, cpu_copies: bool,
             bucket: float | None) -> Cluster:
    """A flat cluster, or "2x2": two servers of two whose interface is a quarter of the inner
    link (shared by a server's flows); with `cpu_copies` its links are loopback, where senders
    copy by CPU; with `bucket` its replicas all-reduce gradients in buckets of that many bytes
    during the backward (PyTorch DDP: `Cluster.allreduce_bucket`)."""
    if workers == "2x2":
        cluster = Cluster.parse(f"2x2@{bandwidth},{float(bandwidth) / 4}~{latency},{latency}")
    else:
        cluster = Cluster.parse(f"{workers}@{bandwidth}~{latency}")
    return replace(cluster, levels=tuple(replace(lv, cpu_copies=cpu_copies)
                                         for lv in cluster.levels), allreduce_bucket=bucket)


clusters = st.builds(
    _cluster,
    st.sampled_from([1, 2, 3, 3, 4, 4, "2x2"]), st.sampled_from(["1e8", "1e9", "1e10"]),
    st.sampled_from(["0", "20us"]), st.booleans(), st.sampled_from([None, None, 1e6, 2.5e7]),
)
# one level: the original optimizer's hierarchical recurrence prices a flat cluster only as the
# brute force does
flat_clusters = st.builds(
    _cluster,
    st.sampled_from([1, 2, 3, 3, 4, 4]), st.sampled_from(["1e8", "1e9", "1e10"]),
    st.sampled_from(["0", "20us"]), st.booleans(), st.sampled_from([None, None, 1e6, 2.5e7]),
)


@st.composite
def mixed_clusters(draw: st.DrawFn, max_workers: int = 6) -> Cluster:
    """Random clusters of one or two levels whose ranks fall into 1-3 device groups of random
    devices (and sometimes a given speed), in rank order."""
    from pdcompile.machine.device import DEVICES
    from pdcompile.machine.device_groups import DeviceGroup

    inner = draw(st.integers(1, max_workers))
    outer = draw(st.integers(1, max(1, max_workers // inner)))
    text = f"{inner}x{outer}@1e10,1e9" if outer > 1 else f"{inner}@1e10"
    levels = Cluster.parse(text).levels
    workers = inner * outer
    cuts = sorted(draw(st.sets(st.integers(1, workers - 1), max_size=2))) if workers > 1 else []
    bounds = [0, *cuts, workers]
    groups = tuple(DeviceGroup(DEVICES[draw(st.sampled_from(["v100", "a100", "titanx", "h100"]))],
                               b - a, draw(st.none() | st.sampled_from([0.25, 0.5, 1.0, 2.0])))
                   for a, b in zip(bounds, bounds[1:], strict=False))
    return Cluster(levels=levels, groups=groups)


@st.composite
def drawn_chains(draw: st.DrawFn, min_blocks: int = 2, max_blocks: int = 5) -> nx.DiGraph:
    """An input, then `min_blocks`-`max_blocks` blocks in a chain with drawn costs,
    activations and weights (sizes where a shared network interface can bind)."""
    graph = new_cost_graph("chain")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=draw(st.floats(1e5, 1e7)), params=0.0)
    previous = "x"
    for i in range(draw(st.integers(min_blocks, max_blocks))):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-3, 1e-2)),
                  bwd=draw(st.floats(1e-3, 2e-2)), act=draw(st.floats(1e5, 1e8)),
                  params=draw(st.floats(0.0, 1e8)))
        graph.add_edge(previous, f"n{i}")
        previous = f"n{i}"
    return graph


@st.composite
def tied_dags(draw: st.DrawFn) -> nx.DiGraph:
    """Small random DAGs with one or two ties over two or three of their nodes, the first of
    each holding the tie's bytes in its `params` (as the cost pass counts them)."""
    graph = draw(small_dags(max_nodes=5))
    return with_drawn_ties(draw, graph, [n for n in graph.nodes if graph.nodes[n]["bwd"] > 0])


def with_drawn_ties(draw: st.DrawFn, graph: nx.DiGraph, nodes: list[str]) -> nx.DiGraph:
    """`graph` with one or two ties drawn over two or three of `nodes` (none where there are
    fewer than two), the first reader of each holding the tie's bytes in its `params`."""
    if len(nodes) < 2:
        return graph
    ties = []
    for _ in range(draw(st.integers(1, 2))):
        readers = draw(st.lists(st.sampled_from(nodes), min_size=2, max_size=3, unique=True))
        size = draw(st.floats(1e5, 1e8))
        graph.nodes[readers[0]]["params"] += size
        ties.append({"bytes": size, "nodes": readers})
    graph.graph["ties"] = ties
    return graph


@st.composite
def chains(draw: st.DrawFn, max_nodes: int = 6) -> nx.DiGraph:
    """Random chains: PipeDream's antichain states of a chain are all its prefixes."""
    n = draw(st.integers(1, max_nodes))
    graph = new_cost_graph("chain")
    for i in range(n):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-4, 1e-2)), bwd=draw(st.floats(1e-4, 2e-2)),
                  act=draw(st.floats(0, 5e7)), params=draw(st.floats(0, 1e6) | st.floats(0, 1e8)))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph
