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
from tests.helpers.strategies import _cluster, chains, clusters, flat_clusters, small_dags

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
    elif "idle_workers" not in result.extra:  # else a plan on fewer workers was faster
        assert sum(s.replicas for s in result.stages) == cluster.workers
    else:  # tests/planner/test_fewer_workers.py: never slower than the plans it passed over
        assert sum(s.replicas for s in result.stages) < cluster.workers


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
    assert_the_period_search_keeps_its_word(graph, cluster, fraction)


def assert_the_period_search_keeps_its_word(graph: nx.DiGraph, cluster: Cluster,
                                            fraction: float) -> bool:
    """The straight plan `native_dp_period` finds for `fraction` of the even share of the work
    (if any) is within that period under `evaluate`, on the ranks it is placed on. Returns
    whether it found one."""
    options = ModelOptions(schedule="1f1b")
    prepared = prepare(graph, "native", cluster.workers, straight=True)
    tables = dp.state_tables(prepared.graph, prepared.states, prepared.pinned)
    grid = dp.stage_grid(tables, cluster, options=options, memory=None, straight=True)
    work = sum(d["fwd"] + d["bwd"] for _, d in graph.nodes(data=True))
    period = work / cluster.workers * fraction
    found = dp.native_dp_period(grid, options=options, period=period, straight=True)
    if found is None:
        return False
    result, in_flight = found
    stages = [(prepared.states.stage_nodes(s.before, s.after), s.ranks) for s in result.stages]
    if prepared.pinned:
        stages[0] = (list(prepared.pinned) + stages[0][0], stages[0][1])
    stages = expand(stages, prepared.mapping, {}, graph, order=prepared.order)
    assert [r for _, ranks in stages for r in ranks] == list(range(len(stages)))
    _, time = evaluate(graph, stages, cluster, options=options, in_flight=list(in_flight))
    assert time <= period * (1 + 1e-9)
    return True


def test_a_skip_across_a_server_interface_is_priced_by_the_period_search() -> None:
    """n1's 11.7 MB output skips two stages and leaves its server: the period search once
    priced it on the link to the next rank (same server), so it returned [n1]@0 [n3]@1 [n0]@2
    [n2, n4]@3 as reaching 0.046875 s where the closed form prices it 8% slower (the skip
    on the interface, twice in stage 0's round trip). Now what passes over a stage is priced
    on the links around it, and the plan the search returns reaches its period."""
    graph = new_cost_graph("skip")
    add_block(graph, "n0", fwd=0.0, bwd=0.0, act=0.0, params=0.0)
    add_block(graph, "n1", fwd=0.0078125, bwd=0.01953125, act=11718751.0, params=0.0)
    add_block(graph, "n2", fwd=0.0078125, bwd=0.015625, act=0.0, params=0.0)
    add_block(graph, "n3", fwd=0.00390625, bwd=0.015625, act=0.0, params=0.0)
    add_block(graph, "n4", fwd=0.0078125, bwd=0.015625, act=0.0, params=0.0)
    graph.add_edge("n1", "n2")
    cluster = _cluster("2x2", "1e9", "0", False, None)
    assert assert_the_period_search_keeps_its_word(graph, cluster, fraction=2.0)


def test_an_output_read_by_two_later_stages_is_copied_twice_by_the_period_search() -> None:
    """On loopback links the sender's CPU copies each message: n0's 12 MB output, read by n1
    and n2, goes to two stages as two copies, which the period search once counted once (its
    tables take all later readers as one stage), returning a plan 8% slower than its period.
    Now it finds none at that period (it finds one from 1.9 of the even share, as before)."""
    graph = new_cost_graph("fan-out")
    blocks = {"n0": (0.005138569085277376, 0.01700302916606309, 12013602.411398664, 48344060.0),
              "n1": (0.00795390105877384, 0.019715166192937617, 45105492.84691811, 0.0),
              "n2": (0.01, 0.0011962402139786062, 2276810.1237567123, 669728.8814513459),
              "n3": (0.0018573694945278325, 0.008821079876972154, 44222411.356473945,
                     669728.8814513459),
              "n4": (0.0001, 0.01700302916606309, 2264081.8734333995, 449647.56296741916),
              "n5": (0.0001, 0.009324112606173957, 13560616.137766914, 875734.1696925358)}
    for name, (fwd, bwd, act, params) in blocks.items():
        add_block(graph, name, fwd=fwd, bwd=bwd, act=act, params=params)
    graph.add_edges_from([("n0", "n1"), ("n0", "n2"), ("n2", "n3")])
    graph.add_edge("n0", "n5", bytes=186.0)
    graph.add_edge("n1", "n2", bytes=186.0)
    graph.add_edge("n3", "n4", bytes=38.0)
    graph.add_edge("n4", "n5", bytes=186.0)
    cluster = _cluster(4, "1e9", "20us", True, None)
    assert_the_period_search_keeps_its_word(graph, cluster, fraction=1.75)
    assert assert_the_period_search_keeps_its_word(graph, cluster, fraction=1.9)


def test_the_period_bisection_from_infinity_finds_a_period_past_a_finite_bound() -> None:
    """The drawn example where the property below's finite bound (100 x the compute + 1 s) is
    reached by no plan: the search from an infinite bound still finds the one plan's period."""
    graph = new_cost_graph("random")
    add_block(graph, "n0", fwd=0.0005888135885165856, bwd=0.0002, act=0.0, params=71903620.0)
    cluster = _cluster("2x2", "1e8", "20us", False, None)
    options = ModelOptions(schedule="1f1b")
    prepared = prepare(graph, "native", cluster.workers)
    tables = dp.state_tables(prepared.graph, prepared.states, prepared.pinned)
    grid = dp.stage_grid(tables, cluster, options=options, memory=None)
    assert dp.native_dp_bisect(grid, options=options, low=1e-6, high=1.0) is None
    found = dp.native_dp_bisect(grid, options=options, low=0.0, high=math.inf)
    assert found is not None and found[0].stages[0].ranks == (0, 1, 2, 3)
    assert 1.0 < found[0].objective < 1.0789 * 1.03 ** 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(), cluster=clusters, low=st.sampled_from([0.0, 1e-6, math.nan]))
def test_the_period_bisection_from_an_infinite_bound_searches(graph: nx.DiGraph,
                                                              cluster: Cluster,
                                                              low: float) -> None:
    """`native_dp_bisect` with an infinite upper bound (what the planner passes when every
    candidate it holds is priced infinite) finds as fast a period as from a finite bound that
    some plan reaches; it once returned the first plan reaching infinity, unsearched."""
    options = ModelOptions(schedule="1f1b")
    prepared = prepare(graph, "native", cluster.workers)
    tables = dp.state_tables(prepared.graph, prepared.states, prepared.pinned)
    grid = dp.stage_grid(tables, cluster, options=options, memory=None)
    work = sum(d["fwd"] + d["bwd"] for _, d in graph.nodes(data=True))
    finite = dp.native_dp_bisect(grid, options=options, low=1e-6, high=work * 100 + 1.0)
    unbounded = dp.native_dp_bisect(grid, options=options, low=low, high=math.inf)
    # the finite bound is 100 x the compute + 1 s, which a plan may not reach: one node of 72 MB
    # of parameters on 2x2 over 100/25 MB/s all-reduces for 4.3 s on 4 replicas (1.0789 s a
    # minibatch, a hair over its bound of 1.0789 s), so only the search from infinity finds it
    reached = dp.native_dp_period(grid, options=options, period=math.inf) is not None
    assert (unbounded is not None) == reached
    assert finite is None or unbounded is not None
    if unbounded is not None:
        assert math.isfinite(unbounded[0].objective)
    if finite is not None and unbounded is not None:
        assert math.isfinite(unbounded[0].objective)
        assert unbounded[0].objective <= finite[0].objective * 1.03 ** 2 + 1e-12
    assert dp.native_dp_bisect(grid, options=options, low=1e-6, high=math.nan) is None
