"""The CP-SAT model: agrees with brute force and the DP on tiny graphs, never worse than the DP."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.passes.partition.costmodel import ModelOptions
from pdcompile.planner import plan
from tests.partition_bruteforce import brute_force
from tests.test_partition_dp import clusters, small_dags

NATIVE = ModelOptions(cost_model="native")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(max_nodes=5), cluster=clusters,
       memory_fraction=st.sampled_from([None, 0.5, 2.0]))
def test_ilp_matches_brute_force_and_dp(graph: nx.DiGraph, cluster: Cluster,
                                        memory_fraction: float | None) -> None:
    memory = 1e30
    if memory_fraction is not None:
        total = sum(d["params"] * 4 + d["act"] * 4 for _, d in graph.nodes(data=True))
        memory = max(1.0, total * memory_fraction)
    expected = brute_force(graph, cluster, options=NATIVE, memory=memory)
    if expected is None:
        with pytest.raises(PlanError, match="does not fit"):
            plan(graph, cluster, planner="ilp", memory=memory)
        return
    dp = plan(graph, cluster, planner="dp", memory=memory)
    ilp = plan(graph, cluster, planner="ilp", memory=memory, time_limit=20)
    assert ilp.planner == "ilp"
    assert ilp.status == "OPTIMAL"
    assert ilp.time_per_minibatch <= dp.time_per_minibatch * (1 + 1e-12)
    assert ilp.time_per_minibatch == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
    assert ilp.bound is not None and ilp.bound <= ilp.time_per_minibatch
    assert ilp.gap is not None and ilp.gap < 1e-3
    assert all(s.memory <= memory * (1 + 1e-9) for s in ilp.stages)
    assert sum(s.replicas for s in ilp.stages) == cluster.workers


def _wide_graph() -> nx.DiGraph:
    """Two parallel branches with a skip connection: a DAG the DP linearises."""
    graph = new_cost_graph("wide")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=4e6, params=0.0)
    costs = {"a": 3e-3, "b1": 5e-3, "b2": 4e-3, "c1": 2e-3, "c2": 6e-3, "d": 3e-3}
    for name, t in costs.items():
        add_block(graph, name, fwd=t, bwd=2 * t, act=8e6, params=4e6)
    graph.add_edges_from([("x", "a"), ("a", "b1"), ("b1", "b2"), ("a", "c1"), ("c1", "c2"),
                          ("b2", "d"), ("c2", "d"), ("x", "d")])
    return graph


def test_ilp_never_worse_than_its_hint_on_a_hierarchical_cluster() -> None:
    graph = _wide_graph()
    cluster = Cluster.parse("2x2@1e10,1e8")
    dp = plan(graph, cluster, planner="dp")
    ilp = plan(graph, cluster, planner="ilp", time_limit=10)
    assert ilp.time_per_minibatch <= dp.time_per_minibatch * (1 + 1e-12)
    assert ilp.extra["dp_time_per_minibatch"] == pytest.approx(dp.time_per_minibatch)
    assert ilp.status in ("OPTIMAL", "FEASIBLE")


def test_ilp_reports_bound_and_gap_under_a_tight_time_limit() -> None:
    graph = new_cost_graph("chain")
    for i in range(30):
        add_block(graph, f"l{i}", fwd=1e-3 * (1 + i % 7), bwd=2e-3 * (1 + i % 5),
                  act=1e6 * (1 + i % 3), params=1e6 * (i % 4))
        if i:
            graph.add_edge(f"l{i - 1}", f"l{i}")
    dp = plan(graph, "8@1e9", planner="dp")
    ilp = plan(graph, "8@1e9", planner="ilp", time_limit=0.5)
    assert ilp.status in ("OPTIMAL", "FEASIBLE")
    assert ilp.time_per_minibatch <= dp.time_per_minibatch * (1 + 1e-12)
    assert ilp.bound is not None and ilp.bound <= ilp.time_per_minibatch * (1 + 1e-9)
    assert not math.isnan(ilp.gap or 0.0)


def test_ilp_refuses_the_pipedream_model() -> None:
    with pytest.raises(PlanError, match="native"):
        plan(_wide_graph(), "2@1e9", planner="ilp", cost_model="pipedream")
