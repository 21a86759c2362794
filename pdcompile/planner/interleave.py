"""Interleaved placement: a straight plan of K = p v stages becomes p ranks holding v chunks each.

Interleaved schedules (Narayanan et al., SC 2021) give every rank v non-adjacent chunks of the
model, chunk c on rank c mod p, so that a microbatch crosses all ranks v times and the pipeline
fills and drains in 1/v of the time. Any straight plan of p v stages can be placed that way;
`interleaved_plan` cuts a traced graph into p v chunks of about equal weight for it
(passes.split.even_plan), `balanced_chunks` a CostGraph into p v chunks of about equal compute
(the planner's cost-balanced K-stage cut can replace both).

A V (`schedule.placement`; ZB-V and DualPipeV) folds a straight plan of 2p stages instead: stage
c on rank c for c < p and on rank 2p - 1 - c after (`fold_v`, `v_plan`).
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import torch.fx as fx

from pdcompile.cost.costgraph import topological_order
from pdcompile.errors import PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.schedule.placement import chunk_placement, v_position


def interleave(plan: Plan, ranks: int) -> Plan:
    """`plan` (K unreplicated stages in pipeline order) with stage c on rank c mod `ranks`."""
    stages = len(plan.stages)
    if ranks < 2 or stages % ranks or stages == ranks:
        raise PlanError(f"an interleaved placement puts v >= 2 chunks on each of p >= 2 ranks; "
                        f"{stages} stages on {ranks} ranks is not one (cut {2 * max(ranks, 2)} "
                        f"stages for 2 chunks on {max(ranks, 2)} ranks)")
    replicated = [i for i, s in enumerate(plan.stages) if s.replicas != 1]
    if replicated:
        raise PlanError(f"stages {replicated} of the plan are replicated; an interleaved "
                        "placement runs every chunk on one rank (plan a straight pipeline)")
    placed = tuple(replace(stage, ranks=(c % ranks,)) for c, stage in enumerate(plan.stages))
    return replace(plan, stages=placed, workers=ranks, extra={
        **plan.extra, **chunk_placement([s.ranks for s in placed], v_shape=False)})


def fold_v(plan: Plan) -> Plan:
    """`plan` (2p unreplicated stages in pipeline order) folded into a V on p ranks."""
    stages = len(plan.stages)
    if stages < 4 or stages % 2:
        raise PlanError(f"a V puts 2 chunks on each of p >= 2 ranks, so it folds an even number "
                        f"of at least 4 stages; the plan has {stages} (cut {max(4, stages + 1)} "
                        "stages)")
    replicated = [i for i, s in enumerate(plan.stages) if s.replicas != 1]
    if replicated:
        raise PlanError(f"stages {replicated} of the plan are replicated; a V runs every chunk "
                        "on one rank (plan a straight pipeline)")
    ranks = stages // 2
    placed = tuple(replace(stage, ranks=(v_position(c, ranks),))
                   for c, stage in enumerate(plan.stages))
    return replace(plan, stages=placed, workers=ranks, extra={
        **plan.extra, **chunk_placement([s.ranks for s in placed], v_shape=True)})


def v_plan(gm: fx.GraphModule, ranks: int) -> Plan:
    """2 `ranks` stages of about equal weight (passes.split.even_plan), folded into a V."""
    from pdcompile.passes.split import even_plan

    return fold_v(even_plan(gm, 2 * ranks))


def interleaved_plan(gm: fx.GraphModule, ranks: int, chunks: int) -> Plan:
    """`ranks` x `chunks` stages of about equal weight (passes.split.even_plan), interleaved."""
    from pdcompile.passes.split import even_plan

    if chunks < 2:
        raise PlanError(f"chunks must be at least 2 per rank to interleave (got {chunks}); "
                        "with one chunk per rank use even_plan")
    return interleave(even_plan(gm, ranks * chunks), ranks)


def balanced_chunks(graph: nx.DiGraph, ranks: int, chunks: int) -> Plan:
    """`ranks` x `chunks` contiguous pieces of the CostGraph's topological order, each closing
    once its fwd + bwd reaches its share of the total (every piece keeps at least one node),
    interleaved over `ranks`."""
    order = topological_order(graph)
    stages = ranks * chunks
    if len(order) < stages:
        raise PlanError(f"the graph has {len(order)} nodes, too few for {stages} chunks")
    work = [float(graph.nodes[n]["fwd"]) + float(graph.nodes[n]["bwd"]) for n in order]
    total = sum(work) or 1.0
    pieces: list[list[str]] = [[]]
    done = 0.0
    for index, (node, cost) in enumerate(zip(order, work, strict=True)):
        left = len(order) - index  # nodes still to place, this one included
        closed = len(pieces) - 1
        if pieces[-1] and closed < stages - 1 and (
                done + cost / 2 > total * (closed + 1) / stages or left <= stages - 1 - closed):
            pieces.append([])
        pieces[-1].append(node)
        done += cost
    plan = Plan(stages=tuple(Stage(nodes=tuple(p), replicas=1, ranks=(i,))
                             for i, p in enumerate(pieces)),
                time_per_minibatch=0.0, dp_time=0.0, workers=stages, planner="balanced",
                status="GIVEN")
    return interleave(plan, ranks)


__all__ = ["balanced_chunks", "fold_v", "interleave", "interleaved_plan", "v_plan"]
