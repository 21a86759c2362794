"""pdcompile.plan: the Plan it returns, JSON round trip, coarsening, and its error messages."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

import pdcompile
from pdcompile import Cluster, Plan
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import ClusterError, CostGraphError, PlanError
from pdcompile.planner.simulation import simulate_plan
from pdcompile.profiles import load_pipedream


def _chain(n: int = 6, params: float = 1e6, act: float = 1e6) -> nx.DiGraph:
    graph = new_cost_graph("chain")
    add_block(graph, "input", fwd=0.0, bwd=0.0, act=act, params=0.0)
    previous = "input"
    for i in range(n):
        add_block(graph, f"l{i}", fwd=1e-3 * (1 + i % 3), bwd=2e-3, act=act, params=params)
        graph.add_edge(previous, f"l{i}")
        previous = f"l{i}"
    return graph


def test_plan_fields_and_contiguous_ranks() -> None:
    graph = _chain()
    result = pdcompile.plan(graph, "4@1e9", planner="dp")
    assert isinstance(result, Plan)
    ranks = [r for s in result.stages for r in s.ranks]
    assert ranks == list(range(4))  # contiguous, stage 0 first
    assert "input" in result.stages[0].nodes  # inputs live on the first stage
    assert result.cluster == Cluster.parse("4@1e9").to_dict()
    assert result.planner == "dp" and result.status == "OPTIMAL" and result.cost_model == "native"
    # the prediction is the simulator's steady state of the plan (cheap here), the closed form's
    # slowest stage a lower bound of it
    _, simulated = simulate_plan(graph, result, Cluster.parse("4@1e9"), timeline=False)
    assert result.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)
    assert result.extra["closed_form_time_per_minibatch"] >= max(s.time for s in result.stages)
    assert result.dp_time > 0 and result.speedup_over_dp >= 1.0 - 1e-12
    assert result.solve_seconds > 0
    for stage in result.stages:  # nodes in topological order
        order = [n for n in nx.topological_sort(graph) if n in stage.nodes]
        assert list(stage.nodes) == order


def test_json_round_trip_keeps_the_plan() -> None:
    result = pdcompile.plan(_chain(), "2x2@1e10,1e9", planner="ilp", time_limit=5)
    again = Plan.from_json(result.to_json())
    assert again == result
    assert again.config == result.config and again.gap == result.gap


def test_memory_accepts_strings_and_is_respected() -> None:
    graph = _chain(params=3e8, act=1e6)
    loose = pdcompile.plan(graph, "4@1e10", planner="dp", memory="64GiB")
    peak = max(s.memory for s in loose.stages)
    limit = 0.9 * peak
    tight = pdcompile.plan(graph, "4@1e10", planner="dp", memory=f"{limit / 2**30}GiB")
    assert tight.extra["memory_limit"] == pytest.approx(limit)
    assert all(s.memory <= limit * (1 + 1e-9) for s in tight.stages)
    assert tight.time_per_minibatch >= loose.time_per_minibatch


def test_model_that_cannot_fit_names_memory_and_workers() -> None:
    graph = _chain(n=4, params=2e9)  # 8 GB of weights in 4 layers, 32 GB with Adam's state
    with pytest.raises(PlanError) as err:
        pdcompile.plan(graph, "2@1e9", planner="dp", memory="8GiB")
    text = str(err.value)
    assert "does not fit 8.0 GiB per worker on 2 workers" in text
    assert "per worker on this cluster" in text and "workers with 8.0 GiB each" in text
    # the memory it names is enough
    needed = float(text.split("it needs ")[1].split(" GiB")[0]) * 2**30
    pdcompile.plan(graph, "2@1e9", planner="dp", memory=needed * 1.001)
    # and so is the worker count it names
    workers = int(text.split("at least ")[1].split(" workers")[0])
    pdcompile.plan(graph, f"{workers}@1e9", planner="dp", memory="8GiB")


@pytest.mark.parametrize("kind", ["empty", "cyclic", "negative", "edge"])
def test_bad_graphs_get_clear_errors(kind: str) -> None:
    graph = new_cost_graph("bad")
    if kind != "empty":
        add_block(graph, "a", fwd=1.0, bwd=1.0, act=1.0, params=1.0)
        add_block(graph, "b", fwd=1.0, bwd=1.0, act=1.0, params=1.0)
        graph.add_edge("a", "b")
    if kind == "cyclic":
        graph.add_edge("b", "a")
    if kind == "negative":
        graph.nodes["b"]["fwd"] = -1.0
    if kind == "edge":
        graph.edges["a", "b"]["bytes"] = -5.0
    expected = {"empty": "empty", "cyclic": "cycle", "negative": "negative",
                "edge": "edge 'a' -> 'b'"}[kind]
    with pytest.raises(CostGraphError, match=expected):
        pdcompile.plan(graph, "2")


def test_bad_options_get_clear_errors() -> None:
    graph = _chain()
    with pytest.raises(ClusterError, match="positive worker count"):
        pdcompile.plan(graph, "0")
    with pytest.raises(PlanError, match="planner"):
        pdcompile.plan(graph, "2", planner="magic")
    with pytest.raises(PlanError, match="memory"):
        pdcompile.plan(graph, "2", memory="lots")
    with pytest.raises(PlanError, match="memory"):
        pdcompile.plan(graph, "2", memory=-5)
    with pytest.raises(PlanError, match="time_limit"):
        pdcompile.plan(graph, "2", time_limit=0)


def test_big_branched_graph_is_coarsened_and_expanded(profiles_dir: Path) -> None:
    graph = load_pipedream(profiles_dir / "nasnetamobile" / "graph.txt")
    result = pdcompile.plan(graph, "8@1e9", planner="dp")
    assert "coarse" in result.extra["states"]
    assert sorted(n for s in result.stages for n in s.nodes) == sorted(graph.nodes)
    stage_of = result.stage_of()
    assert all(stage_of[u] <= stage_of[v] for u, v in graph.edges)
    assert result.time_per_minibatch <= result.dp_time * (1 + 1e-12)


def test_auto_runs_cp_sat_on_small_graphs_only(profiles_dir: Path) -> None:
    small = pdcompile.plan(_chain(), "3@1e9", time_limit=5)
    assert small.planner == "ilp"
    # resnet50's chains fuse down to 60 blocks: CP-SAT runs on the coarse graph
    coarse = pdcompile.plan(load_pipedream(profiles_dir / "resnet50" / "graph.txt"), "2@1e9",
                            time_limit=3)
    assert coarse.planner == "ilp"
    big = pdcompile.plan(load_pipedream(profiles_dir / "nasnetamobile" / "graph.txt"), "2@1e9")
    assert big.planner == "dp"


def test_straight_pipelines_use_one_worker_per_stage() -> None:
    result = pdcompile.plan(_chain(), "3@1e9", planner="dp", straight=True)
    assert result.config == "straight" and len(result.stages) == 3


def test_flush_schedule_is_priced_with_its_bubble() -> None:
    graph = _chain()
    cluster = Cluster.parse("3@1e9")
    asynchronous = pdcompile.plan(graph, cluster, planner="dp")
    flush = pdcompile.plan(graph, cluster, planner="dp", schedule="1f1b-flush", microbatches=4)
    assert flush.schedule == "1f1b-flush" and flush.microbatches == 4
    _, simulated = simulate_plan(graph, flush, cluster, timeline=False)
    assert flush.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)
    # the closed form (fill, steady part, drain) is within 10% of the simulator
    assert flush.extra["closed_form_time_per_minibatch"] == pytest.approx(
        simulated.time_per_minibatch, rel=0.1)
    # one minibatch of 4 microbatches fills and drains the pipeline: slower than streaming
    assert flush.time_per_minibatch >= asynchronous.time_per_minibatch


def test_summary_says_when_data_parallelism_would_not_fit(profiles_dir: Path) -> None:
    # resnet50's profile at its batch size: the activations it keeps (10.8 GiB once in-place
    # layers share their input's storage) and Adam's state exceed 8 GiB on one worker
    graph = load_pipedream(profiles_dir / "resnet50" / "graph.txt")
    tight = pdcompile.plan(graph, "4@1e9", planner="dp", memory="8GiB")
    assert tight.extra["dp_fits"] is False
    assert "data parallelism does not fit" in tight.summary()
    roomy = pdcompile.plan(graph, "4@1e9", planner="dp", cost_model="pipedream")
    assert "does not fit" not in roomy.summary()
