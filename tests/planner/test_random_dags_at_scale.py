"""Graphs nobody chose, at scale: random DAGs of hundreds to 2,000 nodes (branches, joins,
skips of any reach; costs with zeros and extremes) on clusters written in the short form.
The plan is valid (every node in one stage, no edge backwards, ranks on the cluster, each
rank holding as many chunks as every other), the simulator prices it, and it is never
predicted slower than the whole model on one worker or plain data parallelism where those
fit. Planning time and memory at this scale are measured by benchmarks/random_dags.py (no
timing asserts here)."""

from __future__ import annotations

import math
from collections import Counter

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.cost.costgraph import add_block, new_cost_graph, topological_order
from pdcompile.errors import PlanError, ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.planner.simulation import simulate_plan
from pdcompile.schedule.kinds import KINDS, kind
from tests.helpers.scale_dags import MIXED_FORMS, SHORT_FORMS, SMALL_FORMS, scale_dags

WITHIN = 1 + 1e-9
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                        HealthCheck.data_too_large]}


def _valid(plan: Plan, graph: nx.DiGraph, cluster: Cluster) -> None:
    stage_of = plan.stage_of()
    assert set(stage_of) == set(graph.nodes)
    assert all(stage_of[u] <= stage_of[v] for u, v in graph.edges)
    held = Counter(r for s in plan.stages for r in s.ranks)
    assert all(0 <= r < cluster.workers for r in held)
    assert len(set(held.values())) == 1  # one stage per rank, or as many chunks on each
    assert math.isfinite(plan.time_per_minibatch) and plan.time_per_minibatch >= 0


def _whole(graph: nx.DiGraph, ranks: tuple[int, ...], plan: Plan) -> Plan:
    return Plan(stages=(Stage(tuple(topological_order(graph)), len(ranks), ranks),),
                time_per_minibatch=0.0, dp_time=0.0, workers=max(ranks) + 1,
                schedule=plan.schedule, microbatches=plan.microbatches)


def _priced(graph: nx.DiGraph, given: Plan, cluster: Cluster) -> Plan | None:
    try:
        priced = price_plan(graph, given, cluster)
    except (PlanError, ScheduleError):
        return None
    return priced if priced.extra["fits"] else None


def _check(graph: nx.DiGraph, form: str, schedule: str) -> None:
    cluster = Cluster.parse(form)
    try:
        plan = pdcompile.plan(graph, cluster, schedule=schedule)
    except PlanError as err:
        # nothing fits the memory, or a chunked schedule needs more ranks or nodes
        chunked = schedule != "auto" and kind(schedule).chunked
        assert chunked or any(w in str(err) for w in ("fit", "cannot", "too few")), err
        return
    _valid(plan, graph, cluster)
    _, simulated = simulate_plan(graph, plan, cluster, timeline=False)
    assert math.isfinite(simulated.time_per_minibatch) and simulated.time_per_minibatch >= 0
    if cluster.is_mixed or kind(plan.schedule).chunked:
        return
    for ranks in ((0,), tuple(range(cluster.workers))):
        other = _priced(graph, _whole(graph, ranks, plan), cluster)
        if other is not None:
            assert plan.time_per_minibatch <= other.time_per_minibatch * WITHIN, (
                f"{plan.config} {plan.time_per_minibatch} against the whole model on "
                f"{len(ranks)} workers {other.time_per_minibatch}")


@settings(max_examples=2, **SETTINGS)
@given(graph=scale_dags(min_nodes=30, max_nodes=120), form=st.sampled_from(SMALL_FORMS),
       schedule=st.sampled_from(["1f1b", "1f1b-flush", "gpipe", "2bw", "zb-h1", "auto"]))
def test_random_dags_plan_validly_and_no_slower_than_one_worker_or_dp(
        graph: nx.DiGraph, form: str, schedule: str) -> None:
    _check(graph, form, schedule)


@pytest.mark.slow
@settings(max_examples=25, **SETTINGS)
@given(graph=scale_dags(min_nodes=300, max_nodes=2000), form=st.sampled_from(SHORT_FORMS),
       schedule=st.sampled_from(sorted(KINDS) + ["auto"]))
def test_random_dags_of_up_to_2000_nodes_plan_validly(graph: nx.DiGraph, form: str,
                                                      schedule: str) -> None:
    _check(graph, form, schedule)


@pytest.mark.slow
@settings(max_examples=2, **SETTINGS)  # the mixed planner takes a minute on 200 nodes
@given(graph=scale_dags(min_nodes=30, max_nodes=100), form=st.sampled_from(MIXED_FORMS))
def test_random_dags_plan_validly_on_mixed_clusters(graph: nx.DiGraph, form: str) -> None:
    _check(graph, form, "1f1b")


@pytest.mark.parametrize("schedule", sorted(KINDS) + ["auto"])
@pytest.mark.parametrize("form", ["1", "4@1e9"])
def test_a_graph_that_costs_nothing_plans_at_zero_seconds(schedule: str, form: str) -> None:
    """Every node free: no compute, no activations, no weights (a CostGraph file may say so).
    The steady-state simulation divided by its first stream's time: ZeroDivisionError under
    1f1b and 2bw."""
    graph = new_cost_graph("free")
    for i in range(3):
        add_block(graph, f"n{i}", fwd=0.0, bwd=0.0, act=0.0, params=0.0)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    cluster = Cluster.parse(form)
    try:
        plan = pdcompile.plan(graph, cluster, schedule=schedule)
    except PlanError as err:  # a chunked schedule needs more ranks or nodes than these
        assert kind(schedule).chunked, err
        return
    _valid(plan, graph, cluster)
    assert plan.time_per_minibatch == 0.0
    assert simulate_plan(graph, plan, cluster, timeline=False)[1].time_per_minibatch == 0.0


@pytest.mark.timeout(120)
def test_a_node_of_1e300_seconds_plans_without_hanging() -> None:
    """Two nodes, one costed at 1e300 s, on 4 workers under schedule="auto": the DP's
    bisection took the geometric mean of its bounds as sqrt(low * high), which overflowed to
    inf, and it bisected forever (10 minutes and more, in the search on fewer workers)."""
    graph = new_cost_graph("extreme")
    add_block(graph, "n0", fwd=1e300, bwd=1e-300, act=1e-9, params=1000.0)
    add_block(graph, "n1", fwd=1000.0, bwd=1e-9, act=5e-324, params=1e-9)
    graph.add_edge("n0", "n1")
    cluster = Cluster.parse("4@1e10")
    plan = pdcompile.plan(graph, cluster, schedule="auto")
    _valid(plan, graph, cluster)
    assert plan.time_per_minibatch >= 0.99e300 / cluster.workers  # the node on every worker


def test_a_graph_of_subnormal_costs_plans_with_cp_sat() -> None:
    """One node whose backward takes 5e-324 s (the smallest float) and whose weights are
    1e-300 bytes: CP-SAT scaled its costs to integers by SCALE_UNITS over the largest, which
    overflowed to inf ('cannot convert float infinity to integer')."""
    graph = new_cost_graph("subnormal")
    add_block(graph, "n0", fwd=0.0, bwd=5e-324, act=0.0, params=1e-300)
    cluster = Cluster.parse("4@1e10")
    plan = pdcompile.plan(graph, cluster, schedule="auto", planner="ilp")
    _valid(plan, graph, cluster)
    assert plan.time_per_minibatch < 1e-9
