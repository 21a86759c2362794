"""What the planner chooses besides stages and replicas: the schedule and its microbatches, the
warm-up depths, recomputation, interleaving, K balanced stages, and how given plans are priced."""

from __future__ import annotations

from typing import Any
from unittest import mock

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.planner import AUTO_SCHEDULES, price_plan
from pdcompile.planner.simulation import simulate_plan


def _chain(n: int = 8, *, fwd: float = 0.01, act: float = 1e6, params: float = 1e6,
           uneven: bool = False) -> nx.DiGraph:
    graph = new_cost_graph("chain", 32)
    add_block(graph, "input", fwd=0.0, bwd=0.0, act=act, params=0.0)
    previous = "input"
    for i in range(n):
        scale = (1 + 3 * (i == n - 1)) if uneven else 1
        add_block(graph, f"l{i}", fwd=fwd * scale, bwd=2 * fwd * scale, act=act, params=params)
        graph.add_edge(previous, f"l{i}")
        previous = f"l{i}"
    return graph


@pytest.mark.slow
def test_auto_takes_the_fastest_schedule_in_simulation() -> None:
    graph = _chain()
    cluster = Cluster.parse("4@1e9")
    auto = pdcompile.plan(graph, cluster, schedule="auto", planner="dp")
    assert auto.schedule in AUTO_SCHEDULES
    # no single schedule the planner tries does better than what "auto" returns
    for name in AUTO_SCHEDULES:
        try:
            alone = pdcompile.plan(graph, cluster, schedule=name, planner="dp")
        except PlanError:
            continue
        assert auto.time_per_minibatch <= alone.time_per_minibatch * (1 + 1e-9), name
    _, simulated = simulate_plan(graph, auto, cluster, timeline=False)
    assert auto.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)


def test_flush_schedules_choose_their_microbatches() -> None:
    plan = pdcompile.plan(_chain(), "4@1e9", schedule="1f1b-flush", planner="dp")
    assert plan.schedule == "1f1b-flush" and plan.microbatches in (8, 32)
    given = pdcompile.plan(_chain(), "4@1e9", schedule="1f1b-flush", microbatches=4,
                           planner="dp")
    assert given.microbatches == 4


def test_warmup_depth_is_chosen_within_the_memory() -> None:
    # slow links: PipeDream's NOAM leaves the transfers exposed; with room the planner keeps
    # more minibatches in flight, and without room fewer than NOAM rather than no plan
    # (a transfer takes as long as a layer's forward and backward, 30 ms)
    graph = _chain(4, act=3e6, params=1e5)
    cluster = Cluster.parse("4@1e8")
    roomy = pdcompile.plan(graph, cluster, stages=4, memory="64GiB")
    assert roomy.stages[0].in_flight > 4  # NOAM of the first of 4 stages
    _, noam = simulate_plan(graph, roomy, cluster, warmup="noam", timeline=False)
    assert roomy.time_per_minibatch < 0.8 * noam.time_per_minibatch
    held = roomy.stages[0].memory
    tight = pdcompile.plan(graph, cluster, stages=4, memory=held / 3)
    assert tight.stages[0].in_flight < roomy.stages[0].in_flight
    assert all(s.memory <= held / 3 * (1 + 1e-9) for s in tight.stages)
    assert tight.time_per_minibatch >= roomy.time_per_minibatch


def test_a_stage_recomputes_where_the_memory_caps_its_minibatches_in_flight() -> None:
    # big activations, small weights, slow links: PipeDream's warm-up does not fit, and one
    # minibatch in flight leaves the transfers exposed; recomputing keeps only the inputs
    graph = _chain(4, act=3e9, params=1e6)
    cluster = Cluster.parse("4@3e10")
    limit = 12e9
    plan = pdcompile.plan(graph, cluster, stages=4, memory=limit)
    assert any(s.recompute for s in plan.stages)
    assert all(s.memory <= limit * (1 + 1e-9) for s in plan.stages)
    _, simulated = simulate_plan(graph, plan, cluster, timeline=False)
    assert simulated.peak_memory <= limit * (1 + 1e-9)
    # the same stages keeping their activations instead: slower within the same memory
    keeping = Plan(stages=tuple(Stage(s.nodes, s.replicas, s.ranks) for s in plan.stages),
                   time_per_minibatch=0.0, dp_time=0.0, workers=4)
    without = price_plan(graph, keeping, cluster, memory=limit)
    assert plan.time_per_minibatch < without.time_per_minibatch


def test_interleaved_plans_put_chunks_on_ranks_round_robin() -> None:
    graph = _chain(8)
    cluster = Cluster.parse("2@1e10")
    plan = pdcompile.plan(graph, cluster, schedule="interleaved-1f1b", microbatches=4,
                          planner="dp")
    assert len(plan.stages) == 4
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    _, simulated = simulate_plan(graph, plan, cluster, timeline=False)
    assert plan.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_shaped_plans_fold_the_chunks_into_a_v(schedule: str) -> None:
    graph = _chain(8)
    cluster = Cluster.parse("2@1e10")
    plan = pdcompile.plan(graph, cluster, schedule=schedule, microbatches=4, planner="dp")
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    _, simulated = simulate_plan(graph, plan, cluster, timeline=False)
    assert plan.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)
    # the closed form (cost/bubble.py's V fill on the stages' own times) within 5%
    assert plan.extra["closed_form_time_per_minibatch"] == pytest.approx(
        simulated.time_per_minibatch, rel=0.05)


def test_v_shaped_plans_hold_both_chunks_within_the_memory() -> None:
    # weights dominate: a rank holds both of its chunks' weights, gradients and Adam moments
    graph = _chain(8, act=1e3, params=1e8)
    cluster = Cluster.parse("2@1e10")
    roomy = pdcompile.plan(graph, cluster, schedule="zb-v", microbatches=4, planner="dp")
    per_rank = [sum(s.memory for s in roomy.stages if s.ranks == (r,)) for r in (0, 1)]
    assert max(per_rank) >= 4 * 4 * 1e8  # 4 layers' weights, gradients and 2 moments
    with pytest.raises(PlanError, match="does not fit"):
        pdcompile.plan(graph, cluster, schedule="zb-v", microbatches=4, planner="dp",
                       memory=max(per_rank) * 0.9)


def test_dualpipev_needs_two_microbatches_per_rank_to_be_planned() -> None:
    # the schedule's own reason, not "does not fit ... it needs 376 KiB per worker" (the memory
    # message, wrong where the model fits the memory)
    for given in (dict(), dict(stages=2)):
        with pytest.raises(PlanError, match=r"dualpipev.*needs at least 2p = 4 microbatches") \
                as caught:
            pdcompile.plan(_chain(8), "4@1e10" if given else "2@1e10", schedule="dualpipev",
                           microbatches=3, planner="dp", **given)
        assert "does not fit" not in str(caught.value)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipev"])
def test_stages_k_with_a_chunked_schedule_gives_k_workers_their_chunks(schedule: str) -> None:
    """stages=K counts workers, as for every schedule: with chunks, each of the first K ranks
    holds two (they were refused as if the model did not fit the memory)."""
    plan = pdcompile.plan(_chain(8), "4@1e10", schedule=schedule, microbatches=4, stages=2,
                          planner="dp")
    v_shape = schedule in ("zb-v", "dualpipev")
    assert [s.ranks for s in plan.stages] == (
        [(0,), (1,), (1,), (0,)] if v_shape else [(0,), (1,), (0,), (1,)])


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipev"])
def test_a_planned_chunked_plan_records_its_chunks_through_json_and_export(
        schedule: str, tmp_path: Any) -> None:
    """A plan the planner chunks records its chunks per rank (and a V its placement) as a plan
    placed by planner.interleave does, through plan.json and an export's load. Before, the
    search priced the placed plan's stages anew and dropped `chunks_per_rank` and
    `placement`."""
    import torch
    from torch import nn

    from pdcompile.planner.interleave import fold_v, interleave

    v_shape = schedule in ("zb-v", "dualpipev")
    planned = pdcompile.plan(_chain(8), "2@1e10", schedule=schedule, microbatches=4,
                             planner="dp")
    straight = pdcompile.plan(_chain(8), "4@1e10", stages=4, straight=True)
    placed = fold_v(straight) if v_shape else interleave(straight, 2)
    wanted = {"chunks_per_rank": 2, **({"placement": "v"} if v_shape else {})}
    for plan in (planned, placed, Plan.from_json(planned.to_json())):
        assert {k: plan.extra.get(k) for k in ("chunks_per_rank", "placement")
                if k in plan.extra} == wanted
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    x = torch.randn(8, 4)
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.mse_loss,
                             cluster="2@1e10", schedule=schedule, microbatches=4,
                             cost="analytic")
    assert len(pipe.plan.stages) == 4
    pipe.export(str(tmp_path / "out"))
    loaded = pdcompile.load(str(tmp_path / "out")).plan
    assert {k: loaded.extra.get(k) for k in ("chunks_per_rank", "placement")
            if k in loaded.extra} == wanted


def test_stages_k_balances_cost_not_parameters() -> None:
    # the last layer costs four times the others: four balanced stages give it a stage alone
    graph = _chain(8, uneven=True)
    plan = pdcompile.plan(graph, "4@1e10", stages=4)
    assert len(plan.stages) == 4 and all(s.replicas == 1 for s in plan.stages)
    assert plan.stages[-1].nodes == ("l7",)
    with pytest.raises(PlanError, match="needs 5 workers"):
        pdcompile.plan(graph, "4@1e10", stages=5)


def test_a_given_plan_is_priced_like_a_planned_one() -> None:
    graph = _chain()
    cluster = Cluster.parse("2@1e9")
    given = Plan(stages=(Stage(("input", "l0", "l1", "l2", "l3"), 1, (0,)),
                         Stage(("l4", "l5", "l6", "l7"), 1, (1,))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=2, planner="given")
    priced = price_plan(graph, given, cluster)
    assert priced.time_per_minibatch > 0 and priced.dp_time > 0
    assert "inf" not in priced.summary() and "0 ns per minibatch" not in priced.summary()
    _, simulated = simulate_plan(graph, priced, cluster, timeline=False)
    assert priced.time_per_minibatch == pytest.approx(simulated.time_per_minibatch)
    assert [s.nodes for s in priced.stages] == [s.nodes for s in given.stages]


def test_summary_says_when_data_parallelism_does_not_fit() -> None:
    graph = _chain(4, act=3e9, params=1e6)
    plan = pdcompile.plan(graph, "4@1e10", planner="dp", memory=8e9)
    assert plan.extra["dp_fits"] is False
    text = plan.summary()
    assert "plain data parallelism does not fit the memory" in text
    assert "over data parallel" not in text


def test_compile_keeps_a_plan_priced_on_its_cluster() -> None:
    """A plan the planner priced for this cluster and schedule is compiled as it is (a second
    measurement of the model cannot change its figures); one priced elsewhere is priced again."""
    import dataclasses

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(8, 16)
    first = pdcompile.compile(model, "2@1e9", example_inputs=(x,), cost="analytic", plan=2).plan
    marked = dataclasses.replace(first, time_per_minibatch=first.time_per_minibatch * 7)
    kept = pdcompile.compile(model, "2@1e9", example_inputs=(x,), cost="analytic", plan=marked)
    assert kept.plan.time_per_minibatch == marked.time_per_minibatch
    elsewhere = pdcompile.compile(model, "2@1e7", example_inputs=(x,), cost="analytic",
                                  plan=marked)
    assert elsewhere.plan.time_per_minibatch != marked.time_per_minibatch
    assert elsewhere.plan.cluster == Cluster.parse("2@1e7").to_dict()


def test_the_no_fit_message_does_not_blame_a_memory_the_model_fits() -> None:
    """Where no candidate came out for another reason, the memory message said 'does not fit
    5.9 GiB ... it needs 376 KiB per worker'; it names the schedule instead."""
    from pdcompile.planner.costmodel import ModelOptions
    from pdcompile.planner.search import _no_fit

    cluster = Cluster.parse("2@1e10")
    options = ModelOptions(schedule="1f1b-flush", microbatches=4)
    roomy = _no_fit(_chain(8), cluster, options, 1e12, False)
    assert "does not fit" not in str(roomy) and "'1f1b-flush'" in str(roomy)
    tight = _no_fit(_chain(8, params=1e8), cluster, options, 1e8, False)
    assert "does not fit" in str(tight) and "it needs" in str(tight)


def test_a_profile_name_in_place_of_a_cost_graph_names_the_loader() -> None:
    with pytest.raises(PlanError, match=r"load_pipedream\('vgg16'\)"):
        pdcompile.plan("vgg16", "4@1e9")


def test_2bw_runs_each_replica_at_most_its_microbatches_of_a_minibatch_ahead() -> None:
    """2BW's minibatch t runs on the update after t-2: a replica's forwards of t must follow
    its backwards of t-2. On a slow link the planner kept 64 microbatches in flight on 2 per
    minibatch, a plan whose schedule is refused when built (found by the export tests)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))).double()
    x, y = torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(8, 3, 4, dtype=torch.float64)
    pipe = pdcompile.compile(model, "3@1GB/s~1ms", example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, schedule="2bw", microbatches=2,
                             cost="analytic")
    for stage in pipe.plan.stages:
        assert stage.in_flight <= max(1, 2 // stage.replicas) + 1
    assert len(pipe.train([(x, y)] * 3)) == 3


@settings(max_examples=4, deadline=None)
@given(nodes=st.integers(2, 12), cost_model=st.sampled_from(["native", "pipedream"]),
       workers=st.sampled_from(["2@1e10", "2x2@1e10,1e9", "3@1e9"]))
def test_the_no_fit_search_prepares_each_clusters_states_once(
        nodes: int, cost_model: str, workers: str) -> None:
    """The memory search behind a refusal solves ~30 times on the same few clusters; it
    prepared the DP's states anew each time (93% of a 2,000-node graph's refusal time)."""
    from pdcompile.planner import search
    from pdcompile.planner.costmodel import ModelOptions

    calls: list[int] = []
    real = search.prepare

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        return real(*args, **kwargs)

    options = ModelOptions(schedule="1f1b-flush", microbatches=4, cost_model=cost_model)
    with mock.patch.object(search, "prepare", counted):
        refusal = search._no_fit(_chain(nodes, params=1e8), Cluster.parse(workers), options,
                                 1e8, False)
    assert isinstance(refusal, PlanError) and "per worker" in str(refusal), refusal
    assert len(calls) == len(set(calls)) <= 8, calls
