"""CostGraph: construction, validation, JSON round trip and coarsening with a map back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import networkx as nx
import pytest

from pdcompile.cost import costgraph
from pdcompile.cost.costgraph import (
    add_block,
    coarsen,
    edge_bytes,
    new_cost_graph,
    totals,
    validate,
)
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
    assert set(mapping) == set(coarse.nodes)
    for key in ("fwd", "bwd", "params", "keep"):
        assert sum(float(d[key]) for _, d in coarse.nodes(data=True)) == pytest.approx(
            sum(float(d.get(key, d["act"])) for _, d in graph.nodes(data=True)))
    assert nx.is_directed_acyclic_graph(coarse)
    position = {n: i for i, n in enumerate(costgraph.topological_order(graph))}
    block_of = {m: b for b, block in mapping.items() for m in block}
    for u, v in graph.edges:  # every original dependency survives between blocks
        if block_of[u] != block_of[v]:
            assert coarse.has_edge(block_of[u], block_of[v])
    for block, block_members in mapping.items():
        # named after its first member, members in topological order, in the graph's `members`
        assert block == block_members[0] and coarse.nodes[block]["members"] == block_members
        assert block_members == sorted(block_members, key=position.__getitem__)
        # its act is what leaves it: members used outside the block or by nobody
        leaving = [m for m in block_members if not graph.succ[m]
                   or any(block_of[w] != block for w in graph.successors(m))]
        assert coarse.nodes[block]["act"] == sum(graph.nodes[m]["act"] for m in leaving)
    for a, b in coarse.edges:  # each source's output crosses once per destination block
        sent: dict[str, float] = {}
        for u in mapping[a]:
            for v in graph.successors(u):
                if block_of[v] == b:
                    sent[u] = max(sent.get(u, 0.0), edge_bytes(graph, u, v))
        assert edge_bytes(coarse, a, b) == pytest.approx(sum(sent.values()))


def test_coarsen_long_chain_to_target() -> None:
    graph = _chain(3000)
    coarse, mapping = coarsen(graph, target=200)
    assert coarse.number_of_nodes() == 200
    _check_coarse(graph, coarse, mapping)
    assert graph.number_of_nodes() == 3000  # input untouched
    # a chain block's output is its last member's
    assert all(coarse.nodes[b]["act"] == graph.nodes[m[-1]]["act"] for b, m in mapping.items())


def test_coarsen_keeps_branches_and_fuses_zero_cost_first() -> None:
    graph = _diamond_net(50)  # 201 nodes
    coarse, mapping = coarsen(graph, target=160)
    _check_coarse(graph, coarse, mapping)
    assert coarse.number_of_nodes() == 160
    # the compute-free nodes (the input, the views) were fused first, into their cheapest
    # neighbour: the input into a0 (joining join0 would close a cycle), each view into b_i
    fused = [block for block in mapping.values() if len(block) > 1]
    assert len(fused) == 201 - 160
    assert fused[0] == ["input", "a0"]
    assert all(block[0] == f"view{i}" and block[1] == f"b{i}" for i, block in enumerate(fused[1:]))
    # branches are still there: each join still has two predecessors
    joins = [b for b in coarse.nodes if any(m.startswith("join") for m in mapping[b])]
    assert all(coarse.in_degree(b) == 2 for b in joins)
    assert coarse.nodes["input"]["act"] == 20  # the input and a0 both leave the block


def test_coarsen_fuses_zero_cost_nodes_with_several_inputs_and_outputs() -> None:
    """Attention-like: size -> (views of q, k, v), split -> getitems: all compute-free nodes with
    several inputs or outputs join a neighbour; a node whose fusion would close a cycle doesn't
    take that neighbour."""
    graph = new_cost_graph("attention")
    add_block(graph, "x", fwd=1, bwd=1, act=8, params=0)
    add_block(graph, "size", fwd=0, bwd=0, act=0, params=0)
    add_block(graph, "qkv", fwd=3, bwd=6, act=24, params=9)
    add_block(graph, "split", fwd=0, bwd=0, act=24, params=0)
    graph.add_edges_from([("x", "size"), ("x", "qkv"), ("qkv", "split")])
    for name in "qkv":
        add_block(graph, f"get_{name}", fwd=0, bwd=0, act=8, params=0)
        add_block(graph, f"view_{name}", fwd=0, bwd=0, act=8, params=0)
        graph.add_edges_from([("split", f"get_{name}"), (f"get_{name}", f"view_{name}"),
                              ("size", f"view_{name}")])
    add_block(graph, "scores", fwd=2, bwd=4, act=16, params=0)
    add_block(graph, "out", fwd=2, bwd=4, act=8, params=0)
    add_block(graph, "add", fwd=0.5, bwd=0.5, act=8, params=0)
    graph.add_edges_from([("view_q", "scores"), ("view_k", "scores"), ("scores", "out"),
                          ("view_v", "out"), ("out", "add"), ("x", "add")])
    compute = [n for n, d in graph.nodes(data=True) if d["fwd"] + d["bwd"] > 0]
    coarse, mapping = coarsen(graph, target=len(compute))
    _check_coarse(graph, coarse, mapping)
    assert coarse.number_of_nodes() == len(compute)
    assert all(coarse.nodes[b]["fwd"] + coarse.nodes[b]["bwd"] > 0 for b in coarse.nodes)


def test_coarsen_keeps_each_layers_expanded_table_with_its_layer() -> None:
    """convit-like: every layer expands a table of its own to the batch size read once from the
    input. Each compute-free expand joins the layer that uses its large output, not the size
    node it shares with the other layers (which made one block that every cut had to send: timm's
    convit_small in 4 stages was planned at 61.3 ms a minibatch, an even cut 37.0 ms)."""
    layers = 10
    graph = new_cost_graph("tables")
    add_block(graph, "x", fwd=0, bwd=0, act=100, params=0)
    add_block(graph, "size", fwd=0, bwd=0, act=0, params=0)
    graph.add_edge("x", "size")
    previous = "x"
    for k in range(layers):
        add_block(graph, f"table{k}", fwd=0, bwd=0, act=10, params=0)
        add_block(graph, f"expand{k}", fwd=0, bwd=0, act=1000, params=0)
        add_block(graph, f"layer{k}", fwd=1, bwd=2, act=100, params=5)
        graph.add_edges_from([(f"table{k}", f"expand{k}"), ("size", f"expand{k}"),
                              (f"expand{k}", f"layer{k}"), (previous, f"layer{k}")])
        previous = f"layer{k}"
    coarse, mapping = coarsen(graph, target=layers)
    _check_coarse(graph, coarse, mapping)
    block_of = {m: b for b, members in mapping.items() for m in members}
    assert all(block_of[f"expand{k}"] == block_of[f"layer{k}"] for k in range(layers))
    # what crosses between blocks is at most the layers' outputs and the small tables
    assert max(edge_bytes(coarse, u, v) for u, v in coarse.edges) <= 100


def test_coarsen_stops_when_no_chain_is_left() -> None:
    graph = _diamond_net(5)
    coarse, mapping = coarsen(graph, target=1)
    _check_coarse(graph, coarse, mapping)
    assert coarse.number_of_nodes() == 11  # the input with a0, then per diamond: join, (a, b)
    assert all(coarse.in_degree(b) == 2 for b in coarse.nodes if b.startswith("join"))


def test_coarsen_across_branches_down_to_one_block_and_across_components() -> None:
    graph = _diamond_net(5)
    coarse, mapping = coarsen(graph, target=1, branches=True)
    _check_coarse(graph, coarse, mapping)
    assert list(mapping) == ["input"] and coarse.nodes["input"]["act"] == 10  # join4's output
    two = nx.union(_chain(5), nx.relabel_nodes(_chain(4), lambda n: f"other_{n}"))
    coarse, mapping = coarsen(two, target=1, branches=True)  # no edge joins the two chains
    _check_coarse(two, coarse, mapping)
    assert sorted(mapping) == ["n0", "other_n0"]


@pytest.mark.parametrize("seed", range(20))
def test_coarsen_random_dags(seed: int) -> None:
    rng = random.Random(seed)
    graph = new_cost_graph("random")
    nodes = [f"v{i}" for i in range(rng.randint(2, 60))]
    for node in nodes:
        free = rng.random() < 0.4
        add_block(graph, node, fwd=0 if free else rng.random(), bwd=0 if free else rng.random(),
                  act=rng.randint(0, 9), params=rng.randint(0, 3), keep=rng.randint(0, 9))
    for j, v in enumerate(nodes[1:], start=1):
        for u in rng.sample(nodes[:j], rng.randint(1, min(j, 3))):
            graph.add_edge(u, v, **({"bytes": float(rng.randint(0, 5))} if rng.random() < 0.3
                                    else {}))
    for target in (len(nodes) - 1, len(nodes) // 2, 5, 1):
        coarse, mapping = coarsen(graph, target=target)
        _check_coarse(graph, coarse, mapping)
        assert coarse.number_of_nodes() >= target
        coarse, mapping = coarsen(graph, target=target, branches=True)
        _check_coarse(graph, coarse, mapping)
        assert coarse.number_of_nodes() == target  # connected: it always gets there


def test_coarsen_a_traced_model() -> None:
    import torch

    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.models import resnet50
    from pdcompile.passes.trace import trace

    torch.manual_seed(0)
    model, inputs = resnet50.factory(batch_size=2, image_size=32, width=16, blocks=(2, 2, 2, 2))
    graph = to_cost_graph(annotate_costs(trace(model), inputs, source="analytic"))
    coarse, mapping = coarsen(graph, target=40)
    assert coarse.number_of_nodes() <= 60
    _check_coarse(graph, coarse, mapping)


@pytest.mark.slow
def test_coarsen_gpt2_xl_to_a_few_hundred_blocks() -> None:
    """The graph the planner gets for GPT-2 XL (meta, analytic costs): ~2,000 fx nodes, a third
    of them compute-free with several inputs or outputs (split, getitem, size, view)."""
    import time

    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.models import gpt2
    from pdcompile.passes.trace import trace

    model, inputs = gpt2.factory(size="xl", batch_size=1, device="meta")
    graph = to_cost_graph(annotate_costs(trace(model), inputs, source="analytic", device="h100"))
    assert graph.number_of_nodes() > 2000
    # without branches 579 (580 while compute-free nodes joined the cheapest neighbour rather
    # than the one whose edge carries the most bytes)
    for branches, blocks in ((False, 579), (True, 300)):
        started = time.perf_counter()
        coarse, mapping = coarsen(graph, target=300, branches=branches)
        seconds = time.perf_counter() - started
        # before: 1,254 blocks, 675 of them compute-free (straight chains only)
        assert coarse.number_of_nodes() == blocks
        assert seconds < 10, f"coarsening took {seconds:.1f} s"  # about 0.2 s measured
        _check_coarse(graph, coarse, mapping)
        assert all(d["fwd"] + d["bwd"] > 0 for _, d in coarse.nodes(data=True))
        assert coarse.graph == graph.graph


def test_a_file_written_before_the_cost_room_loads() -> None:
    """The file format keeps its name ('pdcompile.costgraph/1') though the module moved into
    pdcompile/cost/: files users saved earlier still load."""
    from pdcompile.cost.costgraph import from_dict

    data = {"format": "pdcompile.costgraph/1", "name": "saved", "batch_size": 4,
            "nodes": [{"id": "x", "fwd": 0.0, "bwd": 0.0, "act": 8.0, "params": 0.0},
                      {"id": "a", "fwd": 1e-3, "bwd": 2e-3, "act": 16.0, "params": 64.0}],
            "edges": [["x", "a", {}]]}
    graph = from_dict(data)
    assert list(graph.edges) == [("x", "a")] and graph.nodes["a"]["params"] == 64.0
