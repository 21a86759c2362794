"""The DP's search over a CostGraph: antichain states within a budget, the DP run on them, and
the stages it chooses mapped back to the graph's nodes.

`prepare` tries in turn every downset (native cost model only: exact), PipeDream's antichains,
the same on a coarsened graph, and the prefixes of a topological order of the coarsened graph;
inputs are pinned to the first stage (their traffic to later stages is still charged).
`planning_dp` is the native DP's optimum of its planning objective, the search at the heart of
`pdcompile.plan`, which the tests hold against brute force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx

from pdcompile.cost.costgraph import coarsen, edge_bytes, topological_order
from pdcompile.cost.crossing import input_nodes
from pdcompile.errors import CostGraphError
from pdcompile.machine.cluster import Cluster
from pdcompile.planner.costmodel import ModelOptions

if TYPE_CHECKING:
    from pdcompile.planner.search_cache import SearchCache

COARSE_NODES = 300  # graphs bigger than this are coarsened before the fallbacks below
DP_BUDGET = 1e7  # (states^2 / 2) * (workers, replicas) pairs: elements per pass of the DP
FEWEST_STATES = 16  # the budget never goes below this many states
MOST_STAGES = 512  # a straight pipeline of exactly this many stages at most (plan's `stages`)
# cost_model="pipedream" (dp.pipedream_dp): its states within what one call may spend
PIPEDREAM_STATES = 2000  # at most this many states (the original enumerates up to 6000)
PIPEDREAM_WORK = 2e8  # candidates a level over the first state visits: states^2 / 2 * pairs
PIPEDREAM_CUBE = 2e9  # ... a level over every state without shortcuts: states^3 / 3 * pairs
PIPEDREAM_PRUNED = 8e9  # ... the same with them (dp._pd_level_all_starts visits a fraction)
PIPEDREAM_BYTES = 384 << 20  # the value, split and gather tables of a level over every state


def state_budget(workers: int, *, straight: bool = False) -> int:
    """How many antichain states the native DP may run on over `workers`: a pass of the DP
    touches about states^2 / 2 stages at each of its (workers, replicas) pairs (dp.dp_pairs),
    which DP_BUDGET bounds; at least 200 states up to UNIT_LIMIT units (then the pairs are at
    most 528), and at most 1500."""
    from pdcompile.planner.dp import UNIT_LIMIT, dp_pairs

    pairs = dp_pairs(workers, straight=straight)
    if straight and workers <= UNIT_LIMIT:  # the same states as the replicated DP's
        pairs = workers * (workers + 1) // 2
    floor = 200 if pairs <= UNIT_LIMIT * (UNIT_LIMIT + 1) // 2 else FEWEST_STATES
    return max(floor, min(1500, int((2 * DP_BUDGET / pairs) ** 0.5)))


def pipedream_budget(levels: tuple[int, ...], *, straight: bool = False,
                     memory: bool = False) -> int:
    """How many antichain states `dp.pipedream_dp` may run on for a cluster whose levels have
    `levels` members each (innermost first), so that its time and memory stay bounded: the
    outermost level visits about states^2 / 2 (units, replicas) pairs (PIPEDREAM_WORK); each
    inner level keeps tables of states^2 (units + 1) entries (PIPEDREAM_BYTES) and spans about
    states^3 / 3 pairs: at most PIPEDREAM_CUBE where no exact shortcut applies (a memory limit,
    straight, units of several members), else PIPEDREAM_PRUNED (the shortcuts visit a
    fraction of them). Levels wider than UNIT_LIMIT count in units (dp.unit_bounds). At most
    PIPEDREAM_STATES; at least FEWEST_STATES."""
    from pdcompile.planner.dp import unit_bounds

    most = float(PIPEDREAM_STATES)
    for depth, members in enumerate(levels):
        units = len(unit_bounds(members, straight=straight)) - 1
        pairs = max(1, units - 1 if straight else units * (units - 1) // 2)
        if depth == len(levels) - 1:
            most = min(most, (2 * PIPEDREAM_WORK / pairs) ** 0.5)
            continue
        most = min(most, (PIPEDREAM_BYTES / (32 * (units + 1))) ** 0.5)
        plain = memory or straight or units < members
        most = min(most, (3 * (PIPEDREAM_CUBE if plain else PIPEDREAM_PRUNED) / pairs) ** (1 / 3))
    return max(FEWEST_STATES, int(most))


@dataclass
class Prepared:
    """What the DP runs on: states over `core`, tables over `graph` (= core + pinned)."""

    states: Any
    kind: str
    mapping: dict[str, list[str]]
    graph: nx.DiGraph
    pinned: tuple[str, ...]
    order: tuple[str, ...] = ()  # the prepared graph's nodes in topological order (`expand`)


def prepare(work: nx.DiGraph, cost_model: str, workers: int, *, straight: bool = False,
            least: int = 0, levels: tuple[int, ...] | None = None,
            memory: bool = False, cache: SearchCache | None = None) -> Prepared:
    """Antichain states of `work` within the DP's budget (native: `state_budget`, raised to
    `least` where a pipeline of exactly least - 1 stages is asked for; pipedream:
    `pipedream_budget` of the cluster's `levels`, default one level of `workers`, `memory`
    whether a memory limit applies), trying in turn: every downset (native only: exact),
    PipeDream's antichains, the same on a coarsened graph, and finally the prefixes of a
    topological order of the coarsened graph (at most the budget of them, cut where they spread
    its compute evenly). A pipedream graph with at least as many nodes as its budget is
    coarsened first (its antichains would be at least that many, and enumerating them costs
    nodes^2). `cache`: the search this is part of, whose coarsened graphs are made once."""
    from pdcompile.planner.antichain import antichain_states, prefix_states

    if cost_model == "native":
        budget = state_budget(workers, straight=straight)
    else:
        budget = pipedream_budget(levels or (workers,), straight=straight, memory=memory)
    budget = max(budget, least)
    order = tuple(topological_order(work))
    pinned = pinned_inputs(work, order) if cost_model == "native" else ()
    core = work.subgraph([n for n in work.nodes if n not in set(pinned)]).copy()
    identity = {node: [node] for node in core.nodes}
    # a graph of n nodes has at least n + 1 downsets (the prefixes of a topological order)
    if cost_model == "native" and core.number_of_nodes() < budget:
        try:
            states = antichain_states(core, complete=True, max_states=budget)
            return Prepared(states, "all downsets", identity, work, pinned, order)
        except CostGraphError:
            pass
    if cost_model == "native" or core.number_of_nodes() < budget:
        try:
            states = antichain_states(core, max_states=budget)
            return Prepared(states, "pipedream antichains", identity, work, pinned, order)
        except CostGraphError:
            pass
    target = max(min(COARSE_NODES, budget - 1), least - 1)
    if cache is None:
        full, mapping = coarse_with_pinned(work, target, pinned)
    else:  # neither is changed below nor by the DP: they may serve every DP of the search
        full, mapping = cache.made(("coarse", id(work), target, pinned), work,
                                   lambda: coarse_with_pinned(work, target, pinned))
    coarse = full.subgraph([b for b in full.nodes if b not in set(pinned)]).copy()
    blocks = coarse.number_of_nodes()
    try:
        states = antichain_states(coarse, max_states=budget)
        kind = f"pipedream antichains of {blocks} coarse blocks"
    except CostGraphError:
        states = prefix_states(coarse, most=budget)
        kind = f"prefixes of a topological order of {blocks} coarse blocks"
        if len(states) - 1 < blocks:
            kind += f", cut at {len(states) - 2} places"
    return Prepared(states, kind, mapping, full, pinned, order)


def coarse_with_pinned(work: nx.DiGraph, target: int, pinned: tuple[str, ...] | None = None,
                        ) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """`work` with its chains fused down to about `target` blocks, inputs kept apart (so that they
    stay pinned to the first stage); mapping block -> original nodes (inputs map to themselves)."""
    if pinned is None:
        pinned = pinned_inputs(work)
    core = work.subgraph([n for n in work.nodes if n not in set(pinned)]).copy()
    coarse, mapping = coarsen(core, target=target)
    full = coarse.copy()
    block_of = {m: b for b, members in mapping.items() for m in members}
    for z in pinned:
        full.add_node(z, **work.nodes[z])
        mapping[z] = [z]
        for v in work.successors(z):
            b = block_of[v]
            extra = full.edges[z, b]["bytes"] if full.has_edge(z, b) else 0.0
            full.add_edge(z, b, bytes=extra + edge_bytes(work, z, v))
    return full, mapping


def planning_dp(graph: nx.DiGraph, cluster: Cluster, *, options: ModelOptions,
                memory: float | None, straight: bool = False,
                ) -> tuple[float, list[tuple[list[str], tuple[int, ...]]]]:
    """The native DP's optimum of its planning objective (costmodel.stage_values, in-flight
    counts as deep as memory allows) and its stages: the search at the heart of `plan`, which
    the tests hold against brute force. Raises PlanError when nothing fits."""
    prepared = prepare(graph, "native", cluster.workers)
    result = solve(prepared, cluster, options, memory, straight)
    states = prepared.states
    stages = [(states.stage_nodes(s.before, s.after), s.ranks) for s in result.stages]
    if stages and prepared.pinned:
        stages[0] = (list(prepared.pinned) + stages[0][0], stages[0][1])
    return result.objective, expand(stages, prepared.mapping, {}, graph)


def solve(prepared: Prepared, cluster: Cluster, options: Any, limit: float | None,
           straight: bool, *, tie_counts: tuple[int, ...] | None = None) -> Any:
    """The DP's best plan of the prepared states (pipedream: the original's recurrence, with
    `tie_counts` the replicas of the stages splitting each tie, `dp.pipedream_dp`)."""
    from pdcompile.planner.dp import native_dp, pipedream_dp, stage_grid, state_tables

    tables = state_tables(prepared.graph, prepared.states, prepared.pinned)
    if options.cost_model == "pipedream":
        return pipedream_dp(tables, cluster, memory=limit, straight=straight,
                            tie_counts=tie_counts)
    grid = stage_grid(tables, cluster, options=options, memory=limit, straight=straight)
    return native_dp(grid, options=options, straight=straight)


def expand(stages: list[tuple[list[str], tuple[int, ...]]], mapping: dict[str, list[str]],
            attach: dict[str, str | None], graph: nx.DiGraph, *, order: tuple[str, ...] = (),
            ) -> list[tuple[list[str], tuple[int, ...]]]:
    """The stages' nodes of `graph` (blocks through `mapping`, left-out nodes through
    `attach`), each stage's in topological order (`order` if given: `Prepared.order`)."""
    stage_of = {}
    for i, (nodes, _) in enumerate(stages):
        for block in nodes:
            for node in mapping.get(block, [block]):
                stage_of[node] = i
    for node, target in attach.items():
        stage_of[node] = 0 if target is None else stage_of[target]
    order = order or tuple(topological_order(graph))
    by_stage: list[list[str]] = [[] for _ in stages]
    for n in order:
        by_stage[stage_of[n]].append(n)
    return [(nodes, ranks) for nodes, (_, ranks) in zip(by_stage, stages, strict=True)]


def planning_graph(graph: nx.DiGraph, cost_model: str,
                    ) -> tuple[nx.DiGraph, dict[str, str | None]]:
    """The graph the DP sees and the nodes left out of it (-> the node whose stage they join,
    None for the first stage). Native: inputs (costmodel.input_nodes) are pinned to the first
    stage; their traffic to later stages is still charged (dp.state_tables `pinned`)."""
    if cost_model == "pipedream":
        from pdcompile.planner.costmodel import pipedream_view

        return pipedream_view(graph)
    return graph, {}


def pinned_inputs(graph: nx.DiGraph, order: tuple[str, ...] = ()) -> tuple[str, ...]:
    pinned = set(input_nodes(graph))
    return tuple(n for n in order or topological_order(graph) if n in pinned)


__all__ = ["COARSE_NODES", "DP_BUDGET", "FEWEST_STATES", "MOST_STAGES", "PIPEDREAM_BYTES",
           "PIPEDREAM_CUBE", "PIPEDREAM_PRUNED", "PIPEDREAM_STATES", "PIPEDREAM_WORK", "Prepared",
           "coarse_with_pinned", "expand", "pinned_inputs", "pipedream_budget", "planning_dp",
           "planning_graph", "prepare", "solve", "state_budget"]
