"""The measured cost pass runs every aten operation a model uses, in-place overloads included,
or names in one line the operation it cannot time and gives it its analytic cost."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pdcompile.cost import node_costs
from pdcompile.cost.node_costs import annotate_costs
from pdcompile.machine.device import DEVICES
from pdcompile.meta import get_cost
from pdcompile.passes.frontend import capture


class Buckets(nn.Module):
    """T5's relative-position pattern: an index tensor grown in place (`aten.add_.Tensor` under
    torch.export) feeds an embedding; an in-place ReLU on a layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        buckets = torch.zeros_like(ids)
        buckets += (ids > 2).long() * 5  # buckets in 0..5 + 4 positions < 10
        h = self.lin(self.emb(buckets + torch.arange(ids.shape[1])))
        torch.relu_(h)
        return h


def _graph() -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    captured = capture(Buckets(), (torch.randint(0, 5, (2, 4)),), None, frontend="export")
    return captured.graph, captured.inputs


def test_in_place_aten_overloads_are_timed_on_copies() -> None:
    gm, inputs = _graph()
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.add_.Tensor", "aten.relu_.default"} <= targets
    before = gm(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node falls back
        annotate_costs(gm, inputs, source="measured", warmup=3, repeats=20)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert get_cost(node).source == "measured"
    timed = [get_cost(n) for n in gm.graph.nodes if str(n.target) == "aten.linear.default"]
    assert timed[0].fwd > 0 and timed[0].bwd > 0
    torch.testing.assert_close(gm(*inputs), before)  # nothing it read was changed


def test_a_node_that_cannot_be_timed_gets_its_analytic_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = _graph()
    timed = node_costs._measure_node

    def refuse_linear(gm: torch.fx.GraphModule, node: torch.fx.Node, *args: object,
                      **kwargs: object) -> tuple[float, ...]:
        if str(node.target) == "aten.linear.default":
            raise RuntimeError("this op cannot be timed here\nsecond line")
        return timed(gm, node, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(node_costs, "_measure_node", refuse_linear)
    with pytest.warns(UserWarning) as caught:
        annotate_costs(gm, inputs, source="measured", device="v100", repeats=2)
    (message,) = [str(w.message) for w in caught if "cannot time" in str(w.message)]
    assert message == ("cannot time node 'linear' (linear.default): RuntimeError: this op "
                       "cannot be timed here; it gets its analytic cost on "
                       f"{DEVICES['v100'].name}")
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    cost = get_cost(linear)
    flops = 2 * 2 * 4 * 4 * 4  # batch 2 x 4 positions, 4 -> 4
    assert cost.flops_fwd == flops and cost.flops_bwd == 2 * flops
    # a V100's roofline of 256 FLOPs: nanoseconds (timing it on this CPU takes microseconds)
    assert flops / DEVICES["v100"].peak_flops(False) <= cost.fwd < 1e-6
    assert 0 < cost.bwd < 1e-6
