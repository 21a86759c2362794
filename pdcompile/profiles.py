"""Reader of PipeDream's layer profiles (`graph.txt`) into a CostGraph.

Format (one node per line, then one edge per line starting with a tab):

    nodeX -- <layer description> -- forward_compute_time=F, backward_compute_time=B, \
activation_size=A, parameter_size=P
    \tnodeU -- nodeV

F and B are milliseconds per minibatch, A and P bytes; A may be a list `[a; b; c]` (summed).
"""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx

from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import ProfileError

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NODE_EXAMPLE = ("node4 -- Conv2d(3, 64, kernel_size=(3, 3)) -- forward_compute_time=1.2, "
                 "backward_compute_time=2.5, activation_size=411041792.0, parameter_size=7168.0")


def _number(text: str, where: str, field: str) -> float:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return sum(_number(part, where, field) for part in text[1:-1].split(";") if part.strip())
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{where}: {field}={text!r} is not a number") from None
    if value != value or value < 0:
        raise ProfileError(f"{where}: {field}={text!r} must be a non-negative number")
    return value


def load_pipedream(path: str | Path) -> nx.DiGraph:
    """Read a PipeDream `graph.txt`; a malformed line raises ProfileError with file:line."""
    file = Path(path)
    if file.is_dir():
        file = file / "graph.txt"
    try:
        lines = file.read_text().splitlines()
    except OSError as err:
        raise ProfileError(f"cannot read profile {file}: {err.strerror}") from None
    name = file.parent.name if file.name == "graph.txt" else file.stem
    graph = new_cost_graph(name=name)
    edges: list[tuple[str, str, str]] = []
    for number, line in enumerate(lines, start=1):
        where = f"{file}:{number}"
        if not line.strip():
            continue
        if line.startswith("\t") or line.startswith("    "):
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2 or not all(parts):
                raise ProfileError(f"{where}: an edge line is '<tab>nodeU -- nodeV', got {line!r}")
            edges.append((parts[0], parts[1], where))
            continue
        head, sep, rest = line.partition(" -- ")
        description, sep2, costs = rest.rpartition(" -- ")
        if not sep or not sep2 or not head.strip():
            raise ProfileError(f"{where}: a node line is like {_NODE_EXAMPLE!r}, got {line!r}")
        values: dict[str, str] = {}
        for item in re.split(r",\s*(?=[a-z_]+=)", costs.strip()):
            key, eq, value = item.partition("=")
            if not eq:
                raise ProfileError(f"{where}: expected key=value, got {item!r}")
            values[key.strip()] = value
        missing = [f for f in _FIELDS if f not in values]
        if missing:
            raise ProfileError(f"{where}: node line lacks {', '.join(missing)}")
        node = head.strip()
        if node in graph:
            raise ProfileError(f"{where}: node {node!r} is defined twice")
        fwd, bwd, act, params = (_number(values[f], where, f) for f in _FIELDS)
        add_block(graph, node, fwd=fwd / 1000.0, bwd=bwd / 1000.0, act=act, params=params,
                  label=description.strip())
    for u, v, where in edges:
        for end in (u, v):
            if end not in graph:
                raise ProfileError(f"{where}: edge names {end!r}, which has no node line")
        graph.add_edge(u, v)
    if graph.number_of_nodes() == 0:
        raise ProfileError(f"{file}: no node lines; expected lines like {_NODE_EXAMPLE!r}")
    inputs = [n for n, d in graph.nodes(data=True) if d["label"].startswith("Input")]
    if inputs:
        act = graph.nodes[inputs[0]]["act"]
        graph.graph["input_bytes"] = act
    return graph
