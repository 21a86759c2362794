"""Every stage holding a tied parameter keeps a copy of it, and the memory model counts each.

The split gives every stage that reads a tied parameter its own copy (passes/split.py; chunks
of one rank too, runtime/rank_ties.py), and each copy has its gradient, optimizer state and,
where the schedule stashes weights, its versions. The CostGraph counts the parameter once, at
its first reader; the stage costs add it to every other holder (cost/ties.py `copied_bytes`),
so the planner's memory check, `price_plan`'s memory per stage and the simulator's per rank
count what the stage modules really hold. Before, a later holder was short of the whole tie:
for GPT-2 small with Adam, 154 MB x 4 = 0.6 GB.
"""

from __future__ import annotations

import copy
import random

import networkx as nx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile import Cluster
from pdcompile.cost.costed_graph import costed
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import copied_bytes
from pdcompile.passes.frontend import capture
from pdcompile.passes.split import manual_plan
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.planner.simulation import simulate_plan
from pdcompile.schedule.kinds import weight_versions
from tests.helpers.third_party import hf_gpt2
from tests.helpers.tied_models import tied_lm_case, v_shaped


def _module_bytes(pipe: pdcompile.pipeline.Pipeline) -> list[float]:
    """Per stage, the bytes of the parameters its module holds (each tensor once)."""
    out = []
    for module in pipe.stage_modules:
        unique = {id(p): p for p in module.parameters()}
        out.append(float(sum(p.numel() * p.element_size() for p in unique.values())))
    return out


def _compiled(case: tuple, cut: list[int] | None = None, plan: Plan | None = None,
              schedule: str = "1f1b-flush") -> tuple[pdcompile.pipeline.Pipeline, nx.DiGraph]:
    """The case compiled with `plan` (or cut before the nodes at positions `cut` of the
    captured graph), and the CostGraph of that graph (analytic costs)."""
    model, inputs, target, loss_fn = case
    named = inputs if isinstance(inputs, dict) else None
    captured = capture(copy.deepcopy(model), () if named else inputs, named)
    if plan is None:
        order = [n.name for n in captured.graph.graph.nodes]
        plan = manual_plan(captured.graph,
                           lambda n: sum(order.index(n.name) >= c for c in cut or ()))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             example_target=target, plan=plan, schedule=schedule,
                             microbatches=4)
    graph = costed(captured.graph, captured.inputs, cost="analytic").graph
    return pipe, graph


def test_gpt2_cut_between_its_embedding_and_head_holds_the_tie_on_both_stages() -> None:
    """Hugging Face GPT-2 (wte read again as lm_head) cut in the middle: the last stage's
    module holds the 40 x 16 embedding too, and its priced parameter bytes say so."""
    pytest.importorskip("transformers")
    pipe, graph = _compiled(hf_gpt2(4), cut=[80])
    held = _module_bytes(pipe)
    assert [t.name for t in pipe.parts.ties] == ["transformer.wte.weight"]
    assert graph.graph["ties"][0]["bytes"] == 40 * 16 * 8.0
    costs = StageCosts.from_plan(graph, pipe.plan)
    assert list(costs.params) == held
    assert copied_bytes(graph, pipe.plan.stage_of(), 2) == [0.0, 40 * 16 * 8.0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), stages=st.integers(2, 4))
@example(seed=10437, stages=3)
def test_each_stage_is_priced_with_the_parameter_bytes_its_module_holds(seed: int,
                                                                        stages: int) -> None:
    """TiedLM reads its embedding at the input, in the middle and as the head, and calls one
    layer twice: any cut gives ties held by one, two or three stages, each with a copy."""
    rng = random.Random(seed)
    case = tied_lm_case(seed % 7)
    nodes = list(capture(copy.deepcopy(case[0]), case[1], None).graph.graph.nodes)
    # cut before operations only: a stage of a lone get_attr has nothing to run, and the
    # split refuses it in one line (found by seed 10437: a stage of `emb_weight` alone)
    calls = [i for i, n in enumerate(nodes[:-1]) if i >= 2 and n.op.startswith("call_")]
    cut = sorted(rng.sample(calls, stages - 1))
    pipe, graph = _compiled(case, cut=cut)
    assert list(StageCosts.from_plan(graph, pipe.plan).params) == _module_bytes(pipe)


def test_a_v_counts_both_copies_of_a_tie_on_the_rank_holding_them() -> None:
    """ZB-V puts the embedding's stage and the head's on rank 0: two copies there (summed in
    memory at the update, runtime/rank_ties.py), both in the rank's simulated memory."""
    case = tied_lm_case(0)
    pipe, graph = _compiled(case, plan=v_shaped(case[0]), schedule="zb-v")
    held = _module_bytes(pipe)
    assert list(StageCosts.from_plan(graph, pipe.plan).params) == held
    plan = Plan(stages=pipe.plan.stages, time_per_minibatch=0.0, dp_time=0.0, workers=2,
                schedule="zb-v", microbatches=4)
    memory = simulate_plan(graph, plan, Cluster.parse("2@1e9"), timeline=False)[1].memory
    for rank in (0, 1):
        stages = [s for s, stage in enumerate(plan.stages) if rank in stage.ranks]
        assert memory[rank].weights == sum(held[s] for s in stages)


TIE = 150e6  # GPT-2's 50k x 768 embedding in float32


def _lm(tie: bool) -> nx.DiGraph:
    """An embedding, four blocks and a head reading the embedding's `TIE` bytes again (or a
    weight of its own, which the CostGraph counts at the head); 1e6 bytes of other weights
    per block."""
    graph = new_cost_graph("lm", 8)
    names = ["emb", "b0", "b1", "b2", "b3", "head"]
    for name in names:
        own = TIE if name == "emb" else 1e6 + (TIE if name == "head" and not tie else 0.0)
        add_block(graph, name, fwd=1e-3, bwd=2e-3, act=1e6, params=own)
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    if tie:
        graph.graph["ties"] = [{"bytes": TIE, "nodes": ["emb", "head"]}]
    return graph


def _split(graph: nx.DiGraph, cuts: list[int], schedule: str, micro: int) -> Plan:
    order = list(graph.nodes)
    bounds = [0, *cuts, len(order)]
    stages = tuple(Stage(tuple(order[bounds[i]:bounds[i + 1]]), 1, (i,))
                   for i in range(len(bounds) - 1))
    return Plan(stages=stages, time_per_minibatch=0.0, dp_time=0.0, workers=len(stages),
                schedule=schedule, microbatches=micro)


@pytest.mark.parametrize("schedule, micro", [("1f1b-flush", 4), ("1f1b", 1), ("2bw", 4)])
def test_a_later_holder_is_priced_as_holding_a_weight_of_its_own(schedule: str,
                                                                  micro: int) -> None:
    """The tied head's stage needs the memory of an untied head of the same size: weights,
    gradients, Adam's two moments and the versions its schedule stashes, in `price_plan` and
    the simulator alike."""
    cluster = Cluster.parse("3@1e10")
    priced = {}
    for tie in (True, False):
        graph = _lm(tie)
        plan = _split(graph, [2, 4], schedule, micro)
        priced[tie] = price_plan(graph, plan, cluster, memory=1e30, simulate=False)
        simulated = simulate_plan(graph, priced[tie], cluster, timeline=False)[1].memory
        assert simulated[2].weights == pytest.approx(TIE + 2e6)  # b3, the head, the tie
    tied, untied = priced[True].stages, priced[False].stages
    assert [s.memory for s in tied] == pytest.approx([s.memory for s in untied])
    versions = weight_versions(schedule, tied[2].in_flight, copies=tied[2].in_flight > 1)
    assert tied[2].memory >= (3.0 + versions) * TIE  # weights, gradients, moments, versions


def test_the_planner_refuses_a_plan_whose_tie_copy_does_not_fit() -> None:
    """Memory for the head's stage without its tie but not with it: the plan does not fit."""
    cluster = Cluster.parse("3@1e10")
    graph = _lm(True)
    plan = _split(graph, [2, 4], "1f1b-flush", 4)
    need = price_plan(graph, plan, cluster, memory=1e30, simulate=False).stages[2].memory
    assert need > 4 * TIE
    assert price_plan(graph, plan, cluster, memory=need * 1.001,
                      simulate=False).extra["fits"]
    assert not price_plan(graph, plan, cluster, memory=need - 2 * TIE,
                          simulate=False).extra["fits"]
