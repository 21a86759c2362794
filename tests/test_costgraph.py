"""CostGraph: construction, validation, JSON round trip and coarsening with a map back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import networkx as nx
import pytest

from pdcompile import costgraph
from pdcompile.costgraph import add_block, coarsen, edge_bytes, new_cost_graph, totals, validate
from pdcompile.errors import CostGraphError


def _chain(n: int, *, seed: int = 0) -> nx.DiGraph:
    rng = random.Random(seed)
    graph = new_cost_graph("chain", batch_size=8)
    for i in range(n):
        add_block(graph, f"n{i}", fwd=rng.random(), bwd=rng.random(), act=rng.randint(1, 100),
                  params=rng.randint(0, 50))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph


def _diamond_net(blocks: int) -> nx.DiGraph:
    """input -> (a_i, b_i) -> join_i -> ... : residual-like branches, plus zero-cost views."""
    graph = new_cost_graph("branchy")
    add_block(graph, "input", fwd=0, bwd=0, act=10, params=0)
    prev = "input"
    for i in range(blocks):
        add_block(graph, f"a{i}", fwd=1.0, bwd=2.0, act=10, params=5)
        add_block(graph, f"view{i}", fwd=0, bwd=0, act=10, params=0)
        add_block(graph, f"b{i}", fwd=0.5, bwd=1.0, act=10, params=3)
        add_block(graph, f"join{i}", fwd=0.1, bwd=0.1, act=10, params=0)
        graph.add_edge(prev, f"a{i}")
        graph.add_edge(f"a{i}", f"view{i}")
        graph.add_edge(f"view{i}", f"b{i}")
        graph.add_edge(prev, f"join{i}")
        graph.add_edge(f"b{i}", f"join{i}")
        prev = f"join{i}"
    return graph


def test_add_block_defaults_and_edge_bytes() -> None:
    graph = new_cost_graph("g", batch_size=4)
    add_block(graph, "a", fwd=1, bwd=2, act=30, params=4, label="Linear")
    add_block(graph, "b", fwd=1, bwd=2, act=10, params=4, keep=7)
    graph.add_edge("a", "b")
    assert graph.nodes["a"]["keep"] == 30 and graph.nodes["b"]["keep"] == 7
    assert graph.nodes["a"]["members"] == ["a"] and graph.nodes["a"]["label"] == "Linear"
    assert edge_bytes(graph, "a", "b") == 30
    graph.edges["a", "b"]["bytes"] = 12
    assert edge_bytes(graph, "a", "b") == 12
    assert totals(graph) == {"fwd": 2, "bwd": 4, "act": 40, "params": 8}
    assert graph.graph == {"name": "g", "batch_size": 4}


def test_validate_names_the_problem() -> None:
    with pytest.raises(CostGraphError, match="empty"):
        validate(new_cost_graph())
    graph = new_cost_graph()
    graph.add_node("x", fwd=1.0, bwd=1.0, act=1.0)
    with pytest.raises(CostGraphError, match="'x' has no 'params'"):
        validate(graph)
    graph.nodes["x"]["params"] = float("nan")
    with pytest.raises(CostGraphError, match="finite"):
        validate(graph)
    graph.nodes["x"]["params"] = -1.0
    with pytest.raises(CostGraphError, match="negative params"):
        validate(graph)
    graph = _chain(3)
    graph.add_edge("n2", "n0")
    with pytest.raises(CostGraphError, match="cycle .*n0 -> n1 -> n2 -> n0"):
        validate(graph)
    with pytest.raises(CostGraphError, match="DiGraph"):
        validate(nx.Graph())  # type: ignore[arg-type]


def test_topological_order_is_deterministic() -> None:
    graph = _diamond_net(3)
    order = costgraph.topological_order(graph)
    assert order[0] == "input" and order[-1] == "join2"
    position = {n: i for i, n in enumerate(order)}
    assert all(position[u] < position[v] for u, v in graph.edges)
    assert costgraph.topological_order(graph.copy()) == order


def test_json_round_trip(tmp_path: Path) -> None:
    graph = _diamond_net(2)
    graph.edges["a0", "view0"]["bytes"] = 3.0
    file = tmp_path / "g.json"
    costgraph.save(graph, file)
    loaded = costgraph.load(file)
    assert costgraph.to_dict(loaded) == costgraph.to_dict(graph)
    assert loaded.edges["a0", "view0"]["bytes"] == 3.0
    assert list(loaded.nodes) == list(graph.nodes)


def test_bad_json_files(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "something/9", "nodes": []}))
    with pytest.raises(CostGraphError, match="not a CostGraph file"):
        costgraph.load(wrong)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(CostGraphError, match="cannot read CostGraph"):
        costgraph.load(broken)
    with pytest.raises(CostGraphError, match="cannot read CostGraph"):
        costgraph.load(tmp_path / "missing.json")


def _check_coarse(graph: nx.DiGraph, coarse: nx.DiGraph, mapping: dict[str, list[str]]) -> None:
    members = [m for block in mapping.values() for m in block]
    assert sorted(members) == sorted(graph.nodes)  # every node in exactly one block
    for key in ("fwd", "bwd", "params"):
        assert totals(coarse)[key] == pytest.approx(totals(graph)[key])
    assert nx.is_directed_acyclic_graph(coarse)
    block_of = {m: b for b, block in mapping.items() for m in block}
    for u, v in graph.edges:  # every original dependency survives between blocks
        if block_of[u] != block_of[v]:
            assert coarse.has_edge(block_of[u], block_of[v])
    for block, block_members in mapping.items():  # a block's output is its last member's
        assert coarse.nodes[block]["act"] == graph.nodes[block_members[-1]]["act"]


def test_coarsen_long_chain_to_target() -> None:
    graph = _chain(3000)
    coarse, mapping = coarsen(graph, target=200)
    assert coarse.number_of_nodes() == 200
    _check_coarse(graph, coarse, mapping)
    assert graph.number_of_nodes() == 3000  # input untouched


def test_coarsen_keeps_branches_and_fuses_zero_cost_first() -> None:
    graph = _diamond_net(50)  # 201 nodes
    coarse, mapping = coarsen(graph, target=160)
    _check_coarse(graph, coarse, mapping)
    assert coarse.number_of_nodes() <= 160
    # the cheapest chains (through the zero-cost views) were fused first
    fused = [block for block in mapping.values() if len(block) > 1]
    assert len(fused) == 201 - coarse.number_of_nodes()
    assert all(any(m.startswith("view") for m in block) for block in fused)
    # branches cannot be fused away: each join still has two predecessors
    joins = [b for b in coarse.nodes if any(m.startswith("join") for m in mapping[b])]
    assert all(coarse.in_degree(b) == 2 for b in joins if b != "input")


def test_coarsen_stops_when_no_chain_is_left() -> None:
    graph = _diamond_net(5)
    coarse, mapping = coarsen(graph, target=1)
    _check_coarse(graph, coarse, mapping)
    assert coarse.number_of_nodes() > 1


def test_coarsen_a_traced_model() -> None:
    import torch

    from pdcompile.models import resnet50
    from pdcompile.passes.cost import annotate_costs, to_cost_graph
    from pdcompile.passes.trace import trace

    torch.manual_seed(0)
    model, inputs = resnet50.factory(batch_size=2, image_size=32, width=16, blocks=(2, 2, 2, 2))
    graph = to_cost_graph(annotate_costs(trace(model), inputs, source="analytic"))
    coarse, mapping = coarsen(graph, target=40)
    assert coarse.number_of_nodes() <= 60
    _check_coarse(graph, coarse, mapping)
