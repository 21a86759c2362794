"""One rule for which stage counts a tie whose first reader is not in the graph.

The CostGraph counts a tied parameter once, at its first reader; the other holders keep a copy
(cost/ties.py `copied_bytes`). Where that reader is absent (a graph cut from a larger one),
the rule was written three times and twice differently: `copied_bytes` counted the tie at the
lowest stage holding a reader, `tie_readers` (CP-SAT's and the mixed planner's) and the DP's
tables at the reader first in topological order, wherever its stage. On a fork whose branch b
runs on the first stage and branch a (first in topological order) on the second, the
closed form charged the copy to the second stage and the DP to the first, so the DP's objective
of a plan differed from the closed form's. Now `tie_owners` is the one rule.
"""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.ties import copied_bytes, tie_owners, tie_readers
from pdcompile.planner.costmodel import ModelOptions, planning_objective
from pdcompile.planner.dp_search import planning_dp
from tests.helpers.brute_force import brute_force
from tests.helpers.strategies import tied_dags

TIE = 1e8


def _fork() -> nx.DiGraph:
    """src -> a, src -> b, both -> c; a tie read by a and b whose first reader is absent."""
    graph = new_cost_graph("fork", 8)
    for name in ("src", "a", "b", "c"):
        add_block(graph, name, fwd=1e-3, bwd=2e-3, act=1e6, params=TIE if name == "a" else 1e5)
    graph.add_edges_from([("src", "a"), ("src", "b"), ("a", "c"), ("b", "c")])
    graph.graph["ties"] = [{"bytes": TIE, "nodes": ["absent", "b", "a"]}]
    return graph


def test_a_tie_without_its_first_reader_is_counted_at_its_first_reader_in_topological_order(
        ) -> None:
    graph = _fork()
    assert tie_owners(graph) == ["a"]
    assert [(t.owner, t.others) for t in tie_readers(graph)] == [("a", ("b",))]
    # b on the first stage, a (the owner) on the second: the first keeps the copy
    assert copied_bytes(graph, {"src": 0, "b": 0, "a": 1, "c": 1}, 2) == [TIE, 0.0]


@pytest.mark.parametrize("schedule", ["1f1b-flush", "1f1b"])
def test_the_dp_prices_the_copy_where_the_closed_form_does(schedule: str) -> None:
    """b heavier than a on 3 workers: the optimum runs src | b | a, c, whose second stage
    holds b but not the owner a, so it keeps the copy in both models."""
    graph = _fork()
    graph.nodes["b"]["fwd"] = 5e-3
    cluster = Cluster.parse("3@1e9")
    options = ModelOptions(cost_model="native", schedule=schedule,
                           microbatches=1 if schedule == "1f1b" else 4)
    objective, stages = planning_dp(graph, cluster, options=options, memory=1e30,
                                    straight=True)
    assert [nodes for nodes, _ in stages] == [["src"], ["b"], ["a", "c"]]
    assert planning_objective(graph, stages, cluster, options=options, memory=1e30) \
        == pytest.approx(objective, rel=1e-12)
    expected = brute_force(graph, cluster, options=options, memory=math.inf, straight=True)
    assert expected is not None and objective == pytest.approx(expected[0], rel=1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=tied_dags(), workers=st.integers(1, 4),
       schedule=st.sampled_from(["1f1b", "1f1b-flush"]))
def test_the_dp_and_the_closed_form_agree_on_ties_whose_first_reader_is_absent(
        graph: nx.DiGraph, workers: int, schedule: str) -> None:
    for tie in graph.graph.get("ties", ()):
        tie["nodes"] = ["absent", *reversed(tie["nodes"])]
    cluster = Cluster.parse(f"{workers}@1e10")
    options = ModelOptions(cost_model="native", schedule=schedule,
                           microbatches=1 if schedule == "1f1b" else 4)
    expected = brute_force(graph, cluster, options=options, memory=math.inf)
    if expected is None:
        return
    objective, stages = planning_dp(graph, cluster, options=options, memory=1e30)
    assert planning_objective(graph, stages, cluster, options=options, memory=1e30) \
        == pytest.approx(objective, rel=1e-9)
    if schedule == "1f1b-flush":  # no rule on the tied stages' replicas: the same optimum
        assert objective == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
