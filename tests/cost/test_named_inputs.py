"""The inputs of a traced model's CostGraph are its placeholders and nothing else. Every other
source is placed like any node: a transpose of a parameter whose bytes count to a shape read of
it before (timm's halo attention) is a source without weights or backward work, and was taken
for an input, pinned to the first stage: the planner sent it down the pipeline, and a cut that
kept it in its layer was refused with a message about replicas the plan did not have."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cost import costgraph
from pdcompile.cost.crossing import input_nodes
from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
from pdcompile.passes.trace import trace


class _RelativeBias(nn.Module):
    """A layer that reads its table's length, then uses the table transposed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.table = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table.shape[0]
        return torch.relu(self.proj(x) + x[:, :rows] @ self.table.transpose(0, 1))


class _Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.ReLU()),
                                     _RelativeBias(width), _RelativeBias(width),
                                     nn.Sequential(nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_only_the_placeholders_are_inputs_and_the_list_is_saved(tmp_path) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    graph = to_cost_graph(annotate_costs(trace(_Net()), (x,), source="analytic"))
    weightless_sources = [n for n, d in graph.in_degree if d == 0
                          and not graph.nodes[n]["params"] and not graph.nodes[n]["bwd"]]
    assert len(weightless_sources) > 1  # the transposes are such sources
    assert input_nodes(graph) == ("x",)
    path = tmp_path / "graph.json"
    costgraph.save(graph, path)
    assert input_nodes(costgraph.load(path)) == ("x",)


@pytest.mark.parametrize("stages", [[1, 1, 1, 1], [1, 2, 1], [2, 2]])
def test_a_cut_between_layer_blocks_is_priced_and_trains_as_one_process(stages) -> None:
    torch.manual_seed(0)
    model, x, target = _Net(), torch.randn(8, 16), torch.randn(8, 16)
    kw = dict(example_inputs=(x,), loss_fn=_loss, schedule="1f1b-flush", microbatches=2,
              cost="analytic", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    cut = pdcompile.compile(model, f"local-{sum(stages)}", stages=stages, **kw)
    priced = pdcompile.compile(model, f"local-{sum(stages)}", plan=cut.plan, **kw)
    assert priced.plan.time_per_minibatch > 0
    # the second block's table transpose stays with its layer, not on the first stage
    where = {n: i for i, s in enumerate(priced.plan.stages) for n in s.nodes}
    transposes = sorted(n for n in where if n.startswith("transpose"))
    assert transposes and where[transposes[-1]] > 0
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        for part, goal in zip(x.chunk(2), target.chunk(2), strict=True):
            (_loss(reference(part), goal) / 2).backward()
        opt.step()
        priced.step(x, target=target)
    for name, value in reference.state_dict().items():
        assert torch.allclose(priced.state_dict()[name], value, atol=1e-6), name


def test_pricing_a_cut_the_cost_model_refuses_says_why() -> None:
    """The refusal names what is wrong with the cut, not replicas the plan does not have."""
    from pdcompile import Cluster
    from pdcompile.errors import PlanError
    from pdcompile.plan import Plan, Stage
    from pdcompile.planner import price_plan

    graph = costgraph.new_cost_graph("late input")
    costgraph.add_block(graph, "x", fwd=0.0, bwd=0.0, act=64.0, params=0.0)
    costgraph.add_block(graph, "n0", fwd=1e-3, bwd=2e-3, act=64.0, params=1e3)
    costgraph.add_block(graph, "n1", fwd=1e-3, bwd=2e-3, act=64.0, params=1e3)
    graph.add_edges_from([("n0", "n1"), ("x", "n1")])
    given = Plan(stages=(Stage(("n0",), 1, (0,)), Stage(("x", "n1"), 1, (1,))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=2)
    with pytest.raises(PlanError, match=r"inputs \['x'\] must be in the first stage"):
        price_plan(graph, given, Cluster.parse("2@1e10"), schedule="1f1b-flush",
                   microbatches=2)
