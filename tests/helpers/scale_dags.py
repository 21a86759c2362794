"""Hypothesis strategies for the planner at scale: random DAGs of hundreds to thousands of
nodes (a spine with branches, joins and skips of any reach, not only chains) whose costs
include zeros and extremes, and clusters written in the short form (flat, servers, presets,
mixed device groups)."""

from __future__ import annotations

import random

import networkx as nx
from hypothesis import strategies as st

from pdcompile.cost.costgraph import add_block, new_cost_graph

# a value of each kind: mostly ordinary, sometimes zero or (for the times and sizes) extreme
_SECONDS = st.sampled_from([0.0, 1e-9, 1.0]) | st.floats(1e-5, 1e-2)
_BYTES = st.sampled_from([0.0, 1.0, 1e9]) | st.integers(0, 10_000_000).map(float)
_WEIGHTS = st.sampled_from([0.0, 2e8]) | st.integers(0, 4_000_000).map(float)


@st.composite
def scale_dags(draw: st.DrawFn, min_nodes: int = 100, max_nodes: int = 2000) -> nx.DiGraph:
    """A DAG of `min_nodes`-`max_nodes` nodes: each node after the first reads its predecessor,
    a recent node (a branch) or one to four earlier ones (joins, long skips), some edges with
    bytes of their own. Costs are drawn per node from a few values (so that thousands of nodes
    cost one draw each, not four), picked and wired by a drawn seed."""
    n = draw(st.integers(min_nodes, max_nodes))
    seconds = draw(st.lists(_SECONDS, min_size=8, max_size=8))
    sizes = draw(st.lists(_BYTES, min_size=8, max_size=8))
    weights = draw(st.lists(_WEIGHTS, min_size=4, max_size=4))
    # one seed for the structure and the picks (hypothesis's own randoms draw every call
    # from its buffer: thousands per graph, too large an example to generate)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    graph = _nodes(f"random DAG of {n}", n, rng, seconds, sizes, weights)
    for i in range(1, n):
        style = rng.random()
        if style < 0.6:
            parents = {i - 1}
        elif style < 0.8:
            parents = {rng.randrange(max(0, i - 50), i)}
        else:
            parents = set(rng.sample(range(i), min(i, rng.randint(1, 4))))
        for p in parents:
            if rng.random() < 0.3:
                graph.add_edge(f"n{p}", f"n{i}", bytes=rng.choice(sizes))
            else:
                graph.add_edge(f"n{p}", f"n{i}")
    return graph


# short forms and presets (cluster.py's grammar): flat, servers, devices, mixed groups
SHORT_FORMS = ("1", "3@1e9", "8@450GB/s~3us:h100", "4x4@1e10,1.25e9:v100", "16@10Gbps:cpu",
               "2x4@1e11,1e9", "A", "B", "C", "h100-node", "h100-4node",
               "128@450GB/s~3us:h100", "8x16@450GB/s,400Gbps~3us,5us:h100")
MIXED_FORMS = ("mixed-A", "mixed-h100-a100", "8@1e10:a100*4,v100*4",
               "4x2@150GB/s,100Gbps:h100*4,titanx*4")
# those of at most 16 workers (the fast lane's)
SMALL_FORMS = tuple(f for f in SHORT_FORMS if f not in ("h100-4node", "128@450GB/s~3us:h100",
                                                        "8x16@450GB/s,400Gbps~3us,5us:h100"))


# costs of every scale: zero, the smallest normal float, tiny, ordinary, huge
_ANY_SECONDS = (st.sampled_from([0.0, 2.2250738585072014e-308, 1e-12, 1e3])
                | st.floats(1e-6, 1e-1))
_ANY_BYTES = st.sampled_from([0.0, 1.0, 1e12]) | st.integers(0, 100_000_000).map(float)
_WEIGHT_BYTES = st.sampled_from([0.0, 1.0, 1e10]) | st.integers(0, 100_000_000).map(float)


@st.composite
def layered_dags(draw: st.DrawFn, min_nodes: int = 20, max_nodes: int = 3000) -> nx.DiGraph:
    """A DAG of layers `width` nodes wide (1 to 8 parallel branches), each node reading one
    or more nodes of the layer before and, with a drawn probability, a skip from up to
    `reach` layers back; costs from a drawn palette of zeros, tiny, ordinary and huge values,
    and, sometimes, one node whose compute is 1,000 times everything else's together (a single
    dominant node). Structure and picks come from one drawn seed (see `scale_dags`)."""
    n = draw(st.integers(min_nodes, max_nodes))
    width = draw(st.integers(1, 8))
    skip = draw(st.sampled_from([0.0, 0.05, 0.3]))
    reach = draw(st.integers(2, 60))
    seconds = draw(st.lists(_ANY_SECONDS, min_size=6, max_size=6))
    sizes = draw(st.lists(_ANY_BYTES, min_size=6, max_size=6))
    weights = draw(st.lists(_WEIGHT_BYTES, min_size=4, max_size=4))
    dominant = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return layered_dag(n, width, skip, reach, seconds, sizes, weights, dominant, seed)


def layered_dag(n: int, width: int, skip: float, reach: int, seconds: list[float],
                sizes: list[float], weights: list[float], dominant: bool,
                seed: int) -> nx.DiGraph:
    """The graph `layered_dags` draws, from its drawn values (benchmarks and reproductions
    build a draw again from them)."""
    rng = random.Random(seed)
    graph = _nodes(f"layered DAG of {n}, width {width}", n, rng, seconds, sizes, weights)
    for i in range(1, n):
        layer = i // width
        before = range(max(0, (layer - 1) * width), min(i, layer * width)) if layer else ()
        parents = set(rng.sample(before, rng.randint(1, len(before)))) if before else set()
        if rng.random() < skip and layer > 1:
            parents.add(rng.randrange(max(0, (layer - reach) * width), (layer - 1) * width))
        for p in parents:
            graph.add_edge(f"n{p}", f"n{i}")
    if dominant:
        node = graph.nodes[f"n{rng.randrange(n)}"]
        total = sum(float(d["fwd"]) + float(d["bwd"]) for _, d in graph.nodes(data=True))
        node["fwd"], node["bwd"] = 1e3 * max(total, 1e-3), 2e3 * max(total, 1e-3)
    return graph


@st.composite
def cluster_forms(draw: st.DrawFn, most: int = 128) -> str:
    """A cluster in the short form: flat of 2 to `most` workers, or servers of 2 to 16 workers
    each (up to `most` in all), over links from 1 GB/s to NVLink's 450 GB/s."""
    if draw(st.booleans()):
        workers = draw(st.integers(2, most))
        fabric = draw(st.sampled_from(["1e9", "1e10", "450GB/s~3us:h100"]))
        return f"{workers}@{fabric}"
    per_server = draw(st.integers(2, min(16, most // 2)))
    servers = draw(st.integers(2, max(2, most // per_server)))
    fabric = draw(st.sampled_from(["1e10,1.25e9", "450GB/s,400Gbps~3us,5us:h100"]))
    return f"{per_server}x{servers}@{fabric}"  # workers per server, then servers


def _nodes(name: str, n: int, rng: random.Random, seconds: list[float], sizes: list[float],
           weights: list[float]) -> nx.DiGraph:
    """A cost graph of `n` unwired nodes n0..n{n-1}, each cost picked from the drawn palettes."""
    graph = new_cost_graph(name, 32)
    for i in range(n):
        add_block(graph, f"n{i}", fwd=rng.choice(seconds), bwd=rng.choice(seconds),
                  act=rng.choice(sizes), params=rng.choice(weights))
    return graph
