"""The refusal of a model that fits no plan: the memory it names is tight, it comes from few
solves (a floor of what any plan needs starts the search), and a node that no number of workers
can hold is named as the reason."""

from __future__ import annotations

from typing import Any
from unittest import mock

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.planner import search
from pdcompile.cost.memory import OPTIMIZER_STATE
from pdcompile.errors import PlanError


def _chain(params: list[float], act: float = 1e6) -> nx.DiGraph:
    graph = new_cost_graph("chain", 32)
    add_block(graph, "input", fwd=0.0, bwd=0.0, act=act, params=0.0)
    previous = "input"
    for i, p in enumerate(params):
        add_block(graph, f"l{i}", fwd=1e-3, bwd=2e-3, act=act, params=p)
        graph.add_edge(previous, f"l{i}")
        previous = f"l{i}"
    return graph


def _refusal_and_solves(graph: nx.DiGraph) -> tuple[str, list[int]]:
    """The refusal of `graph` on 2 workers of 8 GiB, and the worker count of every solve."""
    sizes: list[int] = []
    real = search.solve

    def counted(prepared: Any, cluster: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(cluster.workers)
        return real(prepared, cluster, *args, **kwargs)

    with mock.patch.object(search, "solve", counted), pytest.raises(PlanError) as refused:
        pdcompile.plan(graph, "2@1e9", planner="dp", memory="8GiB")
    return str(refused.value), sizes


def _needed(text: str) -> float:
    figure, unit = text.split("it needs ")[1].split(" per worker")[0].split()
    return float(figure) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]


@settings(max_examples=6, deadline=None)
@given(params=st.lists(st.floats(1e7, 4e8), min_size=3, max_size=8),
       cluster=st.sampled_from(["2@1e9", "4@1e10", "2x2@1e10,1e9"]))
def test_the_memory_named_is_enough_and_tight(params: list[float], cluster: str) -> None:
    graph = _chain(params)
    limit = 0.5 * max(params) * (2 + OPTIMIZER_STATE)  # below the largest node: never fits
    with pytest.raises(PlanError) as refused:
        pdcompile.plan(graph, cluster, planner="dp", memory=limit)
    needed = _needed(str(refused.value))
    pdcompile.plan(graph, cluster, planner="dp", memory=needed)  # enough
    with pytest.raises(PlanError):  # and within 1% of the least that is
        pdcompile.plan(graph, cluster, planner="dp", memory=needed * 0.99)


def test_a_node_no_worker_can_hold_is_named_without_trying_bigger_clusters() -> None:
    """A layer of 4 GB of weights (16 GB with gradients and Adam's state) on 8 GiB workers:
    more workers cannot help, and the search said 'more than 16 workers' after 7 solves on
    clusters of 4 to 16 workers."""
    graph = _chain([1e8, 4e9, 1e8])
    text, sizes = _refusal_and_solves(graph)
    assert "under any plan with schedule='1f1b' on any number of workers" in text, text
    assert "its node 'l1' alone needs 14.9" in text, text  # 4e9 x (2 + 2) bytes
    assert "more than a worker's 8.0 GiB" in text and "weights dominate" in text, text
    assert sizes and set(sizes) == {2}, sizes  # only the memory search on the cluster given


def test_bigger_clusters_the_floor_rules_out_are_not_solved() -> None:
    """Twenty layers of 1 GB (4 GB each with gradients and Adam's state) on 8 GiB workers need
    at least 10 workers by their total alone: clusters of 4, 6 and 8 are not solved."""
    graph = _chain([1e9] * 20)
    text, sizes = _refusal_and_solves(graph)
    workers = int(text.split("at least ")[1].split(" workers")[0])
    assert not {4, 6, 8} & set(sizes), sizes
    pdcompile.plan(graph, f"{workers}@1e9", planner="dp", memory="8GiB")  # the count suffices
    with pytest.raises(PlanError):
        pdcompile.plan(graph, f"{workers - 2}@1e9", planner="dp", memory="8GiB")


def _activation_chain(nodes: int, act: float) -> nx.DiGraph:
    graph = new_cost_graph("activation_chain", 32)
    add_block(graph, "input", fwd=0.0, bwd=0.0, act=act, params=0.0)
    previous = "input"
    for i in range(nodes):
        add_block(graph, f"l{i}", fwd=1e-3, bwd=2e-3, act=act, params=1e5)
        graph.add_edge(previous, f"l{i}")
        previous = f"l{i}"
    return graph


def test_a_refusal_names_the_schedule_that_fits_and_claims_no_more_than_it_tried() -> None:
    """Eight layers keeping 0.7 GiB of activations each on 4 workers of 1 GiB: schedule='1f1b'
    (the minibatch is one microbatch) fits no plan on 4 to 32 workers, while '1f1b-flush' cuts
    the minibatch into 8 and fits on these 4. The refusal said only 'more than 32 workers'."""
    graph = _activation_chain(8, 0.7 * 2**30)
    with pytest.raises(PlanError) as refused:
        pdcompile.plan(graph, "4@1e10", planner="dp", memory="1GiB", schedule="1f1b")
    text = str(refused.value)
    assert "more than 32 workers" not in text, text
    assert "none of the bigger clusters tried, up to 32 workers, fits" in text, text
    for workers in (8, 32):  # what it says it tried does not fit
        with pytest.raises(PlanError):
            pdcompile.plan(graph, f"{workers}@1e10", planner="dp", memory="1GiB",
                           schedule="1f1b")
    named = text.split("schedule=")[2].split(" fits it")[0]  # the first is the refused one's
    schedule, microbatches = named.split(" with microbatches=")
    assert (schedule.strip("'"), int(microbatches)) == ("1f1b-flush", 8), text
    fitted = pdcompile.plan(graph, "4@1e10", planner="dp", memory="1GiB",
                            schedule="1f1b-flush", microbatches=8)
    assert all(s.memory <= 2**30 * (1 + 1e-9) for s in fitted.stages)


@settings(max_examples=8, deadline=None)
@given(nodes=st.integers(2, 8), act=st.floats(0.05, 0.9), params=st.floats(1e5, 5e7),
       schedule=st.sampled_from(["1f1b", "gpipe", "2bw", "zb-h1"]))
def test_what_a_refusal_offers_fits(nodes: int, act: float, params: float,
                                    schedule: str) -> None:
    """Whatever a memory refusal offers (another schedule, a worker count) really plans, and
    what it says cannot fit does not."""
    graph = _activation_chain(nodes, act * 2**30)
    for node in list(graph.nodes)[1:]:
        graph.nodes[node]["params"] = params
    try:
        pdcompile.plan(graph, "2@1e10", planner="dp", memory="1GiB", schedule=schedule)
        return
    except PlanError as err:
        text = str(err)
    if "fits it on these 2 workers" in text:
        named = text.split("schedule=")[2].split(" fits it")[0]
        other, microbatches = named.split(" with microbatches=")
        pdcompile.plan(graph, "2@1e10", planner="dp", memory="1GiB", schedule=other.strip("'"),
                       microbatches=int(microbatches))
    if "at least " in text:
        workers = int(text.split("at least ")[1].split(" workers")[0])
        pdcompile.plan(graph, f"{workers}@1e10", planner="dp", memory="1GiB",
                       schedule=schedule)
    if "on any number of workers" in text or "none of the bigger clusters tried" in text:
        with pytest.raises(PlanError):
            pdcompile.plan(graph, "16@1e10", planner="dp", memory="1GiB", schedule=schedule)
