"""Costs at the bottom of the float range (subnormals: 5e-324 bytes of weights) are nonsense a
profile can still hold, and the planner's bisections must end on them: the memory floor's
bisection once halved 5e-324 to 0 and back for ever (a drawn graph of the DP's brute-force test
hung the fast lane at 71%)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import networkx as nx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.planner import plan
from pdcompile.planner.costmodel import ModelOptions
from pdcompile.planner.memory_floor import least_memory

BOUND_S = 60.0
TINY = st.sampled_from([0.0, 5e-324, 1e-323, 2.2e-310])  # all but 0 subnormal


def _bounded(call: Callable[[], Any]) -> Any:
    """call() in a thread; fails the test (rather than hanging it) when it has not returned."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            failed.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BOUND_S)
    assert not worker.is_alive(), f"still running after {BOUND_S:.0f} s"
    if failed:
        raise failed[0]
    return out[0]


def test_the_memory_floor_of_subnormal_weights_ends() -> None:
    params = np.array([0.0, 5e-324, 1e-323])
    keep = np.zeros(3)
    valid = np.array([[False, True, True], [False, False, True], [False, False, False]])
    options = ModelOptions(cost_model="native")
    whole = least_memory(params[:1], keep[:1], valid[:1, :1], 1, options)
    assert whole == 0.0
    floor = _bounded(lambda: least_memory(params, keep, valid, 1, options))
    assert 0.0 <= floor <= 1e-322  # a lower bound, at most the one stage of everything


@st.composite
def _tiny_chains(draw: st.DrawFn) -> nx.DiGraph:
    graph = new_cost_graph("tiny")
    for i in range(draw(st.integers(2, 5))):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-4, 1e-2)),
                  bwd=draw(TINY | st.floats(1e-4, 1e-2)), act=draw(TINY), params=draw(TINY))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=_tiny_chains(), workers=st.integers(1, 4),
       memory=st.sampled_from([1.0, 1e9, None]))
def test_plans_of_subnormal_costs_end(graph: nx.DiGraph, workers: int,
                                      memory: float | None) -> None:
    def planned() -> Any:
        try:
            return plan(graph, Cluster.flat(workers, 1e10), planner="dp", memory=memory)
        except PlanError as refusal:  # a memory nothing fits in is refused, in one line
            assert "\n" not in str(refusal).strip()
            return None

    result = _bounded(planned)
    if result is not None:
        assert [n for s in result.stages for n in s.nodes] == list(graph.nodes)
        assert sum(s.replicas for s in result.stages) <= workers
