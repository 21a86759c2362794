"""Drawn graphs at scale on drawn clusters: layered DAGs of up to 3,000 nodes (1 to 8 branches
wide, skips of any reach; costs with zeros, the smallest normal float, tiny, huge values and
sometimes one node that dominates all others) on flat clusters of 2 to 128 workers and on
servers. The planner returns a valid plan or one clear PlanError; its memory stays within the
DP's budgets plus a margin (`BOUND`); and the plan's price is the simulator's where the
planner simulated it (to the tolerance test_pricing_consistency.py holds it to)."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.planner import dp
from pdcompile.planner.simulation import simulate_steady
from tests.helpers.scale_dags import cluster_forms, layered_dags

# What planning may hold at its peak: the DP grid keeps stage parts and objectives only up to
# its two budgets (planner/dp.py) and recomputes the rest; everything else it builds (the
# graph's copies and coarsenings, antichain states within their budget, steady-state event
# graphs of at most PAIRS_CAP microbatches) is small: the traced peaks of 12 draws of 500-2,740
# nodes on up to 107 workers were 22-705 MiB (the largest: refusals, whose search for the
# memory that would fit plans many times), so 256 MiB over the budgets' 768 catches a structure
# that grows with the graph or the cluster (a table of states x states x workers for 3,000
# nodes on 128 workers is gigabytes) without flaking.
BOUND = dp.PARTS_BYTES + dp.VALUES_BYTES + (256 << 20)
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                        HealthCheck.data_too_large]}
# the causes PlanError names where no plan exists: memory, or a stage count the DP cannot make
REFUSALS = ("fit", "cannot", "too few", "at most")


def _planned(graph: nx.DiGraph, form: str) -> tuple[pdcompile.Plan | None, int]:
    """The plan (None where the planner refused, with a clear message) and the traced peak."""
    tracemalloc.start()
    try:
        plan = pdcompile.plan(graph, form)
    except PlanError as err:
        assert any(word in str(err) for word in REFUSALS), err
        assert len(str(err).splitlines()) <= 3, err
        plan = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return plan, peak


def _check(graph: nx.DiGraph, form: str) -> None:
    plan, peak = _planned(graph, form)
    assert peak < BOUND, f"{peak / 2**20:.0f} MiB traced planning {graph} on {form}"
    if plan is None:
        return
    cluster = Cluster.parse(form)
    stage_of = plan.stage_of()
    assert set(stage_of) == set(graph.nodes)
    assert all(stage_of[u] <= stage_of[v] for u, v in graph.edges)
    held = Counter(r for s in plan.stages for r in s.ranks)
    assert all(0 <= r < cluster.workers for r in held)
    assert len(set(held.values())) == 1
    assert math.isfinite(plan.time_per_minibatch) and plan.time_per_minibatch >= 0
    if "simulated_time_per_minibatch" in plan.extra:  # else over the simulation budget
        _, simulated = simulate_steady(graph, plan, cluster)
        assert plan.time_per_minibatch == pytest.approx(simulated.time_per_minibatch, rel=1e-9)


@settings(max_examples=3, **SETTINGS)
@given(graph=layered_dags(min_nodes=10, max_nodes=60), form=cluster_forms(most=8))
def test_drawn_dags_plan_validly_in_bounded_memory_at_the_simulators_price(
        graph: nx.DiGraph, form: str) -> None:
    _check(graph, form)


@pytest.mark.slow
@settings(max_examples=6, **SETTINGS)  # ~35 s each on 2 cores: CI's 90 minutes hold it
@given(graph=layered_dags(min_nodes=500, max_nodes=3000), form=cluster_forms(most=128))
def test_drawn_dags_of_thousands_of_nodes_on_up_to_128_workers(graph: nx.DiGraph,
                                                               form: str) -> None:
    _check(graph, form)
