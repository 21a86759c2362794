"""CostGraphs the tests build by hand."""

from __future__ import annotations

import random
from pathlib import Path

import networkx as nx

from pdcompile.cost.costgraph import add_block, new_cost_graph, save


def chain_graph(blocks: int, *, nbytes: float) -> nx.DiGraph:
    """A CostGraph of a chain of `blocks` equal blocks (10 ms forward, 20 ms backward; act and
    params `nbytes` each)."""
    graph = new_cost_graph("chain")
    for i in range(blocks):
        add_block(graph, f"n{i}", fwd=0.01, bwd=0.02, act=nbytes, params=nbytes)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph


def saved_chain(path: Path, blocks: int, *, nbytes: float) -> Path:
    """`chain_graph` saved as a CostGraph file."""
    save(chain_graph(blocks, nbytes=nbytes), path)
    return path


def random_chain(nodes: int, *, skips: int = 0, reach: int = 8, seed: int = 0) -> nx.DiGraph:
    """A chain of `nodes` blocks with random costs (0.1-1 ms forward, 0.2-2 ms backward,
    0.1-10 MB activations, up to 4 MB of weights) and `skips` random short skip edges (each
    over 2 to `reach` nodes): a graph at scale that is not a uniform stack of layers."""
    rng = random.Random(seed)
    graph = new_cost_graph(f"random chain of {nodes}", 32)
    for i in range(nodes):
        add_block(graph, f"n{i}", fwd=rng.uniform(1e-4, 1e-3), bwd=rng.uniform(2e-4, 2e-3),
                  act=rng.uniform(1e5, 1e7), params=rng.uniform(0, 4e6))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    for _ in range(skips if nodes > 2 else 0):
        start = rng.randrange(nodes - 2)
        graph.add_edge(f"n{start}", f"n{min(nodes - 1, start + rng.randint(2, reach))}")
    return graph


TIE = 150e6  # GPT-2's 50k x 768 embedding in float32


def tied_lm_chain() -> nx.DiGraph:
    """An embedding of TIE bytes (three times a block's forward), four blocks of TIE / 2 and
    a head reading the embedding again."""
    graph = new_cost_graph("lm", 8)
    names = ["emb", "b0", "b1", "b2", "b3", "head"]
    for name in names:
        fwd = 6e-3 if name == "emb" else 2e-3
        params = TIE if name == "emb" else TIE / 2 if name.startswith("b") else 1e5
        add_block(graph, name, fwd=fwd, bwd=2 * fwd, act=1e6, params=params)
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    graph.graph["ties"] = [{"bytes": TIE, "nodes": ["emb", "head"]}]
    return graph
