"""Wide flat clusters: the planner's plan on 2N workers of one fabric is never much slower than
its own plan for N of them given twice the replicas (a plan the 2N workers can run).

The DP over every worker of a flat cluster minimises its slowest stage; among the many plans
that tie there it returned deep pipelines whose later stages' in-flight counts leave the first
stage's round trips exposed, and above 16 workers nothing else was searched: GPT-2 XL on 32
H100s on one fabric got 18 stages at 872 ms where 8-8-8-8 runs at 116 ms (24 workers: 687 ms
against 138 ms; 128: 165 ms against 29 ms). Such clusters are now also planned as one
pipeline per group of workers, every group alike (planner/search.py `_replica_groups`). On
servers, where the servers-alike search found no replicated plan within the memory, the
planner answered "no plan" though one fits: it now plans every worker on its own there.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest

import pdcompile
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.plan import Plan
from pdcompile.planner.search import price_plan

WITHIN = 1.10  # the wide plan at most this many times the doubled narrow one
MEMORY = 10e9


def tied_lm(blocks: int = 48) -> nx.DiGraph:
    """A GPT-like chain: an embedding whose 320 MB the head reads again, `blocks` blocks of
    120 MB of weights and 1.6 GB of activations per minibatch."""
    graph = new_cost_graph("lm", 8)
    names = ["emb", *(f"b{i}" for i in range(blocks)), "head"]
    for name in names:
        fwd = 2e-3 if name == "emb" else 1e-2
        params = 3.2e8 if name == "emb" else 1e5 if name == "head" else 1.2e8
        add_block(graph, name, fwd=fwd, bwd=2 * fwd, act=1.6e9, params=params)
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    graph.graph["ties"] = [{"bytes": 3.2e8, "nodes": ["emb", "head"]}]
    return graph


def doubled(plan: Plan, workers: int) -> Plan:
    """`plan` on `workers` ranks with each stage's replicas doubled onto `workers` more."""
    stages = tuple(replace(s, replicas=2 * s.replicas,
                           ranks=s.ranks + tuple(r + workers for r in s.ranks), in_flight=0,
                           recompute=False, shares=()) for s in plan.stages)
    return replace(plan, stages=stages, workers=2 * workers)


@pytest.mark.parametrize("workers", [16, 20])
def test_a_wide_flat_cluster_plans_no_slower_than_half_of_it_doubled(workers: int) -> None:
    graph = tied_lm()
    wide = pdcompile.Cluster.parse(f"{2 * workers}@450GB/s~3us:h100")
    narrow = pdcompile.plan(graph, f"{workers}@450GB/s~3us:h100", memory=MEMORY)
    ours = pdcompile.plan(graph, wide, memory=MEMORY)
    twice = price_plan(graph, doubled(narrow, workers), wide, memory=MEMORY)
    assert ours.time_per_minibatch <= twice.time_per_minibatch * WITHIN, (
        f"{ours.config} at {ours.time_per_minibatch * 1e3:.1f} ms against {twice.config} at "
        f"{twice.time_per_minibatch * 1e3:.1f} ms")


def test_servers_whose_alike_plans_do_not_fit_still_get_a_replicated_plan() -> None:
    graph = tied_lm()
    plan = pdcompile.plan(graph, "4x8@450GB/s,450GB/s~3us,3us:h100", memory=MEMORY)
    assert plan.workers == 32 and any(s.replicas > 1 for s in plan.stages), plan.config


def test_servers_plan_no_slower_than_half_of_them_doubled() -> None:
    """On 8 servers of 4 the tied LM's stages need more memory and work than one server's
    pipeline gives them: one pipeline per group of 4 servers, both groups alike, is what runs
    it fastest. Before, the servers were planned one at a time, across, straight, or as every
    worker on its own (the DP's deep plan, 917 ms, against half the servers' plan doubled,
    which the old planner priced at 652 ms)."""
    graph = tied_lm()
    wide = pdcompile.Cluster.parse("4x8@450GB/s,400Gbps~3us,5us:h100")
    narrow = pdcompile.plan(graph, "4x4@450GB/s,400Gbps~3us,5us:h100", memory=MEMORY)
    ours = pdcompile.plan(graph, wide, memory=MEMORY)
    twice = price_plan(graph, doubled(narrow, 16), wide, memory=MEMORY)
    assert ours.time_per_minibatch <= twice.time_per_minibatch * WITHIN, (
        f"{ours.config} at {ours.time_per_minibatch * 1e3:.1f} ms against {twice.config} at "
        f"{twice.time_per_minibatch * 1e3:.1f} ms")
