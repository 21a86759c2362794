"""The cost pass says, per node, how much of its backward the runtime can defer (`wgrad`: the
weight gradients of the Linear calls the fuse pass rewrites and of the convolutions the B/W
split rewrites), and that figure travels through the
CostGraph (its file, coarsening) into StageCosts; a PipeDream profile does not say, and its
stage costs leave it unknown (None)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pdcompile.cost.costgraph import add_block, coarsen, from_dict, new_cost_graph, to_dict
from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PlanError
from pdcompile.meta import get_cost
from pdcompile.passes.trace import trace
from pdcompile.profiles import load_pipedream, profile_path


class Shared(nn.Module):
    """Two Linear modules with one weight (tied), and a convolution with circular padding (a
    padding the module applies before its convolution): the passes leave all of them to
    autograd, which computes their weight gradients in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight
        self.conv = nn.Conv1d(1, 1, 3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.second(self.first(x))
        return self.conv(y.unsqueeze(1)).squeeze(1)


def _costed(model: nn.Module, x: torch.Tensor, source: str = "analytic") -> dict[str, object]:
    gm = trace(model)
    annotate_costs(gm, (x,), source=source, repeats=1, warmup=0)
    return {n.name: get_cost(n) for n in gm.graph.nodes if n.op != "output"}


@pytest.mark.parametrize("source", ["analytic", "measured"])
def test_a_linear_defers_half_its_backward_and_all_of_it_on_a_model_input(source: str) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    costs = _costed(model, torch.randn(4, 16), source)
    first, relu, last = costs["_0"], costs["_1"], costs["_2"]
    assert first.wgrad == pytest.approx(first.bwd)  # its input needs no gradient: all dW
    assert last.wgrad == pytest.approx(last.bwd / 2)  # dW and dX: the same FLOPs
    assert relu.wgrad == 0.0 and costs["input_1"].wgrad == 0.0


def test_a_convolution_defers_its_weight_gradients_as_a_linear_does() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    costs = _costed(model, torch.randn(2, 3, 8, 8))
    first, relu, last = (costs[n] for n in ("_0", "_1", "_2"))
    assert first.wgrad == pytest.approx(first.bwd)  # its input needs no gradient: all dW
    assert last.wgrad == pytest.approx(last.bwd / 2)
    assert relu.wgrad == 0.0


def test_what_the_fuse_pass_leaves_alone_defers_nothing() -> None:
    costs = _costed(Shared(), torch.randn(4, 8))
    assert all(c.wgrad == 0.0 for c in costs.values())
    assert any(c.bwd > 0 for c in costs.values())


def test_the_cost_graph_carries_it_through_its_file_and_coarsening() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    gm = trace(model)
    annotate_costs(gm, (torch.randn(4, 16),), source="analytic")
    graph = to_cost_graph(gm)
    expected = {n.name: get_cost(n).wgrad for n in gm.graph.nodes if n.op != "output"}
    assert {n: d["wgrad"] for n, d in graph.nodes(data=True)} == expected
    again = from_dict(to_dict(graph))
    assert {n: d["wgrad"] for n, d in again.nodes(data=True)} == expected
    coarse, _ = coarsen(graph, target=2)
    assert sum(d["wgrad"] for _, d in coarse.nodes(data=True)) == pytest.approx(
        sum(expected.values()))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=8),
       st.integers(1, 4), st.data())
def test_stage_costs_sum_each_stages_share(nodes: list[tuple[float, float]], m: int,
                                           data: st.DataObject) -> None:
    graph = new_cost_graph("g", 8)
    for i, (bwd, part) in enumerate(nodes):
        add_block(graph, f"n{i}", fwd=0.1, bwd=bwd, act=1.0, params=0.0, wgrad=bwd * part)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    cut = data.draw(st.integers(1, len(nodes) - 1))
    names = [f"n{i}" for i in range(len(nodes))]
    stage_of = {n: 0 if i < cut else 1 for i, n in enumerate(names)}
    costs = StageCosts.from_assignment(graph, stage_of, 2, microbatches=m)
    assert costs.wgrad is not None
    for s, part in enumerate((nodes[:cut], nodes[cut:])):
        assert costs.wgrad[s] == pytest.approx(sum(b * p for b, p in part) / m)
        share = costs.wgrad_shares(0.5)[s]
        assert 0.0 <= share <= 1.0
        if costs.bwd[s] > 0:
            assert share == pytest.approx(costs.wgrad[s] / costs.bwd[s])


def test_a_profile_does_not_say_so_the_default_share_stands() -> None:
    graph = load_pipedream(profile_path("alexnet"))
    import networkx as nx

    order = list(nx.topological_sort(graph))
    stage_of = {n: 0 if i < len(order) // 2 else 1 for i, n in enumerate(order)}
    costs = StageCosts.from_assignment(graph, stage_of, 2)
    assert costs.wgrad is None
    assert costs.wgrad_shares(0.5) == (0.5, 0.5)


def test_stage_costs_refuse_a_weight_part_larger_than_the_backward() -> None:
    with pytest.raises(PlanError, match="wgrad"):
        StageCosts((1.0, 1.0), (1.0, 2.0), wgrad=(0.5, 2.5))
    with pytest.raises(PlanError, match="wgrad"):
        StageCosts((1.0, 1.0), (1.0, 2.0), wgrad=(0.5,))
