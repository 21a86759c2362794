"""The planner on mixed clusters: stages placed by speed and memory, never over a device."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.machine.device import DEVICES, Device
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.planner import price_plan
from pdcompile.planner.mixed import as_slowest, group_alone
from tests.helpers.priced_plans import fanned_graphs, plans
from tests.helpers.strategies import small_dags


def chain(n: int, *, fwd: float = 1e-2, params: float = 1e6, act: float = 1e5) -> nx.DiGraph:
    graph = new_cost_graph("chain")
    for i in range(n):
        add_block(graph, f"n{i}", fwd=fwd, bwd=2 * fwd, act=act, params=params)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    return graph


@st.composite
def small_mixed(draw: st.DrawFn) -> Cluster:
    """2-4 ranks in two groups of random speed and small memory (so that memory binds)."""
    first = draw(st.integers(1, 2))
    second = draw(st.integers(1, 2))
    devices = [Device(f"d{i}", draw(st.floats(2e8, 3e9)), 1e13, 1e12) for i in range(2)]
    speeds = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(2)]
    return Cluster(levels=Cluster.parse(f"{first + second}@1e10~5us").levels,
                   groups=(DeviceGroup(devices[0], first, speeds[0]),
                           DeviceGroup(devices[1], second, speeds[1])))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(max_nodes=5), cluster=small_mixed(),
       schedule=st.sampled_from(["1f1b", "1f1b-flush"]))
def test_a_plan_never_exceeds_a_ranks_device_memory(graph: nx.DiGraph, cluster: Cluster,
                                                    schedule: str) -> None:
    try:
        plan = pdcompile.plan(graph, cluster, schedule=schedule, microbatches=4)
    except PlanError as err:  # nothing fits: the message says so
        assert "memory" in str(err)
        return
    assert plan.planner == "mixed"
    for stage in plan.stages:
        for rank in stage.ranks:
            assert stage.memory <= cluster.device_of(rank).memory * (1 + 1e-9)
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(graph.nodes)


def test_straight_stages_get_work_in_proportion_to_speed() -> None:
    cluster = Cluster(levels=Cluster.parse("2@1e12").levels,
                      groups=(DeviceGroup(DEVICES["v100"], 1, 1.0),
                              DeviceGroup(DEVICES["v100"], 1, 0.5)))
    plan = pdcompile.plan(chain(12), cluster, straight=True)
    by_rank = {s.ranks[0]: len(s.nodes) for s in plan.stages}
    assert by_rank == {0: 8, 1: 4}  # twice as fast: twice the layers, both stages 80 ms


def test_mixed_plan_beats_the_fast_group_alone_and_the_slowest_everywhere() -> None:
    graph = chain(10, params=4e7, act=2e6)
    cluster = Cluster.parse("2x2@150GB/s,10Gbps:a100*2,v100*2")
    plan = pdcompile.plan(graph, cluster)
    alone = price_plan(graph, group_alone(graph, cluster, 0, homogeneous=pdcompile.plan),
                       cluster)
    slowest = price_plan(graph, as_slowest(graph, cluster, homogeneous=pdcompile.plan), cluster)
    assert plan.time_per_minibatch <= alone.time_per_minibatch
    assert plan.time_per_minibatch <= slowest.time_per_minibatch
    assert plan.time_per_minibatch < max(alone.time_per_minibatch, slowest.time_per_minibatch)
    assert plan.extra["found_by"] and plan.extra["mixed_candidates"]
    # the group-alone plan uses the group's ranks only
    assert {r for s in alone.stages for r in s.ranks} <= set(range(4))


def test_a_homogeneous_cluster_written_as_groups_plans_as_before() -> None:
    graph = chain(6)
    plain = Cluster.parse("4@1e10:v100")
    grouped = Cluster(levels=plain.levels, device=DEVICES["v100"],
                      groups=(DeviceGroup(DEVICES["v100"], 2), DeviceGroup(DEVICES["v100"], 2)))
    a, b = pdcompile.plan(graph, plain), pdcompile.plan(graph, grouped)
    assert a.stages == b.stages and a.time_per_minibatch == b.time_per_minibatch


def test_mixed_clusters_refuse_what_they_cannot_plan() -> None:
    cluster = Cluster.parse("2:a100*1,v100*1")
    with pytest.raises(PlanError, match="cost_model='native'"):
        pdcompile.plan(chain(4), cluster, cost_model="pipedream")
    with pytest.raises(PlanError, match="straight=True"):
        pdcompile.plan(chain(4), cluster, stages=2)
    tiny = Cluster(levels=cluster.levels, groups=(
        DeviceGroup(Device("tiny", 1e6, 1e12, 1e11), 1), DeviceGroup(DEVICES["v100"], 1)))
    with pytest.raises(PlanError, match="memory"):
        pdcompile.plan(chain(4, params=2e9), tiny)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), speeds=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=2,
                                       max_size=2),
       schedule=st.sampled_from(["1f1b-flush", "gpipe"]))
def test_closed_form_follows_the_simulator_on_mixed_clusters(
        data: st.DataObject, speeds: list[float], schedule: str) -> None:
    graph = data.draw(fanned_graphs())
    given_plan, plain = data.draw(plans(graph))
    cut = data.draw(st.integers(1, plain.workers - 1))
    cluster = Cluster(levels=plain.levels, device=plain.device, groups=(
        DeviceGroup(plain.device, cut, speeds[0]),
        DeviceGroup(DEVICES["a100"], plain.workers - cut, speeds[1])))
    stages = len(given_plan.stages)
    most = max(s.replicas for s in given_plan.stages)
    microbatches = data.draw(st.integers(max(most, 4 * stages), 32))
    priced = price_plan(graph, given_plan, cluster, schedule=schedule,
                        microbatches=microbatches, memory=1e30, simulate=True)
    closed = priced.extra["closed_form_time_per_minibatch"]
    assert closed == pytest.approx(priced.time_per_minibatch, rel=0.15)


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize(("speeds", "microbatches", "dealt"), [
    ((1.0, 0.5), 3, 0.040),  # 2 x 20 ms on the fast replica, 1 x 40 ms on the slow one
    ((1.0, 0.5), 5, 0.048),  # 3 x 12 ms fast, 2 x 24 ms slow
    ((0.5, 1.0), 3, 0.080),  # the slow replica is dealt the extra one: 2 x 40 ms
])
def test_flush_closed_form_charges_each_replica_what_the_round_robin_deals_it(
        speeds: tuple[float, float], microbatches: int, dealt: float, schedule: str) -> None:
    """The shrunk example of the property above: one stage of 60 ms per minibatch on a
    replica and one half as fast. An odd count of microbatches gives the first replica the
    extra one; where that one is the fast replica, the minibatch lasts what the slow one's
    fewer microbatches take, not the slow replica's time for the larger count (the closed
    form charged 80 ms and 72 ms for the 40 ms and 48 ms the schedule runs)."""
    from pdcompile.plan import Plan, Stage

    graph = chain(2, params=1.0)
    cluster = Cluster(levels=Cluster.parse("2@1e10~5us").levels, groups=(
        DeviceGroup(DEVICES["v100"], 1, speeds[0]), DeviceGroup(DEVICES["a100"], 1, speeds[1])))
    given_plan = Plan(stages=(Stage(tuple(graph.nodes), 2, (0, 1)),), time_per_minibatch=0.0,
                      dp_time=0.0, workers=2)
    priced = price_plan(graph, given_plan, cluster, schedule=schedule,
                        microbatches=microbatches, memory=1e30, simulate=True)
    closed = priced.extra["closed_form_time_per_minibatch"]
    assert priced.time_per_minibatch == pytest.approx(dealt, rel=1e-3)
    assert closed == pytest.approx(dealt, rel=1e-3)


def test_pricing_a_plan_its_schedule_cannot_feed_says_why() -> None:
    from pdcompile.plan import Plan, Stage

    graph = chain(4)
    given = Plan(stages=(Stage(("n0", "n1"), 3, (0, 1, 2)), Stage(("n2", "n3"), 1, (3,))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=4)
    with pytest.raises(PlanError, match="cannot feed the replicas of plan 3-1"):
        price_plan(graph, given, Cluster.parse("4@1e10"), schedule="2bw", microbatches=4)


def test_replicas_of_two_kinds_take_shares_in_proportion_to_speed() -> None:
    """docs/cost-model.md's example: 8 equal layers on A100, A100, V100 under asynchronous
    1F1B. Taking minibatches in turn, data parallelism over all three runs at the V100's pace
    (slower than the two A100 alone); with shares (2, 2, 1) it beats both."""
    graph = chain(8)
    cluster = Cluster.parse("3@10GB/s:a100*2,v100*1")
    plan = pdcompile.plan(graph, cluster)
    times = plan.extra["mixed_times"]
    assert plan.time_per_minibatch < min(times["group 0 alone"], times["as slowest"])
    mixed = [s for s in plan.stages if len({cluster.speed_of(r) for r in s.ranks}) > 1]
    assert mixed and all(len(set(s.shares)) > 1 for s in mixed)
    for stage in mixed:  # the faster replicas take more
        by_speed = sorted(zip((cluster.speed_of(r) for r in stage.ranks), stage.shares,
                              strict=True))
        assert [c for _, c in by_speed] == sorted(stage.shares)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fast=st.integers(1, 2), slow=st.integers(1, 2), ratio=st.sampled_from([0.4, 0.6]),
       schedule=st.sampled_from(["1f1b", "1f1b-flush"]))
def test_closed_form_prices_shares_as_the_simulator_does(fast: int, slow: int, ratio: float,
                                                         schedule: str) -> None:
    from pdcompile.plan import Plan, Stage
    from pdcompile.planner.mixed import with_shares

    graph = chain(6)
    cluster = Cluster(levels=Cluster.parse(f"{fast + slow}@1e10~5us").levels,
                      groups=(DeviceGroup(DEVICES["a100"], fast, 1.0),
                              DeviceGroup(DEVICES["a100"], slow, ratio)))
    workers = fast + slow
    data_parallel = Plan(stages=(Stage(tuple(graph.nodes), workers, tuple(range(workers))),),
                         time_per_minibatch=0.0, dp_time=0.0, workers=workers,
                         schedule=schedule, microbatches=4 * workers)
    shared = with_shares(data_parallel, cluster)
    assert shared is not None
    plain = price_plan(graph, data_parallel, cluster, memory=1e30, simulate=True)
    priced = price_plan(graph, shared, cluster, memory=1e30, simulate=True)
    assert priced.stages[0].shares == shared.stages[0].shares
    assert priced.extra["closed_form_time_per_minibatch"] == pytest.approx(
        priced.time_per_minibatch, rel=0.15)
    assert priced.time_per_minibatch < plain.time_per_minibatch


def test_pipelines_across_groups_may_put_a_stage_on_two_kinds() -> None:
    """The cut across groups may give a stage the rest of one group and the start of the next,
    priced at their shared speed; with its shares it beats the stage kept on one kind."""
    graph = chain(8)
    cluster = Cluster.parse("3@10GB/s:a100*2,v100*1")
    times = pdcompile.plan(graph, cluster).extra["mixed_times"]
    shared = times["across groups (0, 1), shares by speed"]
    assert shared < times["across groups (0, 1)"] and shared < times["as slowest"]
