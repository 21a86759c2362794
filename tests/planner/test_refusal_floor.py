"""Refusals proven before the search (planner/memory_floor.py): a graph no plan fits is refused
without the DPs that would all fail, the refusal's figure comes from one solve where the
relaxation over the DP's states is tight, and no graph that has a plan is refused (brute force
over every plan of small drawn graphs, at memories drawn around what they need)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.planner import dp, search
from pdcompile.planner.costmodel import ModelOptions
from pdcompile.planner.memory_floor import node_floor
from tests.helpers.brute_force import brute_force
from tests.helpers.scale_dags import layered_dag, layered_dags


def _dag(n: int = 240, width: int = 3, huge: float = 0.0) -> nx.DiGraph:
    """A layered DAG of `n` nodes of ordinary costs (10-100 MB of weights each), node n7's
    activations `huge` bytes where given."""
    graph = layered_dag(n, width, 0.3, 8, [1e-3, 2e-3, 5e-4, 1e-4, 3e-3, 1e-3],
                        [1e6, 4e6, 2e6, 8e6, 1e5, 3e6], [1e7, 5e7, 1e8, 2e7], False, 7)
    if huge:
        graph.nodes["n7"].update(act=huge, keep=huge)
    return graph


def _solves(graph: nx.DiGraph, form: str, **kwargs: Any) -> tuple[str, int]:
    """The refusal of `graph` on `form` and how many DP passes it ran."""
    calls = []
    real = dp._native_dp

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    with mock.patch.object(dp, "_native_dp", counted), pytest.raises(PlanError) as refused:
        pdcompile.plan(graph, form, **kwargs)
    return str(refused.value), len(calls)


def test_a_node_no_worker_holds_is_refused_after_one_dp_naming_it() -> None:
    """Node n7 keeps 1 TB of activations: no plan fits 16 GiB workers. Before, the search ran
    every DP of its candidates and the refusal's memory search (about 30 passes here); now the
    floor refuses before the search and the relaxation over the DP's states finds the memory
    the cluster would need in one solve."""
    text, passes = _solves(_dag(huge=1e12), "2x4@1e10,1e9")
    assert passes <= 1, passes
    assert "its node 'n7' alone needs 931.3" in text, text
    assert "of one microbatch's kept activations" in text and "more microbatches" in text, text
    needed = float(text.split("it needs ")[1].split(" GiB per worker")[0])
    pdcompile.plan(_dag(huge=1e12), "2x4@1e10,1e9", memory=f"{needed}GiB")  # it suffices


def test_too_much_in_all_is_refused_after_one_dp_with_the_workers_that_fit() -> None:
    """240 nodes of up to 100 MB of weights (400 MB with Adam's state) on 4 workers of 1 GiB:
    more than their sum can hold."""
    graph = _dag()
    floor = node_floor(graph, ModelOptions())
    limit = 0.5 * floor.total / 4
    assert floor.largest < limit
    text, passes = _solves(graph, "4@1e10", memory=limit)
    assert passes <= 2, passes  # the figure's solve, and the bigger cluster that fits
    assert "its nodes together need" in text and "workers with" in text, text


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=layered_dags(min_nodes=3, max_nodes=6),
       form=st.sampled_from(["2@1e9", "3@1e10", "2x2@1e10,1e9"]),
       scale=st.floats(0.2, 3.0))
def test_refused_iff_no_plan_fits_by_brute_force(graph: nx.DiGraph, form: str,
                                                 scale: float) -> None:
    """At a memory drawn around the node floor on the cluster, the planner refuses exactly
    where no plan (every chain of downsets, every replica split) fits it."""
    cluster = Cluster.parse(form)
    options = ModelOptions()
    memory = max(node_floor(graph, options).on(cluster.workers) * scale, 1.0)
    exists = brute_force(graph, cluster, options=options, memory=memory) is not None
    try:
        search.plan(graph, cluster, planner="dp", memory=memory)
        planned = True
    except PlanError as err:
        assert "under any plan" in str(err), err
        planned = False
    if not planned:
        assert not exists, f"refused at {memory} B though a plan fits"
