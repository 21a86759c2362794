"""The cost model: the `pipedream` mode reproduces the original optimizer's figures; the native
mode's terms (ring all-reduce, overlapped sends, skip connections, levels, memory) by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.planner import plan
from pdcompile.planner.costmodel import ModelOptions, data_parallel_time, evaluate
from pdcompile.planner.simulation import simulate_plan
from pdcompile.profiles import load_pipedream

# (profile, cluster, straight, config or stage count, time per minibatch, speed-up over DP),
# from pdcompile/data/pipedream/README.md
ORIGINAL = [
    ("vgg16", "4", False, "3-1", 0.2055, 2.84),
    ("vgg16", "16", False, "13-2-1", 0.0565, 3.04),
    ("alexnet", "4", False, "3-1", 0.0342, 5.98),
    ("resnet50", "4", False, 2, 0.1629, 1.15),
    ("resnet50", "16", False, "7-6-3", 0.0478, 1.08),
    ("densenet121", "8", False, "5-2-1", 0.0471, 1.16),
    ("gnmt", "4", True, "straight", 0.0259, 23.3),
    ("gnmt_large", "4", True, "straight", 0.1371, 7.02),
    ("vgg16", "4x4@1e10,1.25e9", False, None, 0.0671, 2.02),
    ("resnet101", "8x2@1e10,1.25e9", False, 7, 0.0439, 1.08),
]


@pytest.mark.parametrize(("model", "cluster", "straight", "config", "seconds", "speedup"),
                         ORIGINAL, ids=[f"{m}-{c}" for m, c, *_ in ORIGINAL])
def test_pipedream_mode_reproduces_the_original(profiles_dir: Path, model: str, cluster: str,
                                                straight: bool, config: str | int | None,
                                                seconds: float, speedup: float) -> None:
    graph = load_pipedream(profiles_dir / model / "graph.txt")
    result = plan(graph, cluster, planner="dp", cost_model="pipedream", straight=straight)
    assert result.time_per_minibatch == pytest.approx(seconds, abs=5e-5)
    assert result.speedup_over_dp == pytest.approx(speedup, abs=0.006 if speedup < 10 else 0.06)
    if isinstance(config, str):
        assert result.config == config
    elif isinstance(config, int):
        assert len(result.stages) == config
    if straight:
        assert len(result.stages) == 4
    assert sorted(r for s in result.stages for r in s.ranks) == list(range(result.workers))
    # every node of the profile is in a stage, Input nodes in the first one
    assert sum(len(s.nodes) for s in result.stages) == graph.number_of_nodes()
    inputs = [n for n, d in graph.nodes(data=True) if d["label"].startswith("Input")]
    assert set(inputs) <= set(result.stages[0].nodes)


def test_pipedream_flat_plan_priced_by_evaluate_matches_the_dp(profiles_dir: Path) -> None:
    graph = load_pipedream(profiles_dir / "vgg16" / "graph.txt")
    result = plan(graph, "16", planner="dp", cost_model="pipedream")
    options = ModelOptions(cost_model="pipedream")
    stages, seconds = evaluate(graph, [(s.nodes, s.ranks) for s in result.stages],
                               Cluster.parse("16"), options=options)
    assert seconds == pytest.approx(result.time_per_minibatch, rel=1e-12)
    assert [s.time for s in stages] == [s.time for s in result.stages]


def _two_stage_graph() -> object:
    graph = new_cost_graph("toy")
    add_block(graph, "a", fwd=0.010, bwd=0.020, act=1e8, params=2e8)
    add_block(graph, "b", fwd=0.005, bwd=0.010, act=1e6, params=1e8)
    add_block(graph, "c", fwd=0.001, bwd=0.002, act=1e3, params=0.0)
    graph.add_edge("a", "b")
    graph.add_edge("b", "c")
    graph.add_edge("a", "c", bytes=5e7)  # a skip connection
    return graph


def test_native_terms_by_hand() -> None:
    graph = _two_stage_graph()
    cluster = Cluster.parse("3@1e9~1e-5")
    options = ModelOptions(cost_model="native")
    stages, seconds = evaluate(graph, [(["a"], (0, 1)), (["b", "c"], (2,))], cluster,
                               options=options)
    s0, s1 = stages
    mem_bw = cluster.device.mem_bandwidth
    assert s0.compute == pytest.approx(0.030 / 2)
    ring = 2 * (2 - 1) / 2 * 2e8 / 1e9 + 2 * (2 - 1) * 1e-5
    assert s0.sync == pytest.approx(ring / 2)  # one all-reduce per round of 2 minibatches
    # a's output goes to b and, over the skip connection, to c: both in stage 1, so it crosses
    # once (the larger of the two edges), one message
    sent = 1e8 / 1e9 + 1e-5
    assert s0.comm == pytest.approx(sent / 2)
    assert s1.comm == pytest.approx(sent)
    # a replica's work per round: compute, all-reduce, optimizer step (3 P at memory
    # bandwidth) and, with 2 minibatches in flight (NOAM ceil(3 / 2)), a weight-version copy
    assert s0.in_flight == 2 and s1.in_flight == 1
    own0 = 0.030 + ring + 3 * 2e8 / mem_bw + 2 * 2e8 / mem_bw
    assert s0.time == pytest.approx(own0 / 2)
    assert s1.time == pytest.approx(0.018 + 3 * 1e8 / mem_bw)  # the last stage copies nothing
    assert seconds >= max(s0.time, s1.time)
    # memory: weights, gradients, Adam's two moments, one stashed version, 2 activations
    assert s0.memory == pytest.approx(2e8 + 2e8 + 2 * 2e8 + 2e8 + 2 * 1e8)
    assert s1.memory == pytest.approx(1e8 + 1e8 + 2 * 1e8 + 1 * (1e6 + 1e3))


def test_native_uses_the_slow_level_between_servers() -> None:
    graph = _two_stage_graph()
    options = ModelOptions(cost_model="native")
    nodes = [(["a"], (0,)), (["b", "c"], (1,))]
    inside = evaluate(graph, nodes, Cluster.parse("2x2@1e10,1e8"), options=options)[0]
    across = evaluate(graph, [(["a"], (0,)), (["b", "c"], (2,))],
                      Cluster.parse("2x2@1e10,1e8"), options=options)[0]
    assert inside[0].comm == pytest.approx(1e8 / 1e10)
    assert across[0].comm == pytest.approx(1e8 / 1e8)


def test_flush_schedules_pay_the_bubble_and_keep_one_weight_version() -> None:
    graph = _two_stage_graph()
    cluster = Cluster.parse("2@1e9")
    nodes = [(["a"], (0,)), (["b", "c"], (1,))]
    async_stages, async_time = evaluate(graph, nodes, cluster, options=ModelOptions())
    flush_stages, flush_time = evaluate(graph, nodes, cluster,
                                        options=ModelOptions(schedule="1f1b-flush", microbatches=4))
    # one minibatch as the simulator runs it (the longest path through its actions): each
    # transfer holds its link 25 ms (1e8 / 4 bytes at 1e9 B/s) and stage 0 keeps 2 microbatches
    # in flight, running F0 F1 B0 F2 B1 F3 B2 B3 (forward 2.5 ms, backward 5 ms). F1 reaches
    # stage 1 behind F0 on the link (27.5 -> 52.5 ms); stage 1's forward and the input-gradient
    # half of its backward (1.5 + 1.5 ms: it sends before its weight gradients) send B1 back at
    # 55.5 ms, there at 80.5; B1 and F3 take stage 0 to 88 ms, F3 is there at 113, its
    # gradients back at 116 + 25 = 141 ms; B3 ends at 146 ms, then stage 0's step (the last)
    mem_bw = cluster.device.mem_bandwidth
    expected = 0.146 + 3 * 2e8 / mem_bw
    assert flush_time == pytest.approx(expected)
    plan_ = Plan(stages=(Stage(("a",), 1, (0,)), Stage(("b", "c"), 1, (1,))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=2, schedule="1f1b-flush",
                 microbatches=4)
    _, simulated = simulate_plan(graph, plan_, cluster, timeline=False)
    assert flush_time == pytest.approx(simulated.time_per_minibatch, rel=1e-9)
    assert flush_time > async_time
    assert flush_stages[0].memory < async_stages[0].memory


def test_data_parallel_time_pipedream_formula() -> None:
    graph = _two_stage_graph()
    options = ModelOptions(cost_model="pipedream")
    flat = data_parallel_time(graph, Cluster.parse("4@1e9"), options=options)
    assert flat == pytest.approx((0.048 + 4 * 3 * 3e8 / (1e9 * 4)) / 4)
    two = data_parallel_time(graph, Cluster.parse("2x2@1e10,1e9"), options=options)
    inner = (0.048 + 4 * 1 * 3e8 / (1e10 * 2)) / 2
    assert two == pytest.approx((inner + 4 * 1 * 3e8 / (1e9 * 2) / 2) / 2)


def test_evaluate_rejects_non_convex_plans() -> None:
    graph = _two_stage_graph()
    with pytest.raises(PlanError, match="back to stage"):
        evaluate(graph, [(["b"], (0,)), (["a", "c"], (1,))], Cluster.parse("2"),
                 options=ModelOptions())
    with pytest.raises(PlanError, match="unassigned"):
        evaluate(graph, [(["a"], (0,))], Cluster.parse("1"), options=ModelOptions())
    with pytest.raises(PlanError, match="cost model"):
        ModelOptions(cost_model="magic")
