"""With warm caches, the measured cost pass times each node's forward where the model's forward
pass meets it, after the nodes before it (node_costs._forward_in_sequence): what the nodes
before it leave behind (on a real machine, the state of the caches) is part of its time. Here a
node that runs slowly right after another one stands in for a layer whose weights the layers
before it pushed out of the cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pdcompile.cost.node_costs import _forward_in_sequence, annotate_costs
from pdcompile.cost.timers import Timer
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


class _WatchingTimer(Timer):
    """Runs the call untimed (0 s) and notes whether the interpreter read its environment
    while the clock ran."""

    def __init__(self) -> None:
        self.running = False
        self.reads_while_running = 0

    def time(self, fn: Callable[[], Any]) -> float:
        self.running = True
        try:
            fn()
        finally:
            self.running = False
        return 0.0


def test_the_interpreters_own_work_is_outside_the_clock(monkeypatch: Any) -> None:
    """Reading a node's arguments out of the interpreter's environment (and finding its module
    by name) is work generated stage code never does; inside the clock it added about 6 us a
    node, 15-38% of small models' forwards (benchmarks/cost_fidelity.py --small)."""
    timer = _WatchingTimer()
    fetch = fx.Interpreter.fetch_args_kwargs_from_env

    def watched(self: fx.Interpreter, n: fx.Node) -> Any:
        timer.reads_while_running += timer.running
        return fetch(self, n)

    monkeypatch.setattr(fx.Interpreter, "fetch_args_kwargs_from_env", watched)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = trace(model)
    seconds = _forward_in_sequence(gm, [torch.randn(3, 4)], timer, warmup=0, repeats=2,
                                   statistic="median")
    assert set(seconds) == {n.name for n in gm.graph.nodes if n.op == "call_module"}
    assert timer.reads_while_running == 0
