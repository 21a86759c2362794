"""With warm caches, the measured cost pass times each node's forward where the model's forward
pass meets it, after the nodes before it (node_costs._forward_in_sequence): what the nodes
before it leave behind (on a real machine, the state of the caches) is part of its time. Here a
node that runs slowly right after another one stands in for a layer whose weights the layers
before it pushed out of the cache."""

from __future__ import annotations

import time

import torch
from torch import nn

from pdcompile.cost.node_costs import annotate_costs
from pdcompile.meta import get_cost
from pdcompile.passes.trace import trace

PAUSE = 0.03  # seconds the second node takes right after the first one


class First(nn.Module):
    def __init__(self, state: dict[str, str]) -> None:
        super().__init__()
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state["last"] = "first"
        return x + 1


class Second(nn.Module):
    def __init__(self, state: dict[str, str]) -> None:
        super().__init__()
        self.state = state
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.get("last") == "first":
            time.sleep(PAUSE)
        self.state["last"] = "second"
        return self.linear(x)


def _costs(caches: str) -> dict[str, float]:
    state: dict[str, str] = {}
    model = nn.Sequential(First(state), Second(state))
    gm = trace(model, leaf_modules=(First, Second))
    annotate_costs(gm, (torch.randn(2, 4),), caches=caches, warmup=1, repeats=5)
    return {n.name: get_cost(n).fwd for n in gm.graph.nodes if n.op == "call_module"}


def test_a_forward_is_timed_after_the_nodes_before_it() -> None:
    fwd = _costs("warm")
    assert fwd["_1"] >= 0.8 * PAUSE  # every pass meets it right after the first node
    assert fwd["_0"] < PAUSE / 2


def test_cold_caches_keep_each_node_timed_alone_after_a_flush() -> None:
    fwd = _costs("cold")
    assert fwd["_1"] < PAUSE / 2  # timed again and again on its own
