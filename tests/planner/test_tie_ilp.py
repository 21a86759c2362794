"""CP-SAT's model counts the copies of a tied parameter that later holders keep.

A stage holding a reader of a tie but not the reader whose `params` count it keeps a copy
(cost/ties.py `copied_bytes`): the model's `held` variables put its bytes in the stage's
parameters, memory included, as the DP's tables do. Blind to it, CP-SAT returned plans whose
head stage was over the memory limit (dropped later by the planner's pricing, after the search
was spent on them)."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.ties import copied_bytes, shared_weights, updates_apart
from pdcompile.planner.costmodel import ModelOptions, evaluate
from pdcompile.planner.ilp import MEMORY_UNITS, ilp_objective, solve
from tests.helpers.brute_force import brute_force
from tests.helpers.graphs import TIE, tied_lm_chain
from tests.helpers.strategies import clusters, tied_dags

FLUSH = ModelOptions(cost_model="native", schedule="1f1b-flush", microbatches=4)


def test_cp_sat_keeps_the_heads_stage_within_the_memory_with_its_copy_of_the_tie() -> None:
    """Two workers within 8.2 x TIE each: blind to the head's copy, CP-SAT cut
    emb, b0 | b1, b2, b3, head, whose second stage needs 10 x TIE; counting it, the model cuts
    a block earlier and both stages fit (the DP's plan, tests/planner/test_tie_objective.py)."""
    cluster, limit = Cluster.parse("2@1e10"), 8.2 * TIE
    graph = tied_lm_chain()
    solution = solve(graph, cluster, options=FLUSH, memory=limit, time_limit=20)
    assert solution["status"] == "OPTIMAL"
    assert [nodes for nodes, _ in solution["stages"]] == [["emb", "b0", "b1"],
                                                         ["b2", "b3", "head"]]
    priced = evaluate(graph, solution["stages"], cluster, options=FLUSH)[0]
    assert all(s.memory <= limit for s in priced)
    # without a limit the model still pays for the copy: its objective is the exact one's
    free = solve(graph, cluster, options=FLUSH, memory=None, time_limit=20)
    found = ilp_objective(graph, free["stages"], cluster, options=FLUSH, memory=None)
    assert copied_bytes(graph, {v: i for i, (nodes, _) in enumerate(free["stages"])
                                for v in nodes}, 2)[1] == TIE
    assert free["bound"] <= found * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=tied_dags(), cluster=clusters, memory_fraction=st.sampled_from([None, 0.5, 1.0]))
def test_cp_sat_finds_the_brute_force_optimum_of_tied_graphs(
        graph: nx.DiGraph, cluster: Cluster, memory_fraction: float | None) -> None:
    """The brute force over every plan with the model's objective (copies counted by
    `copied_bytes`, independently of the model's variables) agrees with CP-SAT, and every stage
    of CP-SAT's plan holds its copies within the memory."""
    memory = 1e30
    if memory_fraction is not None:
        total = sum(d["params"] * 4 + d["act"] * 4 for _, d in graph.nodes(data=True))
        memory = max(1.0, total * memory_fraction)
    expected = brute_force(graph, cluster, options=FLUSH, memory=memory,
                           objective=ilp_objective)
    solution = solve(graph, cluster, options=FLUSH, memory=memory, time_limit=20)
    if expected is None:
        assert solution["stages"] is None
        return
    # the model counts memory in millionths of the limit, each term rounded up: a stage within
    # a millionth per node and tie of the limit may be refused (ilp.MEMORY_UNITS), so the
    # optimum lies between the brute force's at the limit and at the limit less that margin
    # (a drawn limit of exactly the whole graph's need on one worker was refused)
    margin = (graph.number_of_nodes() + len(graph.graph.get("ties", ()))) / MEMORY_UNITS
    within = brute_force(graph, cluster, options=FLUSH, memory=memory * (1 - margin),
                         objective=ilp_objective)
    if within is None:
        assert solution["status"] in ("OPTIMAL", "INFEASIBLE")
        if solution["stages"] is None:
            return
    else:
        assert solution["status"] == "OPTIMAL"
    found = ilp_objective(graph, solution["stages"], cluster, options=FLUSH, memory=memory)
    assert math.isfinite(found)
    best = expected[0] if within is None else within[0]
    assert expected[0] * (1 - 1e-6) - 2 * solution["slack"] <= found \
        <= best * (1 + 1e-6) + 2 * solution["slack"]
    assert solution["bound"] <= found * (1 + 1e-9) + 1e-15
    priced = evaluate(graph, solution["stages"], cluster, options=FLUSH)[0]
    assert all(s.memory <= memory * (1 + 1e-6) for s in priced)


STREAM = ModelOptions(cost_model="native", schedule="1f1b")


def _updates_apart(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]]) -> bool:
    stage_of = {n: i for i, (nodes, _) in enumerate(stages) for n in nodes}
    return updates_apart(shared_weights(graph, stage_of), [len(r) for _, r in stages],
                         False) is not None


def _runnable_objective(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
                        cluster: Cluster, *, options: ModelOptions, memory: float) -> float:
    """The model's objective of the plans '1f1b' can run: its stages sharing a tie on equal
    replica counts (cost/ties.py `updates_apart`)."""
    if _updates_apart(graph, stages):
        return math.inf
    return ilp_objective(graph, stages, cluster, options=options, memory=memory)


@pytest.mark.parametrize("workers", [5, 6])
def test_under_1f1b_cp_sat_keeps_a_gpt2_like_chains_tied_stages_on_equal_replicas(
        workers: int) -> None:
    """Blind to the rule, CP-SAT put the embedding on more replicas than the head (on 5
    workers 2-1-1-1, on 6 3-1-1-1), which '1f1b' cannot run; now the brute force's optimum
    among the plans that keep them equal."""
    graph, cluster = tied_lm_chain(), Cluster.parse(f"{workers}@1e10")
    expected = brute_force(graph, cluster, options=STREAM, memory=1e30,
                           objective=_runnable_objective)
    solution = solve(graph, cluster, options=STREAM, memory=None, time_limit=20)
    assert solution["status"] == "OPTIMAL" and expected is not None
    assert not _updates_apart(graph, solution["stages"])
    found = ilp_objective(graph, solution["stages"], cluster, options=STREAM, memory=None)
    assert found == pytest.approx(expected[0], rel=1e-6, abs=2 * solution["slack"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=tied_dags(), workers=st.integers(3, 5))
def test_cp_sat_finds_the_runnable_brute_force_optimum_under_1f1b(
        graph: nx.DiGraph, workers: int) -> None:
    cluster = Cluster.parse(f"{workers}@1e10")
    expected = brute_force(graph, cluster, options=STREAM, memory=1e30,
                           objective=_runnable_objective)
    solution = solve(graph, cluster, options=STREAM, memory=None, time_limit=20)
    if expected is None:
        assert solution["stages"] is None
        return
    assert solution["status"] == "OPTIMAL"
    assert not _updates_apart(graph, solution["stages"])
    found = ilp_objective(graph, solution["stages"], cluster, options=STREAM, memory=None)
    assert found == pytest.approx(expected[0], rel=1e-6, abs=2 * solution["slack"])
