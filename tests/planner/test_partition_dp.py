"""PipeDream's DP against a brute-force enumerator on tiny chains and branching DAGs."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.planner import dp, plan
from pdcompile.planner.antichain import antichain_states, prefix_states
from pdcompile.planner.costmodel import ModelOptions, evaluate, planning_objective
from pdcompile.planner.dp_search import expand, planning_dp, prepare
from tests.helpers.brute_force import brute_force
from tests.helpers.strategies import clusters, flat_clusters, small_dags

NATIVE = ModelOptions(cost_model="native")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(), cluster=clusters, memory_fraction=st.sampled_from([None, 0.3, 0.8, 2.0]),
       straight=st.booleans())
def test_dp_matches_brute_force(graph: nx.DiGraph, cluster: Cluster,
                                memory_fraction: float | None, straight: bool) -> None:
    memory = None
    if memory_fraction is not None:
        total = sum(d["params"] * 4 + d["act"] * 4 for _, d in graph.nodes(data=True))
        memory = max(1.0, total * memory_fraction)
    expected = brute_force(graph, cluster, options=NATIVE, memory=memory or math.inf,
                           straight=straight)
    if expected is None:
        with pytest.raises(PlanError):
            planning_dp(graph, cluster, options=NATIVE, memory=memory or 1e30,
                        straight=straight)
        with pytest.raises(PlanError, match="does not fit"):
            plan(graph, cluster, planner="dp", memory=memory or 1e30, straight=straight)
        return
    objective, stages = planning_dp(graph, cluster, options=NATIVE, memory=memory or 1e30,
                                    straight=straight)
    assert objective == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
    assert planning_objective(graph, stages, cluster, options=NATIVE,
                              memory=memory or 1e30) == pytest.approx(objective, rel=1e-9)
    # the plan the planner returns fits the memory and uses the workers as asked
    result = plan(graph, cluster, planner="dp", memory=memory or 1e30, straight=straight)
    assert result.extra["states"] == "all downsets"
    if memory is not None:
        assert all(s.memory <= memory * (1 + 1e-9) for s in result.stages)
    if straight:
        assert all(s.replicas == 1 for s in result.stages)
    else:
        assert sum(s.replicas for s in result.stages) == cluster.workers


@st.composite
def chains(draw: st.DrawFn, max_nodes: int = 6) -> nx.DiGraph:
    """Random chains: PipeDream's antichain states of a chain are all its prefixes."""
    n = draw(st.integers(1, max_nodes))
    graph = new_cost_graph("chain")
    for i in range(n):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-4, 1e-2)), bwd=draw(st.floats(1e-4, 2e-2)),
                  act=draw(st.floats(0, 5e7)), params=draw(st.floats(0, 1e6) | st.floats(0, 1e8)))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=chains(), cluster=flat_clusters)
def test_pipedream_dp_matches_brute_force_on_chains(graph: nx.DiGraph, cluster: Cluster) -> None:
    # The pipedream-mode DP (flat cluster, replication, no memory constraint: the original's
    # default) finds the best plan that evaluate() prices under the original's model.
    pipedream = ModelOptions(cost_model="pipedream")
    expected = brute_force(graph, cluster, options=pipedream, memory=None)
    assert expected is not None
    result = plan(graph, cluster, planner="dp", cost_model="pipedream")
    assert result.time_per_minibatch == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
    assert sum(s.replicas for s in result.stages) == cluster.workers


def test_replication_chosen_for_a_compute_heavy_chain() -> None:
    graph = new_cost_graph("chain")
    for i in range(3):
        add_block(graph, f"l{i}", fwd=0.01, bwd=0.02, act=1e3, params=1e3)
        if i:
            graph.add_edge(f"l{i - 1}", f"l{i}")
    result = plan(graph, "4@1e10", planner="dp")
    expected = brute_force(graph, Cluster.parse("4@1e10"), options=NATIVE,
                           memory=result.extra["memory_limit"])
    assert expected is not None
    assert [len(r) for _, r in expected[1]] == [4]
    assert result.config == "4"  # tiny weights: data parallelism wins


def test_antichain_states_match_pipedream_counts_on_a_diamond() -> None:
    graph = new_cost_graph("diamond")
    for name in "abcd":
        add_block(graph, name, fwd=1.0, bwd=1.0, act=1.0, params=1.0)
    graph.add_edges_from([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    complete = antichain_states(graph, complete=True)
    # downsets: {}, a, ab, ac, abc, abcd
    assert len(complete) == 6
    pipedream = antichain_states(graph)
    assert {bin(d).count("1") for d in pipedream.downsets} <= {0, 1, 2, 3, 4}
    assert pipedream.downsets[0] == 0 and pipedream.downsets[-1] == 0b1111
    assert len(prefix_states(graph)) == 5


def test_pipedream_state_counts_of_shipped_profiles(profiles_dir: object) -> None:
    from pathlib import Path

    from pdcompile.planner.costmodel import pipedream_view
    from pdcompile.profiles import load_pipedream

    # The README's counts: VGG-16 40, AlexNet 22, ResNet-50 240, GNMT 99 (plus our empty state)
    for model, count in (("vgg16", 40), ("alexnet", 22), ("resnet50", 240), ("gnmt", 99)):
        graph = pipedream_view(load_pipedream(Path(str(profiles_dir)) / model / "graph.txt"))[0]
        assert len(antichain_states(graph)) == count + 1, model


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(), cluster=clusters, fraction=st.floats(0.3, 3.0))
def test_a_straight_plan_reaching_a_period_is_priced_where_it_is_placed(
        graph: nx.DiGraph, cluster: Cluster, fraction: float) -> None:
    """The period search (`dp.native_dp_period`, straight, possibly on fewer workers than the
    cluster) returns plans whose closed-form time is within the period it was asked for: each
    stage priced on the ranks it is given (it once priced them on the last ranks and placed them
    on the first, which a server's shared interface makes differ)."""
    options = ModelOptions(schedule="1f1b")
    prepared = prepare(graph, "native", cluster.workers, straight=True)
    tables = dp.state_tables(prepared.graph, prepared.states, prepared.pinned)
    grid = dp.stage_grid(tables, cluster, options=options, memory=None, straight=True)
    work = sum(d["fwd"] + d["bwd"] for _, d in graph.nodes(data=True))
    period = work / cluster.workers * fraction
    found = dp.native_dp_period(grid, options=options, period=period, straight=True)
    if found is None:
        return
    result, in_flight = found
    stages = [(prepared.states.stage_nodes(s.before, s.after), s.ranks) for s in result.stages]
    if prepared.pinned:
        stages[0] = (list(prepared.pinned) + stages[0][0], stages[0][1])
    stages = expand(stages, prepared.mapping, {}, graph, order=prepared.order)
    assert [r for _, ranks in stages for r in ranks] == list(range(len(stages)))
    _, time = evaluate(graph, stages, cluster, options=options, in_flight=list(in_flight))
    assert time <= period * (1 + 1e-9)
