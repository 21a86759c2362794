"""Flush orders kept for a search (cost/flush_path.py `FlushOrders`).

A planner's walk prices thousands of cuts that differ in the nodes a stage holds, not in the
order its ranks run (ranks, microbatches, warm-up depths, shares): densenet121 on cluster A
generated 6,675 orders, 136 of them different, a sixth of its planning. An order taken from
those kept must price every plan as a fresh one does, to the bit, and the kept ones stay few.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile.cost.flush_path as flush_path
from pdcompile import Cluster
from pdcompile.cost.flush_path import FlushOrders
from pdcompile.errors import PlanError
from pdcompile.plan import Plan
from pdcompile.planner.costmodel import ModelOptions, evaluate_timed
from pdcompile.schedule.kinds import kind
from tests.helpers.flush_pipelines import flush_pipelines


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=flush_pipelines())
def test_a_kept_order_prices_a_plan_as_a_fresh_one(
        pipeline: tuple[nx.DiGraph, Plan, Cluster, str, int]) -> None:
    graph, plan, cluster, schedule, microbatches = pipeline
    stages = [(list(s.nodes), tuple(s.ranks)) for s in plan.stages]
    options = ModelOptions(schedule=schedule, microbatches=microbatches)
    orders = FlushOrders()
    fresh = evaluate_timed(graph, stages, cluster, options=options)
    first = evaluate_timed(graph, stages, cluster, options=options, orders=orders)
    kept = evaluate_timed(graph, stages, cluster, options=options, orders=orders)
    assert fresh[1] == first[1] == kept[1]
    assert fresh[2] == first[2] == kept[2]
    assert fresh[0] == kept[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=flush_pipelines(), data=st.data())
def test_plans_differing_only_in_their_order_share_no_kept_order(
        pipeline: tuple[nx.DiGraph, Plan, Cluster, str, int], data: st.DataObject) -> None:
    """The same cut under other warm-up depths, and under fewer microbatches, through the
    orders the first pricing kept: each priced as a fresh pricing does (a shape that left out
    a field would hand the first plan's order to the second)."""
    graph, plan, cluster, schedule, microbatches = pipeline
    stages = [(list(s.nodes), tuple(s.ranks)) for s in plan.stages]
    options = ModelOptions(schedule=schedule, microbatches=microbatches)
    orders = FlushOrders()
    evaluate_timed(graph, stages, cluster, options=options, orders=orders)
    variants: list[tuple[ModelOptions, list[int] | None]] = []
    if kind(schedule).chosen_warmup:
        depths = data.draw(st.lists(st.integers(1, microbatches), min_size=len(stages),
                                    max_size=len(stages)))
        variants.append((options, depths))
    fewer = data.draw(st.integers(1, microbatches))
    variants.append((ModelOptions(schedule=schedule, microbatches=fewer), None))
    for other, in_flight in variants:
        try:
            fresh = evaluate_timed(graph, stages, cluster, options=other, in_flight=in_flight)
        except PlanError:
            with pytest.raises(PlanError):
                evaluate_timed(graph, stages, cluster, options=other, in_flight=in_flight,
                               orders=orders)
            continue
        kept = evaluate_timed(graph, stages, cluster, options=other, in_flight=in_flight,
                              orders=orders)
        assert (fresh[0], fresh[1], fresh[2]) == (kept[0], kept[1], kept[2])


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A list of the shapes the generator is asked for."""
    asked: list[Any] = []
    original = flush_path.generate

    def counted(name: str, stage_ranks: Any, microbatches: int, **kwargs: Any) -> Any:
        asked.append((name, stage_ranks, microbatches))
        return original(name, stage_ranks, microbatches, **kwargs)

    monkeypatch.setattr(flush_path, "generate", counted)
    return asked


def _shape(replicas: int, microbatches: int) -> Any:
    ranks = ((0,), tuple(range(1, 1 + replicas)))
    return ("1f1b-flush", ranks, microbatches, (1, 0), None)


def test_each_shape_is_generated_once_while_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _counted(monkeypatch)
    orders = FlushOrders(keep=2)
    one, two, three = _shape(1, 4), _shape(2, 4), _shape(1, 8)
    made = orders.order(one)
    assert made is not None and str(made) == str(flush_path._generated(one))
    assert orders.order(one) is made and len(asked) == 2  # (the check above made one too)
    orders.order(two)
    orders.order(one)  # used last: `two` is now the least recent
    orders.order(three)  # over `keep`: `two` goes
    assert len(asked) == 4
    assert orders.order(one) is made and len(asked) == 4
    orders.order(two)
    assert len(asked) == 5


def test_a_shape_the_generator_refuses_is_kept_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _counted(monkeypatch)
    orders = FlushOrders()
    refused = ("interleaved-1f1b", ((0,), (1,)), 2, None, None)  # one chunk per rank
    assert orders.order(refused) is None
    assert orders.order(refused) is None
    assert len(asked) == 1
