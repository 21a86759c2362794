"""CostGraphs the tests build by hand."""

from __future__ import annotations

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
