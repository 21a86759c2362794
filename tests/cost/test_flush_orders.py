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

import pdcompile.cost.flush_path as flush_path
from pdcompile import Cluster
from pdcompile.cost.flush_path import FlushOrders
from pdcompile.plan import Plan
from pdcompile.planner.costmodel import ModelOptions, evaluate_timed
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
