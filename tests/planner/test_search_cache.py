"""planner/search_cache.py: one planning call builds each schedule once, prices each plan once,
and plans exactly as it would without the cache.

Before, the mixed planner built 335 schedules of 106 distinct ones on VGG-16 over 8 A100 and
8 V100 (its local search moves stage boundaries, which leaves the schedule as it was), and
building and validating them was 14 s of its 36.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings

import pdcompile
from pdcompile import Cluster
from pdcompile.backends.simulate import Prepared, prepare
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.plan import Plan
from pdcompile.planner.search_cache import SearchCache
from pdcompile.schedule import build as build_module
from pdcompile.schedule.build import build
from pdcompile.schedule.ir import Schedule
from tests.helpers.strategies import drawn_chains, mixed_clusters


def _chain() -> nx.DiGraph:
    """A chain drawn for tests/planner/test_mixed_brute_force.py whose fastest plan puts the
    parameters alone on a fast rank: the local search and the descent over rank sets both
    walk far on it."""
    graph = new_cost_graph("chain")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=6.0e6, params=0.0)
    blocks = [(9.73e-3, 9.24e-3, 4.53e7, 0.0), (1.0e-3, 3.11e-3, 9.25e7, 3.07e7),
              (3.26e-3, 6.95e-3, 1.0e5, 0.0)]
    for i, (fwd, bwd, act, params) in enumerate(blocks):
        add_block(graph, f"n{i}", fwd=fwd, bwd=bwd, act=act, params=params)
        graph.add_edge("x" if i == 0 else f"n{i - 1}", f"n{i}")
    return graph


def _cluster() -> Cluster:
    """Two fast ranks, then two at 0.4 of their speed, on one level."""
    return Cluster(levels=Cluster.parse("4@1e9~5us").levels,
                   groups=(DeviceGroup(DEVICES["a100"], 2, 1.0),
                           DeviceGroup(DEVICES["a100"], 2, 0.4)))


class _NothingKept(SearchCache):
    """A cache that finds nothing again: every schedule built and every plan priced anew, as
    the planner did before it had one."""

    def schedule(self, name: str, stage_ranks: Sequence[Sequence[int]], microbatches: int,
                 **options: Any) -> tuple[Schedule, Prepared]:
        self.builds += 1
        lowered = build(name, stage_ranks, microbatches, **options)
        return lowered, prepare(lowered)

    def price(self, key: Hashable, keep: Any, work: Callable[[], Any]) -> Any:
        self.prices += 1
        return work()


def _validated(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[Any, ...]]:
    """Every schedule `schedule.build` validates from now on, by its content."""
    seen: Counter[tuple[Any, ...]] = Counter()
    validate = build_module.validate

    def counted(schedule: Schedule, *, progress: bool = True) -> None:
        seen[schedule.name, schedule.stage_ranks, schedule.microbatches,
             tuple(sorted(schedule.actions.items())), repr(sorted(schedule.options.items()))] += 1
        validate(schedule, progress=progress)

    monkeypatch.setattr(build_module, "validate", counted)
    return seen


def _fingerprint(plan: Plan) -> tuple[Any, ...]:
    """What the planner chose and its price, exactly."""
    return (plan.config, plan.schedule, plan.microbatches, plan.time_per_minibatch,
            tuple((s.nodes, s.ranks, s.shares, s.in_flight, s.recompute) for s in plan.stages),
            plan.extra.get("found_by"), plan.extra.get("mixed_candidates"))


def test_a_mixed_search_builds_no_schedule_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drawn chain on 2 fast and 2 slow ranks: the local search by simulation and the descent
    over rank sets meet the same schedules again and again; each is built once."""
    seen = _validated(monkeypatch)
    pdcompile.plan(_chain(), _cluster())
    assert seen and max(seen.values()) == 1, \
        f"{sum(seen.values())} schedules built, {len(seen)} distinct"


def test_the_cache_counts_what_it_found_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache a caller hands in is the one the whole search uses: its builds are the
    schedules validated, and it found schedules and prices again."""
    seen = _validated(monkeypatch)
    cache = SearchCache()
    pdcompile.plan(_chain(), _cluster(), cache=cache)
    assert cache.builds == len(seen) == sum(seen.values()) and cache.schedule_hits > 0
    assert cache.prices > 0 and cache.price_hits > 0


def test_without_the_cache_the_same_search_builds_schedules_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The count above is the cache's doing: without it the same search builds duplicates."""
    seen = _validated(monkeypatch)
    pdcompile.plan(_chain(), _cluster(), cache=_NothingKept())
    assert max(seen.values()) > 1


def _same_with_and_without(graph: nx.DiGraph, cluster: Cluster, **options: Any) -> None:
    kept = pdcompile.plan(graph, cluster, **options)
    anew = pdcompile.plan(graph, cluster, cache=_NothingKept(), **options)
    assert _fingerprint(kept) == _fingerprint(anew)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=mixed_clusters(max_workers=4), graph=drawn_chains(max_blocks=3))
def test_the_cache_changes_no_plan_nor_its_price(cluster: Cluster, graph: nx.DiGraph) -> None:
    """Drawn chains on drawn mixed clusters (1-3 device groups of up to 4 ranks): the plan,
    its ranks, shares, in-flight counts, price and the ranking of the mixed candidates are
    the same whether the search finds its schedules and prices again or makes them anew."""
    _same_with_and_without(graph, cluster, schedule="1f1b")


def test_a_cached_build_that_failed_fails_again_alike() -> None:
    """A schedule that cannot be built raises the same error from the table as at first."""
    cache = SearchCache()
    errors = []
    for _ in range(2):
        with pytest.raises(pdcompile.errors.ScheduleError) as caught:
            cache.schedule("1f1b", [[0], [1]], 0, per_minibatch=1, stage_edges=None,
                           warmup=None, recompute=(), shares=None)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and cache.builds == 1 and cache.schedule_hits == 1


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=mixed_clusters(max_workers=6), graph=drawn_chains(max_blocks=5))
def test_the_cache_changes_no_plan_nor_its_price_on_wider_draws(
        cluster: Cluster, graph: nx.DiGraph) -> None:
    """As above on up to 6 ranks and 5 blocks, every schedule the planner tries."""
    _same_with_and_without(graph, cluster)
