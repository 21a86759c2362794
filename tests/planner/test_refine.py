"""Plan refinement by simulation: never slower than its input, valid plans, memory respected."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

import pdcompile
from pdcompile import Cluster
from pdcompile.errors import PlanError
from pdcompile.planner.simulation import data_parallel_plan, simulate_plan
from pdcompile.profiles import load_pipedream


def _check_valid(plan: pdcompile.Plan, graph: nx.DiGraph, cluster: Cluster) -> None:
    stage_of = plan.stage_of()
    assert set(stage_of) == set(graph.nodes)
    assert all(stage_of[u] <= stage_of[v] for u, v in graph.edges)  # convex stages
    ranks = [r for s in plan.stages for r in s.ranks]
    assert ranks == list(range(cluster.workers))
    assert all(len(s.ranks) == s.replicas for s in plan.stages)


@pytest.mark.slow
def test_refine_improves_data_parallelism_of_alexnet_on_cluster_a(profiles_dir: Path) -> None:
    graph = load_pipedream(profiles_dir / "alexnet" / "graph.txt")
    cluster = Cluster.preset("A")
    start = data_parallel_plan(graph, cluster)
    refined = pdcompile.refine_plan(start, graph, cluster, max_evaluations=200)
    _check_valid(refined.plan, graph, cluster)
    assert refined.evaluations <= 200
    _, before = simulate_plan(graph, start, cluster, minibatches=64, timeline=False)
    _, after = simulate_plan(graph, refined.plan, cluster, minibatches=64, timeline=False)
    assert refined.start == pytest.approx(before.time_per_minibatch)
    assert refined.simulated == pytest.approx(after.time_per_minibatch)
    # AlexNet's fully connected layers make data parallelism all-reduce 240 MB over 10 Gbps;
    # the search finds a pipeline that the simulator runs at least 1.5x faster
    assert refined.gain > 1.5 and refined.moves
    assert after.peak_memory <= cluster.device.memory
    assert refined.plan.planner.endswith("+simulation")
    assert refined.plan.extra["simulated_time_per_minibatch"] == refined.simulated


def test_refine_never_returns_a_slower_plan(profiles_dir: Path) -> None:
    graph = load_pipedream(profiles_dir / "vgg16" / "graph.txt")
    cluster = Cluster.preset("B")
    start = pdcompile.plan(graph, cluster, planner="dp")
    refined = pdcompile.refine_plan(start, graph, cluster, max_evaluations=40)
    assert refined.simulated <= refined.start
    _check_valid(refined.plan, graph, cluster)
    # data parallelism is a seed: whatever the start, the result is never slower than it
    _, data_parallel = simulate_plan(graph, data_parallel_plan(graph, cluster), cluster,
                                     minibatches=64, timeline=False)
    assert refined.simulated <= data_parallel.time_per_minibatch * (1 + 1e-9)
    one = pdcompile.refine_plan(start, graph, cluster, max_evaluations=1)  # the input alone
    assert one.evaluations == 1 and one.simulated == one.start and len(one.moves) == 1


def test_refine_rejects_bad_input(profiles_dir: Path) -> None:
    graph = load_pipedream(profiles_dir / "alexnet" / "graph.txt")
    start = pdcompile.plan(graph, "4@1e9", planner="dp")
    with pytest.raises(PlanError, match="plan for this cluster"):
        pdcompile.refine_plan(start, graph, Cluster.preset("A"))
    with pytest.raises(PlanError, match="max_evaluations"):
        pdcompile.refine_plan(start, graph, Cluster.parse("4@1e9"), max_evaluations=0)
