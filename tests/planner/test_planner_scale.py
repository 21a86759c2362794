"""The planner at scale: its DP keeps only what it needs (rows of the grid within byte budgets,
units of workers on wide clusters, states within a budget), so that graphs nobody chose plan in
bounded memory on any cluster, and plans stay what the full grid gives."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile import Cluster
from pdcompile.errors import PlanError
from pdcompile.plan import Plan
from pdcompile.planner import dp
from pdcompile.planner.antichain import prefix_states
from pdcompile.planner.costmodel import ModelOptions
from pdcompile.planner.dp_search import prepare, state_budget
from tests.helpers.capped_plan import plan_random_chain_capped
from tests.helpers.graphs import random_chain

H100 = "{levels}@450GB/s,400Gbps~3us,5us:h100"


def _valid(plan: Plan, graph: nx.DiGraph, workers: int) -> None:
    """Every node in one stage, stages in an order every edge respects, ranks on the cluster
    and never shared between stages."""
    stage_of = plan.stage_of()
    assert set(stage_of) == set(graph.nodes)
    assert all(stage_of[u] <= stage_of[v] for u, v in graph.edges)
    ranks = [r for s in plan.stages for r in s.ranks]
    assert len(ranks) == len(set(ranks)) and all(0 <= r < workers for r in ranks)


@given(st.integers(1, 6000))
def test_units_cover_the_workers_in_at_most_unit_limit_near_equal_groups(workers: int) -> None:
    bounds = dp.unit_bounds(workers)
    sizes = bounds[1:] - bounds[:-1]
    assert bounds[0] == 0 and bounds[-1] == workers
    assert len(sizes) == min(workers, dp.UNIT_LIMIT) or len(sizes) >= dp.UNIT_LIMIT // 2
    assert len(sizes) <= dp.UNIT_LIMIT and sizes.min() >= 1 and sizes.max() - sizes.min() <= 1
    assert dp.dp_pairs(workers) <= dp.UNIT_LIMIT * (dp.UNIT_LIMIT + 1) // 2
    assert (dp.unit_bounds(workers, straight=True) == range(workers + 1)).all()


@given(nodes=st.integers(2, 120), skips=st.integers(0, 40), most=st.integers(2, 60),
       seed=st.integers(0, 99))
def test_prefix_states_keep_at_most_the_budget_and_the_frontiers_of_their_cuts(
        nodes: int, skips: int, most: int, seed: int) -> None:
    graph = random_chain(nodes, skips=skips, seed=seed)
    every = prefix_states(graph)
    some = prefix_states(graph, most=most)
    assert len(some) <= max(most, 2) and some.downsets[0] == 0
    assert some.downsets[-1] == (1 << nodes) - 1
    assert list(some.downsets) == sorted(set(some.downsets))  # nested, growing
    if nodes + 1 <= most:
        assert some == every
    for bits, front in zip(some.downsets, some.frontier, strict=True):
        assert front == every.frontier[every.downsets.index(bits)]


@pytest.mark.parametrize("workers", [6, 40])
def test_the_dp_plans_the_same_when_the_grid_keeps_no_row(
        workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows rebuilt on every pass give the plans of rows kept (both flights, the short
    variant and the bisection on the period), on one worker per unit and on units."""
    graph = random_chain(60, skips=10, seed=3)
    cluster = Cluster.parse(f"{workers}@10GB/s~5us")
    options = ModelOptions(schedule="1f1b")
    prepared = prepare(graph, "native", workers)
    tables = dp.state_tables(prepared.graph, prepared.states, prepared.pinned)

    def plans() -> list[object]:
        grid = dp.stage_grid(tables, cluster, options=options, memory=2e9, recompute=True)
        out: list[object] = [dp.native_dp(grid, options=options),
                             dp.native_dp(grid, options=replace(options, flight="noam")),
                             dp.native_dp(grid, options=options, max_stages=2)]
        return out + [dp.native_dp_bisect(grid, options=options, low=1e-4, high=1.0)]

    kept = plans()
    monkeypatch.setattr(dp, "PARTS_BYTES", 0)
    monkeypatch.setattr(dp, "VALUES_BYTES", 0)
    assert plans() == kept
    stages = kept[0].stages  # type: ignore[attr-defined]
    assert sorted(r for s in stages for r in s.ranks) == list(range(workers))


def test_the_state_budget_follows_the_grids_width() -> None:
    # up to 32 workers: the budget the planner always had (the benchmarks' plans)
    assert [state_budget(w) for w in (1, 4, 8, 16)] == [1500, 1414, 745, 383]
    # wider: at most 32 units, so never fewer states than that
    assert all(state_budget(w) >= 200 for w in (32, 64, 999, 5000))
    assert state_budget(16, straight=True) == state_budget(16)
    assert state_budget(1024, straight=True) == int((2 * 1e7 / 1024) ** 0.5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.integers(1, 60), skips=st.integers(0, 30), seed=st.integers(0, 999),
       levels=st.sampled_from(["3", "8", "40", "8x2", "8x8", "300", "1000"]),
       memory=st.sampled_from([None, "200MB"]))
def test_random_graphs_plan_on_any_cluster(nodes: int, skips: int, seed: int, levels: str,
                                           memory: str | None) -> None:
    """Graphs nobody chose (random costs, short skips) on flat and two-level clusters of up
    to 1,000 workers: a valid plan, or one clear PlanError where nothing fits the memory."""
    graph = random_chain(nodes, skips=skips, seed=seed)
    cluster = Cluster.parse(H100.format(levels=levels) if "x" in levels
                            else f"{levels}@450GB/s~3us:h100")
    try:
        plan = pdcompile.plan(graph, cluster, memory=memory, simulate=False)
    except PlanError as err:
        assert memory is not None and "does not fit" in str(err)
        return
    _valid(plan, graph, cluster.workers)


def test_a_wide_flat_cluster_plans_in_units_within_bounded_memory() -> None:
    """200 nodes with skips on 1,024 flat workers: units of workers, a bounded grid (the kept
    rows' budgets and a few rows being built), a valid plan."""
    graph = random_chain(200, skips=20, seed=1)
    for workers in (1024,):
        cluster = Cluster.flat(workers, "100GB/s", device="h100")
        tracemalloc.start()
        try:
            plan = pdcompile.plan(graph, cluster, simulate=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        _valid(plan, graph, workers)
        assert "units of about" in plan.extra["states"]
        assert peak < dp.PARTS_BYTES + dp.VALUES_BYTES + (256 << 20), peak


def test_stages_beyond_what_the_dp_balances_are_refused_in_one_line() -> None:
    graph = random_chain(700, seed=2)
    with pytest.raises(PlanError, match=r"stages=600: .* at most 512 .* pass stages=512"):
        pdcompile.plan(graph, Cluster.flat(600, "10GB/s"), stages=600)


@pytest.mark.slow
@pytest.mark.parametrize("levels", ["1024", "8x128"])
def test_two_thousand_random_nodes_on_1024_workers_under_a_4_gb_address_space(
        levels: str) -> None:
    """A 2,000-node graph with random costs and 200 short skips planned on 1,024 workers in a
    process whose address space is capped at 4 GB (torch and OR-Tools imported first, as in a
    user's process: together about 0.8 GB of it)."""
    cluster = H100.format(levels=levels) if "x" in levels else f"{levels}@450GB/s~3us:h100"
    out = plan_random_chain_capped(nodes=2000, skips=200, cluster=cluster)
    ranks = [r for stage in out["ranks"] for r in stage]
    assert len(ranks) == len(set(ranks)) and max(ranks) < 1024
