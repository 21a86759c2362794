"""The DP's planning objective counts the copies of a tied parameter that later holders keep.

Per stage the DP knows which of a tie's readers it holds (`StateTables.tie_copies`): a stage
holding a reader but not the one the CostGraph counts the bytes at keeps a copy, whose weights,
gradients, optimizer state and versions its memory counts, and whose step and replicas'
all-reduce its time does, as `evaluate` and the simulator count them (cost/ties.py
`copied_bytes`). The brute force over every plan (tests/helpers/brute_force.py) with the same
objective finds the DP's optimum; on a GPT-2-like chain the DP moves a block off the head's
stage where the tie's copy would not fit beside it. (The tie's all-reduce is not in the
objective: docs/cost-model.md says why.)"""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.planner.costmodel import ModelOptions, evaluate, planning_objective
from pdcompile.planner.dp_search import planning_dp
from tests.helpers.brute_force import brute_force
from tests.helpers.graphs import TIE, tied_lm_chain
from tests.helpers.strategies import clusters, tied_dags

NATIVE = ModelOptions(cost_model="native")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=tied_dags(), cluster=clusters, straight=st.booleans(),
       schedule=st.sampled_from(["1f1b", "1f1b-flush"]),
       memory_fraction=st.sampled_from([None, 0.5, 2.0]))
def test_the_dp_finds_the_brute_force_optimum_of_tied_graphs(
        graph: nx.DiGraph, cluster: Cluster, straight: bool, schedule: str,
        memory_fraction: float | None) -> None:
    options = ModelOptions(cost_model="native", schedule=schedule,
                           microbatches=1 if schedule == "1f1b" else 4)
    memory = math.inf
    if memory_fraction is not None:
        total = sum(d["params"] * 4 + d["act"] * 4 for _, d in graph.nodes(data=True))
        memory = max(1.0, total * memory_fraction)
    expected = brute_force(graph, cluster, options=options, memory=memory, straight=straight)
    if expected is None:
        return
    objective, stages = planning_dp(graph, cluster, options=options,
                                    memory=min(memory, 1e30), straight=straight)
    assert objective == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
    assert planning_objective(graph, stages, cluster, options=options,
                              memory=min(memory, 1e30)) == pytest.approx(objective, rel=1e-9)


def test_the_dp_keeps_the_heads_stage_within_the_memory_with_its_copy_of_the_tie() -> None:
    """Two straight stages within 8.2 x TIE per worker (weights, gradients and Adam's moments
    are 4 x the parameters): the compute balances at emb, b0 | b1, b2, b3, head, whose second
    stage holds 3 blocks and the tie's copy, 10 x TIE; the DP that counts the copy moves a
    block to the first stage, and both stages fit."""
    cluster = Cluster.parse("2@1e10")
    options = ModelOptions(cost_model="native", schedule="1f1b-flush", microbatches=4)
    graph = tied_lm_chain()
    unlimited = planning_dp(graph, cluster, options=options, memory=1e30, straight=True)[1]
    assert [nodes for nodes, _ in unlimited] == [["emb", "b0"], ["b1", "b2", "b3", "head"]]
    assert evaluate(graph, unlimited, cluster, options=options)[0][1].memory \
        == pytest.approx(10 * TIE, rel=0.01)
    limit = 8.2 * TIE
    _, stages = planning_dp(graph, cluster, options=options, memory=limit, straight=True)
    assert [nodes for nodes, _ in stages] == [["emb", "b0", "b1"], ["b2", "b3", "head"]]
    assert all(s.memory <= limit for s in evaluate(graph, stages, cluster, options=options)[0])
