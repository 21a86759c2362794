"""The all-reduce of a tied parameter that a plan splits across ranks, priced alike by the
simulator and the planner's closed form (cost/ties.py).

A language model's token embedding read again by its output head (GPT-2's wte / lm_head):
where a cut puts the two readers on different ranks, the runtime all-reduces the tie's
gradients over those ranks at every update (runtime/stage_runtime.py `reduce_tie`). The
simulator charges it to each rank's update, after every rank sharing the tie has reached its
own; the closed form to the update of each stage sharing it (and, under '1f1b', to the cycle
that couples their updates); neither where one rank holds every reader.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, from_dict, new_cost_graph, to_dict
from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import (
    SharedWeights,
    rank_tie_seconds,
    shared_weights,
    stage_tie_seconds,
)
from pdcompile.errors import ScheduleError
from pdcompile.models import gpt2
from pdcompile.passes.trace import trace
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.planner.simulation import simulate_plan


def _chain(blocks: list[tuple[float, float]], tie: float, *, tied: bool = True,
           params: float = 1e5, act: float = 1e6) -> nx.DiGraph:
    """An embedding of `tie` bytes, `blocks` (forward, backward seconds) and a head reading the
    embedding's weight again (`tied`; else a weight of its own of the same bytes, so that the
    two differ by the tie's all-reduce alone); `params` bytes of other weights per node. The
    CostGraph counts a tied weight at its first reader (the embedding)."""
    graph = new_cost_graph("lm", 8)
    names = ["emb"] + [f"b{i}" for i in range(len(blocks))] + ["head"]
    times = [(1e-3, 2e-3), *blocks, (1e-3, 2e-3)]
    for name, (fwd, bwd) in zip(names, times, strict=True):
        own = tie if name == "emb" or (name == "head" and not tied) else 0.0
        add_block(graph, name, fwd=fwd, bwd=bwd, act=act, params=params + own)
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    if tied:
        graph.graph["ties"] = [{"bytes": tie, "nodes": ["emb", "head"]}]
    return graph


def _plan(graph: nx.DiGraph, cuts: list[int], ranks: list[tuple[int, ...]],
          schedule: str, microbatches: int) -> Plan:
    order = list(graph.nodes)
    bounds = [0, *cuts, len(order)]
    stages = tuple(Stage(tuple(order[bounds[i]:bounds[i + 1]]), len(r), r)
                   for i, r in enumerate(ranks))
    return Plan(stages=stages, time_per_minibatch=0.0, dp_time=0.0,
                workers=max(max(r) for r in ranks) + 1, schedule=schedule,
                microbatches=microbatches)


def _simulated(graph: nx.DiGraph, plan: Plan, cluster: Cluster) -> float:
    return simulate_plan(graph, plan, cluster, timeline=False)[1].time_per_minibatch


TIE = 150e6  # GPT-2's 50k x 768 embedding in float32
NETWORK = Cluster.parse("4@1e10")


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe", "zb-h1"])
def test_a_tie_split_across_ranks_adds_its_allreduce_to_the_step(schedule: str) -> None:
    blocks = [(2e-3, 4e-3)] * 4
    tied, untied = _chain(blocks, TIE), _chain(blocks, TIE, tied=False)
    plan = _plan(tied, [3], [(0,), (1,)], schedule, 8)
    price = SharedWeights((0, 1), TIE).seconds([(0,), (1,)], NETWORK)
    assert price == pytest.approx(TIE / 1e10)  # a ring of two: 2 (r-1)/r = 1 x the bytes
    # stage 0 finishes its backwards last, then waits for the all-reduce before its step
    assert _simulated(tied, plan, NETWORK) - _simulated(untied, plan, NETWORK) \
        == pytest.approx(price, rel=1e-9)


def test_a_v_holding_both_readers_on_one_rank_pays_nothing() -> None:
    """ZB-V puts stages 0 and 3 (the embedding and the head) on rank 0: its copies are summed
    in memory (runtime/rank_ties.py), no all-reduce crosses ranks."""
    blocks = [(2e-3, 4e-3)] * 4
    tied, untied = _chain(blocks, TIE), _chain(blocks, TIE, tied=False)
    plan = _plan(tied, [2, 3, 4], [(0,), (1,), (1,), (0,)], "zb-v", 8)
    assert StageCosts.from_plan(tied, plan).ties == (SharedWeights((0, 3), TIE),)
    assert rank_tie_seconds(StageCosts.from_plan(tied, plan).ties,
                            [s.ranks for s in plan.stages], NETWORK) == {}
    assert _simulated(tied, plan, NETWORK) == pytest.approx(_simulated(untied, plan, NETWORK),
                                                            rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), schedule=st.sampled_from(["1f1b-flush", "gpipe", "1f1b"]),
       tie=st.floats(1e7, 3e8), bandwidth=st.sampled_from([1e9, 1e10, 1e11]))
def test_the_closed_form_prices_tied_plans_as_the_simulator(data: st.DataObject, schedule: str,
                                                             tie: float,
                                                             bandwidth: float) -> None:
    count = data.draw(st.integers(2, 6))
    blocks = [(data.draw(st.floats(1e-3, 1e-2)), data.draw(st.floats(1e-3, 2e-2)))
              for _ in range(count)]
    stages = data.draw(st.integers(2, min(4, count + 1)))
    cuts = sorted(data.draw(st.lists(st.integers(1, count + 1), min_size=stages - 1,
                                     max_size=stages - 1, unique=True)))
    cluster = Cluster.parse(f"4@{bandwidth}")
    ranks = [(s,) for s in range(stages)]
    micro = 1 if schedule == "1f1b" else data.draw(st.integers(4 * stages, 16))
    prices = {}
    for name, graph in (("tied", _chain(blocks, tie)), ("untied", _chain(blocks, tie, tied=False))):
        plan = _plan(graph, cuts, ranks, schedule, micro)
        priced = price_plan(graph, plan, cluster, memory=1e30, simulate=True)
        closed = priced.extra["closed_form_time_per_minibatch"]
        simulated = priced.extra["simulated_time_per_minibatch"]
        assert closed == pytest.approx(simulated, rel=0.10), name
        prices[name] = closed, simulated
    price = SharedWeights((0, stages - 1), tie).seconds(ranks, cluster)
    (closed_tied, simulated_tied), (closed_untied, simulated_untied) = \
        prices["tied"], prices["untied"]
    assert simulated_tied >= simulated_untied * (1 - 1e-9)
    assert closed_tied >= closed_untied * (1 - 1e-9)
    if schedule != "1f1b" and stages == 2:
        # a flush of two stages ends with stage 0's update, the tie's all-reduce in it (with
        # more, a stage between the two readers may finish later and hide some of it; the
        # last stage's step, microseconds here, then ends the minibatch if it is the longer)
        assert simulated_tied - simulated_untied == pytest.approx(price, rel=0.01)
        assert closed_tied - closed_untied == pytest.approx(price, rel=0.1)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.floats(0, 1e9), min_size=2, max_size=2),
       bandwidths=st.lists(st.floats(1e8, 1e12), min_size=2, max_size=2),
       stages=st.integers(2, 4), spread=st.booleans(), latency=st.floats(0, 1e-4))
def test_the_price_grows_with_bytes_falls_with_bandwidth_and_is_zero_on_one_rank(
        sizes: list[float], bandwidths: list[float], stages: int, spread: bool,
        latency: float) -> None:
    small, large = sorted(sizes)
    slow, fast = sorted(bandwidths)
    ranks = [(s,) for s in range(stages)] if spread else [(0,)] * stages
    tie = (0, stages - 1)

    def price(nbytes: float, bandwidth: float) -> float:
        cluster = Cluster.parse(f"{stages}@{bandwidth}~{latency}")
        return SharedWeights(tie, nbytes).seconds(ranks, cluster)

    assert price(small, slow) <= price(large, slow)
    assert price(large, fast) <= price(large, slow)
    if not spread:  # every reader on one rank: nothing crosses ranks
        assert price(large, slow) == 0.0
    else:
        assert price(large, slow) >= large / slow  # a ring of two: 2 (r-1)/r = 1 x the bytes
    # per stage: the sharing stages pay it, the others nothing; per rank likewise
    cluster = Cluster.parse(f"{stages}@{slow}~{latency}")
    per_stage = stage_tie_seconds([SharedWeights(tie, large)], ranks, cluster)
    assert per_stage == [price(large, slow) if s in tie else 0.0 for s in range(stages)]
    assert sum(rank_tie_seconds([SharedWeights(tie, large)], ranks, cluster).values()) \
        == pytest.approx(price(large, slow) * (2 if spread else 0))


def test_a_plan_that_keeps_both_readers_in_one_stage_shares_nothing() -> None:
    graph = _chain([(1e-3, 1e-3)] * 3, TIE)
    every = {n: 0 for n in graph.nodes}
    assert shared_weights(graph, every) == ()
    assert shared_weights(graph, every | {"head": 1}) == (SharedWeights((0, 1), TIE),)


def test_the_cost_graph_records_gpt2s_tied_embedding() -> None:
    torch.manual_seed(0)
    model, (idx,) = gpt2.factory(size="tiny", layers=1, d=16, heads=2, vocab_size=50,
                                 seq_len=6, batch_size=2, dropout=0.0)
    gm = trace(model)
    annotate_costs(gm, (idx,), source="analytic")
    graph = to_cost_graph(gm)
    assert graph.graph["ties"] == [{"bytes": 50 * 16 * 4.0, "nodes": ["wte", "lm_head"]}]
    assert from_dict(to_dict(graph)).graph["ties"] == graph.graph["ties"]


def test_ranks_sharing_a_tie_that_update_at_different_rates_are_refused() -> None:
    """Under '1f1b' a stage on two replicas updates half as often as one on one: the tie's
    all-reduce of update k would have no partner (the runtime refuses such a plan)."""
    graph = _chain([(2e-3, 4e-3)] * 2, TIE)
    plan = _plan(graph, [2], [(0, 1), (2,)], "1f1b", 1)
    with pytest.raises(ScheduleError, match=r"share tied parameters \(stages \(0, 1\)\).*"
                                            r"equal replicas or use a flush schedule"):
        simulate_plan(graph, plan, NETWORK, minibatches=8, timeline=False)
    # a flush updates every stage once per minibatch: it runs, and pays the tie
    flush = _plan(graph, [2], [(0, 1), (2,)], "1f1b-flush", 8)
    own = _chain([(2e-3, 4e-3)] * 2, TIE, tied=False)
    untied = _plan(own, [2], [(0, 1), (2,)], "1f1b-flush", 8)
    assert _simulated(graph, flush, NETWORK) > _simulated(own, untied, NETWORK)
