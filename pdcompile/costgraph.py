"""The CostGraph: the planner's only input, a torch-free networkx.DiGraph of costed blocks.

Node attributes (base units): `fwd`, `bwd` seconds per minibatch; `act` bytes of the node's output
activation for the whole minibatch; `params` bytes of its parameters; optional `keep` bytes the
backward must keep (default `act`), `label` (what the node is) and `members` (original node names
when blocks were fused). Edge attribute `bytes` (default: the source's `act`) is what crosses the
edge per minibatch in the forward; the backward sends the same amount back.
Graph attributes: `name`, `batch_size` (samples per minibatch, may be None).
"""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.errors import CostGraphError

FORMAT = "pdcompile.costgraph/1"
COST_KEYS = ("fwd", "bwd", "act", "params")


def new_cost_graph(name: str = "", batch_size: int | None = None) -> nx.DiGraph:
    """An empty CostGraph."""
    return nx.DiGraph(name=name, batch_size=batch_size)


def add_block(
    graph: nx.DiGraph,
    node: str,
    *,
    fwd: float,
    bwd: float,
    act: float,
    params: float,
    keep: float | None = None,
    label: str = "",
    members: list[str] | None = None,
) -> None:
    """Add one costed node (seconds, bytes)."""
    graph.add_node(node, fwd=float(fwd), bwd=float(bwd), act=float(act), params=float(params),
                   keep=float(act if keep is None else keep), label=label,
                   members=list(members) if members else [node])


def edge_bytes(graph: nx.DiGraph, u: str, v: str) -> float:
    """Bytes crossing edge u -> v per minibatch (forward; the gradient is the same size)."""
    data = graph.edges[u, v]
    return float(data["bytes"]) if "bytes" in data else float(graph.nodes[u]["act"])


def validate(graph: nx.DiGraph) -> None:
    """Raise CostGraphError for what the planner cannot use: empty, cyclic, bad or missing costs."""
    if not isinstance(graph, nx.DiGraph):
        raise CostGraphError(f"a CostGraph is a networkx.DiGraph, not {type(graph).__name__}")
    if graph.number_of_nodes() == 0:
        raise CostGraphError("the CostGraph is empty: trace a model with at least one operation "
                             "or load a profile with at least one node")
    for node, data in graph.nodes(data=True):
        for key in COST_KEYS:
            if key not in data:
                raise CostGraphError(f"node {node!r} has no {key!r}; every node needs "
                                     f"{', '.join(COST_KEYS)} (use add_block)")
            value = data[key]
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
                raise CostGraphError(f"node {node!r} has {key}={value!r}; costs must be finite "
                                     "numbers")
            if value < 0:
                raise CostGraphError(f"node {node!r} has negative {key}={value!r}; costs are >= 0 "
                                     "(seconds and bytes)")
    for u, v, data in graph.edges(data=True):
        value = data.get("bytes", 0.0)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CostGraphError(f"edge {u!r} -> {v!r} has bytes={value!r}; edge bytes must be a "
                                 "finite number >= 0 (leave it out to use the source's act)")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
        raise CostGraphError(f"the CostGraph has a cycle ({path}); a model's graph is acyclic, "
                             "so the file or generator that made it is wrong")


def topological_order(graph: nx.DiGraph) -> list[str]:
    """A deterministic topological order (ties broken by insertion order)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: position[n]))


def totals(graph: nx.DiGraph) -> dict[str, float]:
    """Sums over all nodes of fwd, bwd, params and act."""
    return {key: sum(float(d[key]) for _, d in graph.nodes(data=True)) for key in COST_KEYS}


# --------------------------------------------------------------------------------- JSON
def to_dict(graph: nx.DiGraph) -> dict[str, Any]:
    """Plain data (see `FORMAT`)."""
    nodes = []
    for node, data in graph.nodes(data=True):
        nodes.append({"id": node, **{k: data[k] for k in COST_KEYS},
                      "keep": data.get("keep", data["act"]), "label": data.get("label", ""),
                      "members": data.get("members", [node])})
    edges = [[u, v, dict(d)] for u, v, d in graph.edges(data=True)]
    return {"format": FORMAT, "name": graph.graph.get("name", ""),
            "batch_size": graph.graph.get("batch_size"), "nodes": nodes, "edges": edges}


def from_dict(data: dict[str, Any]) -> nx.DiGraph:
    """Inverse of `to_dict`."""
    if data.get("format") != FORMAT:
        raise CostGraphError(f"not a CostGraph file (format {data.get('format')!r}, "
                             f"want {FORMAT!r})")
    graph = new_cost_graph(data.get("name", ""), data.get("batch_size"))
    for item in data["nodes"]:
        add_block(graph, item["id"], fwd=item["fwd"], bwd=item["bwd"], act=item["act"],
                  params=item["params"], keep=item.get("keep"), label=item.get("label", ""),
                  members=item.get("members"))
    for u, v, attrs in data["edges"]:
        graph.add_edge(u, v, **attrs)
    return graph


def save(graph: nx.DiGraph, path: str | Path) -> None:
    """Write the CostGraph as JSON."""
    Path(path).write_text(json.dumps(to_dict(graph), indent=1))


def load(path: str | Path) -> nx.DiGraph:
    """Read a CostGraph written by `save`."""
    try:
        return from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, CostGraphError):
            raise
        raise CostGraphError(f"cannot read CostGraph {path}: {err}") from None


# --------------------------------------------------------------------------------- coarsening
def coarsen(graph: nx.DiGraph, *, target: int = 300) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """Fuse straight-chain edges (u's only successor is v, v's only predecessor is u), cheapest
    pair first, until at most `target` blocks remain or no chain edge is left.

    Chain contraction never creates a cycle and only removes cut points inside a chain, so the
    planner still sees every branch. Zero-cost nodes (views, getattrs) are the cheapest and go
    first. Returns the coarse graph and a map block -> original node names.
    """
    validate(graph)
    coarse = graph.copy()
    for node in coarse.nodes:
        coarse.nodes[node].setdefault("members", [node])
        coarse.nodes[node].setdefault("keep", coarse.nodes[node]["act"])

    def weight(n: str) -> float:
        data = coarse.nodes[n]
        return float(data["fwd"] + data["bwd"])

    def chain_edge(u: str, v: str) -> bool:
        return coarse.out_degree(u) == 1 and coarse.in_degree(v) == 1

    heap: list[tuple[float, int, str, str]] = []
    counter = 0
    for u, v in coarse.edges:
        if chain_edge(u, v):
            heap.append((weight(u) + weight(v), counter, u, v))
            counter += 1
    heapq.heapify(heap)
    while heap and coarse.number_of_nodes() > target:
        _, _, u, v = heapq.heappop(heap)
        if u not in coarse or v not in coarse or not coarse.has_edge(u, v) or not chain_edge(u, v):
            continue
        du, dv = coarse.nodes[u], coarse.nodes[v]
        merged = {
            "fwd": du["fwd"] + dv["fwd"], "bwd": du["bwd"] + dv["bwd"],
            "params": du["params"] + dv["params"], "act": dv["act"],
            "keep": du["keep"] + dv["keep"], "label": dv.get("label", ""),
            "members": list(du["members"]) + list(dv["members"]),
        }
        successors = [(w, dict(coarse.edges[v, w])) for w in coarse.successors(v)]
        coarse.remove_node(v)
        coarse.nodes[u].update(merged)
        for w, attrs in successors:
            coarse.add_edge(u, w, **attrs)
        for a, b in list(coarse.in_edges(u)) + list(coarse.out_edges(u)):
            if chain_edge(a, b):
                heapq.heappush(heap, (weight(a) + weight(b), counter, a, b))
                counter += 1
    mapping = {node: list(coarse.nodes[node]["members"]) for node in coarse.nodes}
    return coarse, mapping
