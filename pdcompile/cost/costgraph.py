"""The CostGraph: the planner's only input, a torch-free networkx.DiGraph of costed blocks.

Node attributes (base units): `fwd`, `bwd` seconds per minibatch; `act` bytes of the node's output
activation for the whole minibatch; `params` bytes of its parameters; optional `keep` bytes the
backward must keep (default `act`), `label` (what the node is) and `members` (original node names
when blocks were fused). Edge attribute `bytes` (default: the source's `act`) is what crosses the
edge per minibatch in the forward; the backward sends the same amount back.
Graph attributes: `name`, `batch_size` (samples per minibatch, may be None), optional `ties`:
parameters read by several nodes, each `{"bytes": ..., "nodes": [names]}`, the first name the node
whose `params` count them (cost/ties.py).
"""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.errors import CostGraphError
from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal
from pdcompile.util.manifest import MAX_JSON_BYTES

FORMAT = "pdcompile.costgraph/1"  # the file format's name, kept when the module moved
COST_KEYS = ("fwd", "bwd", "act", "params")
MAX_COSTGRAPH_BYTES = MAX_JSON_BYTES
"""The largest CostGraph file read (256 MiB, as any JSON file pdcompile reads whole): 442 times
GPT-2 XL's (2,074 nodes in 607,295 bytes), so some 900,000 nodes. A FIFO named as one blocked
the reader forever, a sparse file of gigabytes filled memory."""


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
    wgrad: float | None = None,
) -> None:
    """Add one costed node (seconds, bytes). `wgrad`: the seconds of `bwd` the runtime can
    defer (weight gradients, W), where the graph's source knows them (a traced model; a
    PipeDream profile does not: the simulator then assumes `schedule.kinds.WGRAD_SHARE`)."""
    graph.add_node(node, fwd=float(fwd), bwd=float(bwd), act=float(act), params=float(params),
                   keep=float(act if keep is None else keep), label=label,
                   members=list(members) if members else [node])
    if wgrad is not None:
        graph.nodes[node]["wgrad"] = float(wgrad)


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
                      "members": data.get("members", [node]),
                      **({"wgrad": data["wgrad"]} if "wgrad" in data else {})})
    edges = [[u, v, dict(d)] for u, v, d in graph.edges(data=True)]
    return {"format": FORMAT, "name": graph.graph.get("name", ""),
            "batch_size": graph.graph.get("batch_size"), "nodes": nodes, "edges": edges,
            **({"ties": [dict(t) for t in graph.graph["ties"]]}
               if graph.graph.get("ties") else {}),
            **({"inputs": list(graph.graph["inputs"])} if "inputs" in graph.graph else {})}


def from_dict(data: dict[str, Any]) -> nx.DiGraph:
    """Inverse of `to_dict`."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CostGraphError(f"not a CostGraph file (format {found!r}, want {FORMAT!r})")
    graph = new_cost_graph(data.get("name", ""), data.get("batch_size"))
    for item in data["nodes"]:
        add_block(graph, item["id"], fwd=item["fwd"], bwd=item["bwd"], act=item["act"],
                  params=item["params"], keep=item.get("keep"), label=item.get("label", ""),
                  members=item.get("members"), wgrad=item.get("wgrad"))
    for u, v, attrs in data["edges"]:
        graph.add_edge(u, v, **attrs)
    if data.get("ties"):
        graph.graph["ties"] = [{"bytes": float(t["bytes"]), "nodes": list(t["nodes"])}
                               for t in data["ties"]]
    if "inputs" in data:
        graph.graph["inputs"] = [str(name) for name in data["inputs"]]
    return graph


def save(graph: nx.DiGraph, path: str | Path) -> None:
    """Write the CostGraph as JSON."""
    Path(path).write_text(json.dumps(to_dict(graph), indent=1))


def load(path: str | Path) -> nx.DiGraph:
    """Read a CostGraph written by `save`: a plain file of at most MAX_COSTGRAPH_BYTES, refused
    before a byte of it is read otherwise (a folder, a FIFO, a device, a larger file)."""
    try:
        return from_dict(json.loads(read_plain_file(Path(path), MAX_COSTGRAPH_BYTES).decode()))
    except NotPlainFile as why:
        raise CostGraphError(refusal(
            why, path, role="CostGraph", limit=MAX_COSTGRAPH_BYTES,
            because="442 times GPT-2 XL's CostGraph", fix=_WRITE_ONE)) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        if isinstance(err, CostGraphError):
            raise CostGraphError(f"CostGraph {path}: {err}") from None
        detail = str(err).splitlines()[0] if str(err) else ""
        raise CostGraphError(f"cannot read CostGraph {path} ({type(err).__name__}: {detail}); "
                             f"{_WRITE_ONE}") from None


_WRITE_ONE = "write one with `pdcompile inspect MODEL --save FILE.json` or pdcompile.costgraph.save"


# --------------------------------------------------------------------------------- coarsening
def coarsen(graph: nx.DiGraph, *, target: int = 300, branches: bool = False,
            ) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """Fuse nodes into blocks until at most `target` blocks remain (or nothing can be fused).

    A fusion contracts one edge u -> v of the current block graph; it is allowed when no other
    path leads from u to v, so the block graph stays acyclic and every block is convex (a path
    between two members never leaves the block): a plan of the coarse graph, expanded with the
    returned map (Plan.expanded), is a plan of the original. Two phases:

    1. every compute-free block (views, getitems, sizes, getattrs: fwd + bwd = 0) joins its
       cheapest neighbour that it can be fused with, whatever its number of inputs and outputs;
    2. then the cheapest straight-chain edge (u's only successor is v, v's only predecessor is
       u), again and again: this keeps every branch, so the planner can still cut at each one.
       With `branches`, the cheapest fusable pair instead, chain or not: any connected graph
       then gets down to `target` (GPT-2 XL's ~2,000 fx nodes: 580 blocks without, `target`
       with; both in a fraction of a second).

    A block's `fwd`, `bwd`, `params` and `keep` are the sums over its members; its `act` is what
    leaves it: the outputs of members used outside the block or by nobody (the model's outputs),
    each counted once (for a straight chain: the last member's output). Edge `bytes` between
    blocks count each source node's output once per destination block. `members` lists the
    original nodes in topological order; the block is named after the first. Returns the coarse
    graph and the map block -> original node names.
    """
    validate(graph)
    order = topological_order(graph)
    position = {node: i for i, node in enumerate(order)}
    # the current block graph: representative node -> its successors / predecessors / members
    succ: dict[str, set[str]] = {n: set(graph.successors(n)) for n in graph.nodes}
    pred: dict[str, set[str]] = {n: set(graph.predecessors(n)) for n in graph.nodes}
    members: dict[str, list[str]] = {n: [n] for n in graph.nodes}
    block_of = {n: n for n in graph.nodes}
    compute = {n: float(d["fwd"]) + float(d["bwd"]) for n, d in graph.nodes(data=True)}

    def hidden(u: str, v: str) -> float:
        """The bytes from block u to block v, which fusing them keeps inside one block (counted
        from the side with fewer members)."""
        if len(members[u]) <= len(members[v]):
            return sum(edge_bytes(graph, a, b) for a in members[u]
                       for b in graph.successors(a) if block_of[b] == v)
        return sum(edge_bytes(graph, a, b) for b in members[v]
                   for a in graph.predecessors(b) if block_of[a] == u)

    def other_path(u: str, v: str) -> bool:
        """Whether v is reachable from u other than by the edge u -> v: searched forward from
        u's other successors and backward from v's other predecessors, a step of each in turn,
        so the search costs about the smaller of u's descendants and v's ancestors (each side
        alone decides; GPT-2 XL's views near the input have thousands of one, few of the
        other)."""
        if len(succ[u]) == 1 or len(pred[v]) == 1:
            return False  # every other path would leave u by this edge or enter v by it
        ahead = [w for w in succ[u] if w != v]
        behind = [p for p in pred[v] if p != u]
        seen_ahead, seen_behind = set(ahead), set(behind)
        while ahead and behind:
            for w in succ[ahead.pop()]:
                if w == v:
                    return True
                if w not in seen_ahead:
                    seen_ahead.add(w)
                    ahead.append(w)
            for p in pred[behind.pop()]:
                if p == u:
                    return True
                if p not in seen_behind:
                    seen_behind.add(p)
                    behind.append(p)
        return False

    def fuse(u: str, v: str) -> None:
        """Contract the edge u -> v into u."""
        for w in succ.pop(v):
            pred[w].discard(v)
            if w != u:
                pred[w].add(u)
                succ[u].add(w)
        for p in pred.pop(v):
            succ[p].discard(v)
            if p != u:
                succ[p].add(u)
                pred[u].add(p)
        succ[u].discard(v)
        for m in members[v]:
            block_of[m] = u
        members[u] += members.pop(v)
        compute[u] += compute.pop(v)

    # phase 1: compute-free blocks join a neighbour: the one whose edge to them carries the
    # most bytes (an expand joins its consumer, not the size it read: timm's convit_small fused
    # all ten layers' expanded position tables into one block that every cut then sent),
    # then the cheapest
    for node in order:
        z = node
        while len(members) > target and z in members and compute[z] == 0:
            candidates = sorted(
                [(-hidden(p, z), compute[p], 0, position[p], p, z) for p in pred[z]]
                + [(-hidden(z, s), compute[s], 1, position[s], z, s) for s in succ[z]])
            fused = next(((u, v) for *_, u, v in candidates if not other_path(u, v)), None)
            if fused is None:
                break
            fuse(*fused)
            z = fused[0]  # the block that absorbed z, or z itself: again if still compute-free

    # phase 2: the cheapest straight-chain edge (with `branches`: the cheapest pair), again and
    # again; an edge skipped here is pushed again when a fusion next to it changes its status
    heap = [(compute[u] + compute[v], position[u], position[v], u, v)
            for u in members for v in succ[u]]
    heapq.heapify(heap)
    while heap and len(members) > target:
        weight, _, _, u, v = heapq.heappop(heap)
        if u not in members or v not in succ[u] or weight != compute[u] + compute[v]:
            continue  # stale: a fused block pushed its edges again with the new weight
        if not branches and (len(succ[u]) > 1 or len(pred[v]) > 1):
            continue
        if other_path(u, v):
            continue
        fuse(u, v)
        for p in pred[u]:
            heapq.heappush(heap, (compute[p] + compute[u], position[p], position[u], p, u))
        for w in succ[u]:
            heapq.heappush(heap, (compute[u] + compute[w], position[u], position[w], u, w))

    return _block_graph(graph, members, position)


def grouped(graph: nx.DiGraph, groups: list[list[str]],
            ) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """`graph` with each group of nodes fused into one block (named after its first member in
    topological order), the other nodes as they are, and the map block -> members; raises
    CostGraphError when a group is not convex (a path between two of its members leaves it)."""
    order = topological_order(graph)
    position = {node: i for i, node in enumerate(order)}
    grouped_nodes = {n for group in groups for n in group}
    members = {min(group, key=position.__getitem__): list(group) for group in groups if group}
    members |= {n: [n] for n in graph.nodes if n not in grouped_nodes}
    coarse, mapping = _block_graph(graph, members, position)
    validate(coarse)
    return coarse, mapping


def _block_graph(graph: nx.DiGraph, groups: dict[str, list[str]], position: dict[str, int],
                 ) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """The CostGraph of `graph` with each group of nodes fused into one block (see `coarsen`)."""
    mapping = {}
    for group in groups.values():
        ordered = sorted(group, key=position.__getitem__)
        mapping[ordered[0]] = ordered
    block_of = {m: block for block, group in mapping.items() for m in group}
    coarse = nx.DiGraph(**graph.graph)
    index = {node: i for i, node in enumerate(graph.nodes)}
    for block in sorted(mapping, key=index.__getitem__):
        group = mapping[block]
        data = [graph.nodes[m] for m in group]
        leaving = [m for m in group if not graph.succ[m]
                   or any(block_of[w] != block for w in graph.successors(m))]
        known = all("wgrad" in d for d in data)
        coarse.add_node(block, **{
            **{k: v for k, v in data[0].items() if k != "wgrad"},
            **({"wgrad": sum(float(d["wgrad"]) for d in data)} if known else {}),
            "fwd": sum(float(d["fwd"]) for d in data), "bwd": sum(float(d["bwd"]) for d in data),
            "params": sum(float(d["params"]) for d in data),
            "act": sum(float(graph.nodes[m]["act"]) for m in leaving),
            "keep": sum(float(d.get("keep", d["act"])) for d in data),
            "label": data[-1].get("label", ""), "members": list(group)})
    # bytes[a, b][s]: what source node s sends to block b (once, however many members use it)
    sent: dict[tuple[str, str], dict[str, float]] = {}
    attrs: dict[tuple[str, str], dict[str, Any]] = {}
    for u, v, d in graph.edges(data=True):
        a, b = block_of[u], block_of[v]
        if a == b:
            continue
        from_u = sent.setdefault((a, b), {})
        from_u[u] = max(from_u.get(u, 0.0), edge_bytes(graph, u, v))
        attrs.setdefault((a, b), {}).update(d)
    for (a, b), from_u in sent.items():
        size = sum(from_u.values())
        extra = {k: v for k, v in attrs[(a, b)].items() if k != "bytes"}
        if size == coarse.nodes[a]["act"]:
            coarse.add_edge(a, b, **extra)
        else:
            coarse.add_edge(a, b, **extra, bytes=size)
    return coarse, mapping
