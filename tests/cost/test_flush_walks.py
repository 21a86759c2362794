"""Walks through flush orders kept for a search (cost/flush_path.py `FlushWalk`).

Which rank runs next, which transfers an action waits for and which link each send takes
depend on the order and the stage edges alone, so a search works the walk out once per shape
and replays it for every cut with that shape's seconds. A kept walk must price every plan as
the pass did when it followed every dependency again on each call (the oracle,
tests/helpers/flush_walk_reference.py), to the bit: the same plan twice, and plans that share
the walk but differ in one stage's seconds, paces or deferred weight gradients, or in one
edge's bytes (none among them: a send of nothing).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile.cost.flush_path as flush_path
import pdcompile.cost.pipeline_time as pipeline_time
from pdcompile import Cluster
from pdcompile.cost.flush_path import FlushOrders, flush_makespan
from pdcompile.plan import Plan
from pdcompile.planner.costmodel import ModelOptions, evaluate_timed
from tests.helpers.flush_pipelines import flush_pipelines
from tests.helpers.flush_walk_reference import reference_makespan


def _bits(seconds: float | None) -> str | None:
    """The exact bits of a price (-0.0 and 0.0 apart)."""
    return None if seconds is None else seconds.hex()


def _calls(pipeline: tuple[nx.DiGraph, Plan, Cluster, str, int],
           monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments the planner's price of the drawn plan gives the flush pass."""
    graph, plan, cluster, schedule, microbatches = pipeline
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def spy(*args: Any, **kwargs: Any) -> float | None:
        seen.append((args, {k: v for k, v in kwargs.items() if k != "orders"}))
        return flush_makespan(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline_time, "flush_makespan", spy)
        stages = [(list(s.nodes), tuple(s.ranks)) for s in plan.stages]
        evaluate_timed(graph, stages, cluster,
                       options=ModelOptions(schedule=schedule, microbatches=microbatches))
    return seen


def _variant(terms: list[Any], edges: dict[tuple[int, int], float],
             draw: st.DrawFn) -> tuple[list[Any], dict[tuple[int, int], float]]:
    """The same shape with one stage's seconds or one edge's bytes changed."""
    terms, edges = list(terms), dict(edges)
    if edges and draw(st.booleans()):
        edge = draw(st.sampled_from(sorted(edges)))
        edges[edge] = draw(st.sampled_from([0.0, edges[edge] * 3.0, edges[edge] / 7.0 + 1.0]))
        return terms, edges
    s = draw(st.integers(0, len(terms) - 1))
    t = terms[s]
    field = draw(st.sampled_from(["fwd", "bwd", "deferred", "wgrad", "paces", "step"]))
    if field == "paces":
        changed = replace(t, paces=tuple(draw(st.sampled_from([0.5, 1.0, 1.7]))
                                         for _ in range(t.replicas)))
    elif field in ("deferred", "wgrad"):
        changed = replace(t, **{field: getattr(t, "bwd") * draw(st.sampled_from([0.0, 0.3]))})
    else:
        changed = replace(t, **{field: getattr(t, field) * draw(st.floats(0.1, 10.0))})
    terms[s] = changed
    return terms, edges


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pipeline=flush_pipelines(), data=st.data())
def test_a_kept_walk_prices_plans_of_its_shape_as_the_pass_did(
        pipeline: tuple[nx.DiGraph, Plan, Cluster, str, int], data: st.DataObject,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(pipeline, monkeypatch)
    assert calls
    orders = FlushOrders()
    for args, kwargs in calls:
        terms, edges, stage_ranks, cluster = args
        old = _bits(reference_makespan(*args, **kwargs))
        assert _bits(flush_makespan(*args, **kwargs)) == old  # a fresh walk
        assert _bits(flush_makespan(*args, **kwargs, orders=orders)) == old  # made and kept
        assert _bits(flush_makespan(*args, **kwargs, orders=orders)) == old  # the kept one
        for _ in range(3):  # plans sharing the walk, one field apart
            other_terms, other_edges = _variant(terms, edges, data.draw)
            changed = (other_terms, other_edges, stage_ranks, cluster)
            assert _bits(flush_makespan(*changed, **kwargs, orders=orders)) == \
                _bits(reference_makespan(*changed, **kwargs))


def test_a_walk_is_made_once_per_shape_and_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    original = flush_path.FlushWalk

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(args[2])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(flush_path, "FlushWalk", Counted)
    terms = [pipeline_time.StageTerms(fwd=1e-3, bwd=2e-3, allreduce=0.0, step=1e-4, copy=0.0,
                                      cpu_copies=0.0, replicas=1, in_flight=2)
             for _ in range(3)]
    cluster = Cluster.parse("3@1e9~10us")
    orders = FlushOrders()
    line = {(0, 1): 1e6, (1, 2): 1e6}
    skip = {(0, 1): 1e6, (1, 2): 1e6, (0, 2): 5e8}
    prices = []
    for edges in (line, line, skip, {**line, (1, 2): 3e8}, skip):
        prices.append(flush_makespan(terms, edges, [(0,), (1,), (2,)], cluster,
                                     schedule="1f1b-flush", microbatches=4, orders=orders))
    assert made == [tuple(sorted(line)), tuple(sorted(skip))]
    assert prices[0] == prices[1] < prices[3]  # the kept walk, with its new bytes
    assert prices[2] == prices[4] > prices[0]
