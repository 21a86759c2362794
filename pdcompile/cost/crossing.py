"""What crosses between stages, and where every node of a CostGraph sits under a plan.

One rule, used by the planners' pricing, the stage tables and the simulator's stage costs: a
tensor (the output of one node) is sent once to every later stage that reads it, however many of
that stage's nodes read it (the runtime sends it once and the stage fans it out). The gradient
comes back the same way, once per reading stage. All tensors from one stage to another travel
as one message per minibatch (one latency), as the lowered schedule sends them.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from pdcompile.cost.costgraph import edge_bytes, topological_order
from pdcompile.errors import PlanError


def input_nodes(graph: nx.DiGraph) -> tuple[str, ...]:
    """The graph's inputs: sources without parameters or backward work (fx placeholders,
    PipeDream's `Input` nodes). They sit on the first stage and cost no compute there (a PipeDream
    profile's `Input` forward time is data loading, which the input pipeline overlaps with
    training); what they feed to later stages is traffic. Empty when every node is such a
    source. A graph that names its inputs (`graph.graph["inputs"]`: a traced model's
    placeholders) has no others: a parameter's transpose whose weight bytes count to a shape
    read before it is such a source too (timm's haloregnetz_b: ten of them were pinned to the
    first stage, and a cut that kept them in their layers was refused)."""
    # sources first, from one pass over the in-degree view (the planner asks once per plan
    # priced: asking each node its degrees was a seventh of planning a 400-node graph)
    sources = [n for n, degree in graph.in_degree if degree == 0]
    named = graph.graph.get("inputs")
    if named is not None:
        named = set(named)
        sources = [n for n in sources if n in named]
    found = tuple(n for n in sources
                  if graph.out_degree(n) > 0
                  and not float(graph.nodes[n]["params"]) and not float(graph.nodes[n]["bwd"]))
    return found if len(found) < graph.number_of_nodes() else ()


def stage_of_every_node(graph: nx.DiGraph, placed: Mapping[str, int]) -> dict[str, int]:
    """The stage of every node of `graph` given the placed ones (`placed`: node -> stage): nodes
    left out (e.g. zero-cost inputs) join the stage of their first placed successor (stage 0 if
    none)."""
    unknown = [n for n in placed if n not in graph]
    if unknown:
        raise PlanError(f"the plan places nodes that the CostGraph does not have: "
                        f"{unknown[:5]}; plan and graph must come from the same model "
                        "(expand a coarsened plan with Plan.expanded)")
    stage_of: dict[str, int] = {}
    for node in reversed(topological_order(graph)):
        if node in placed:
            stage_of[node] = placed[node]
        else:
            later = [stage_of[v] for v in graph.successors(node) if v in stage_of]
            stage_of[node] = min(later) if later else 0
    return stage_of


def crossing_bytes(graph: nx.DiGraph, stage_of: Mapping[str, int]) -> dict[tuple[int, int], float]:
    """Bytes per minibatch sent from stage a to a later stage c, keyed (a, c): every node's
    output once per later stage that reads it (the largest edge into that stage, where edges of
    a coarsened graph carry part of an output). An edge from a later stage back to an earlier
    one raises PlanError."""
    sent: dict[tuple[str, int], float] = {}
    for u, v in graph.edges:
        a, c = stage_of[u], stage_of[v]
        if a == c:
            continue
        if a > c:
            raise PlanError(f"edge {u} -> {v} goes from stage {a} back to stage {c}; stages "
                            "must follow the graph's order (every stage convex)")
        key = (u, c)
        sent[key] = max(sent.get(key, 0.0), edge_bytes(graph, u, v))
    out: dict[tuple[int, int], float] = {}
    for (u, c), size in sent.items():
        pair = (stage_of[u], c)
        out[pair] = out.get(pair, 0.0) + size
    return out


__all__ = ["crossing_bytes", "input_nodes", "stage_of_every_node"]
