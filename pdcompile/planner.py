"""`pdcompile.plan`: choose stages, replicas and ranks for a CostGraph on a Cluster.

The entry point of the partitioner (passes/partition): validates the input, picks the antichain
states (coarsening big graphs first), runs PipeDream's dynamic program, optionally improves or
verifies it with the exact CP-SAT model, and prices the result with the one cost model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx

from pdcompile.cluster import Cluster
from pdcompile.costgraph import coarsen, edge_bytes, topological_order, validate
from pdcompile.errors import CostGraphError, PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.units import format_bytes, parse_quantity

PLANNERS = ("auto", "dp", "ilp")
ILP_AUTO_NODES = 60  # "auto" runs CP-SAT after the DP on graphs this small (after coarsening)
ILP_DEFAULT_LIMIT = 10.0  # seconds


def plan(cost_graph: nx.DiGraph, cluster: Cluster | str, *, planner: str = "auto",
         cost_model: str = "native", straight: bool = False, memory: float | str | None = None,
         time_limit: float | None = None, schedule: str = "1f1b", microbatches: int = 1,
         ) -> Plan:
    """Partition `cost_graph` over `cluster` and return the Plan (see pdcompile.plan.Plan).

    planner: "dp" (PipeDream's dynamic program), "ilp" (DP, then the exact CP-SAT model warm-started
    from it), "auto" (CP-SAT only when the graph is small). cost_model: "native" or "pipedream"
    (the original optimizer's model; it applies a memory constraint only when `memory` is given,
    as the original does with --use_memory_constraint). memory: bytes per worker (or "16GiB"),
    default the cluster device's memory. time_limit: seconds for CP-SAT (default 10).
    """
    from pdcompile.passes.partition.costmodel import ModelOptions, data_parallel_time, evaluate

    started = time.perf_counter()
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r}; use one of {', '.join(PLANNERS)}")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be a pdcompile.Cluster or a cluster string, not "
                        f"{type(cluster).__name__}")
    validate(cost_graph)
    options = ModelOptions(cost_model=cost_model, schedule=schedule, microbatches=microbatches)
    limit = _memory(memory, cluster, cost_model)
    if time_limit is not None and not time_limit > 0:
        raise PlanError(f"time_limit must be > 0 seconds (got {time_limit!r})")

    if planner == "ilp" and (straight or cost_model != "native"):
        raise PlanError("the CP-SAT planner handles the native cost model without --straight; "
                        "use planner='dp' for cost_model='pipedream' or straight pipelines")
    work, attach = _planning_graph(cost_graph, cost_model)
    dp_stages, states_kind, mapping, dp_objective = _run_dp(work, cluster, options, limit,
                                                            straight, cost_graph)
    nodes_ranks = _expand(dp_stages, mapping, attach, cost_graph)
    priced, predicted = evaluate(cost_graph, nodes_ranks, cluster, options=options, memory=limit)
    extra: dict[str, Any] = {"states": states_kind, "memory_limit": limit}
    everything = [(topological_order(cost_graph), tuple(range(cluster.workers)))]
    dp_stages_priced, dp_predicted = evaluate(cost_graph, everything, cluster, options=options)
    dp_fits = limit is None or dp_stages_priced[0].memory <= limit
    extra["dp_fits"] = dp_fits  # whether plain data parallelism fits the memory limit
    flat_objective = cost_model == "native" or len(cluster.levels) == 1
    if flat_objective and not straight and len(priced) > 1:
        # The DP over an approximate state set (coarsened, linearised) can miss plain data
        # parallelism's price on the real graph; never return something worse than it.
        if dp_predicted < predicted and dp_fits:
            priced, predicted = dp_stages_priced, dp_predicted
            extra["fallback"] = "data parallel (cheaper than the DP's plan on the full graph)"
    objective = predicted
    if cost_model == "pipedream" and len(cluster.levels) > 1:
        # The original's hierarchical objective is recursive (a level's stage time is the best
        # pipeline of the level below); it is what the original reports, so we report it too.
        extra["flattened_time"] = predicted
        objective = dp_objective
    result = Plan(stages=priced, time_per_minibatch=objective,
                  dp_time=data_parallel_time(cost_graph, cluster, options=options),
                  workers=cluster.workers, cost_model=cost_model, planner="dp",
                  status="OPTIMAL" if states_kind == "all downsets" else "HEURISTIC",
                  bound=None, solve_seconds=0.0, cluster=cluster.to_dict(), extra=extra)
    if planner != "dp" and cost_model == "native" and not straight:
        model_graph, model_mapping = cost_graph, None
        if cost_graph.number_of_nodes() > ILP_AUTO_NODES:
            model_graph, model_mapping = _coarse_with_pinned(cost_graph, ILP_AUTO_NODES)
        blocks = model_graph.number_of_nodes() - len(_pinned_inputs(cost_graph))
        if planner == "ilp" or blocks <= ILP_AUTO_NODES:
            from pdcompile.passes.partition.ilp import improve

            result = improve(cost_graph, cluster, result, options=options, memory=limit,
                             time_limit=time_limit or ILP_DEFAULT_LIMIT,
                             model_graph=model_graph, mapping=model_mapping)
    return replace(result, solve_seconds=time.perf_counter() - started)


# ------------------------------------------------------------------------------ helpers
def _memory(memory: float | str | None, cluster: Cluster, cost_model: str) -> float | None:
    if memory is None:
        return None if cost_model == "pipedream" else float(cluster.device.memory)
    try:
        value = parse_quantity(memory, "bytes")
    except (ValueError, TypeError) as err:
        raise PlanError(f"memory {memory!r}: {err}") from None
    if not value > 0 or math.isinf(value):
        raise PlanError(f"memory per worker must be a positive number of bytes (got {memory!r}); "
                        "write e.g. memory='16GiB'")
    return value


def _planning_graph(graph: nx.DiGraph, cost_model: str,
                    ) -> tuple[nx.DiGraph, dict[str, str | None]]:
    """The graph the DP sees and the nodes left out of it (-> the node whose stage they join,
    None for the first stage). Native: inputs (costmodel.input_nodes) are pinned to the first
    stage; their traffic to later stages is still charged (dp.state_tables `pinned`)."""
    if cost_model == "pipedream":
        from pdcompile.passes.partition.costmodel import pipedream_view

        return pipedream_view(graph)
    return graph, {}


def _pinned_inputs(graph: nx.DiGraph) -> tuple[str, ...]:
    from pdcompile.passes.partition.costmodel import input_nodes

    pinned = set(input_nodes(graph))
    return tuple(n for n in topological_order(graph) if n in pinned)


COARSE_NODES = 300  # graphs bigger than this are coarsened before the fallbacks below
DP_BUDGET = 3e7  # (states^2 / 2) * (workers (workers + 1) / 2) elements: well under 1 s of numpy


def _state_budget(workers: int) -> int:
    return max(200, min(1500, int((4 * DP_BUDGET / (workers * (workers + 1))) ** 0.5)))


@dataclass
class _Prepared:
    """What the DP runs on: states over `core`, tables over `graph` (= core + pinned)."""

    states: Any
    kind: str
    mapping: dict[str, list[str]]
    graph: nx.DiGraph
    pinned: tuple[str, ...]


def _prepare(work: nx.DiGraph, cost_model: str, workers: int) -> _Prepared:
    """Antichain states of `work` within the DP's budget, trying in turn: every downset (native
    only: exact), PipeDream's antichains, the same on a coarsened graph, and finally the prefixes
    of a topological order of the coarsened graph."""
    from pdcompile.passes.partition.antichain import antichain_states, prefix_states

    budget = _state_budget(workers) if cost_model == "native" else 6000
    pinned = _pinned_inputs(work) if cost_model == "native" else ()
    core = work.subgraph([n for n in work.nodes if n not in set(pinned)]).copy()
    identity = {node: [node] for node in core.nodes}
    if cost_model == "native":
        try:
            states = antichain_states(core, complete=True, max_states=budget)
            return _Prepared(states, "all downsets", identity, work, pinned)
        except CostGraphError:
            pass
    try:
        states = antichain_states(core, max_states=budget)
        return _Prepared(states, "pipedream antichains", identity, work, pinned)
    except CostGraphError:
        pass
    full, mapping = _coarse_with_pinned(work, COARSE_NODES, pinned)
    coarse = full.subgraph([b for b in full.nodes if b not in set(pinned)]).copy()
    try:
        states = antichain_states(coarse, max_states=budget)
        kind = f"pipedream antichains of {coarse.number_of_nodes()} coarse blocks"
    except CostGraphError:
        states = prefix_states(coarse)
        kind = f"prefixes of a topological order of {coarse.number_of_nodes()} coarse blocks"
    return _Prepared(states, kind, mapping, full, pinned)


def _coarse_with_pinned(work: nx.DiGraph, target: int, pinned: tuple[str, ...] | None = None,
                        ) -> tuple[nx.DiGraph, dict[str, list[str]]]:
    """`work` with its chains fused down to about `target` blocks, inputs kept apart (so that they
    stay pinned to the first stage); mapping block -> original nodes (inputs map to themselves)."""
    if pinned is None:
        pinned = _pinned_inputs(work)
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


def _solve(prepared: _Prepared, cluster: Cluster, options: Any, limit: float | None,
           straight: bool) -> Any:
    from pdcompile.passes.partition.dp import native_dp, pipedream_dp, state_tables

    tables = state_tables(prepared.graph, prepared.states, prepared.pinned)
    if options.cost_model == "pipedream":
        return pipedream_dp(tables, cluster, memory=limit, straight=straight)
    return native_dp(tables, cluster, options=options, memory=limit, straight=straight)


def _run_dp(work: nx.DiGraph, cluster: Cluster, options: Any, limit: float | None,
            straight: bool, original: nx.DiGraph,
            ) -> tuple[Any, str, dict[str, list[str]], float]:
    prepared = _prepare(work, options.cost_model, cluster.workers)
    try:
        result = _solve(prepared, cluster, options, limit, straight)
    except PlanError:
        raise _no_fit(original, prepared, cluster, options, limit, straight) from None
    states = prepared.states
    stages = [(states.stage_nodes(s.before, s.after), s.ranks) for s in result.stages]
    if stages and prepared.pinned:
        stages[0] = (list(prepared.pinned) + stages[0][0], stages[0][1])
    return stages, prepared.kind, prepared.mapping, result.objective


def _expand(stages: list[tuple[list[str], tuple[int, ...]]], mapping: dict[str, list[str]],
            attach: dict[str, str | None], graph: nx.DiGraph,
            ) -> list[tuple[list[str], tuple[int, ...]]]:
    stage_of = {}
    for i, (nodes, _) in enumerate(stages):
        for block in nodes:
            for node in mapping.get(block, [block]):
                stage_of[node] = i
    for node, target in attach.items():
        stage_of[node] = 0 if target is None else stage_of[target]
    order = topological_order(graph)
    return [([n for n in order if stage_of[n] == i], ranks) for i, (_, ranks) in enumerate(stages)]


def _no_fit(graph: nx.DiGraph, prepared: _Prepared, cluster: Cluster, options: Any,
            limit: float | None, straight: bool) -> PlanError:
    """The error for a model that fits no plan: the memory or the workers that would fit."""

    def fits(c: Cluster, mem: float) -> bool:
        try:
            _solve(prepared, c, options, mem, straight)
            return True
        except PlanError:
            return False

    lo, hi = 0.0, float(limit or 1.0)
    while not fits(cluster, hi) and hi < 1e18:
        lo, hi = hi, hi * 2
    for _ in range(14):  # to 1 part in 16000
        mid = (lo + hi) / 2
        if fits(cluster, mid):
            hi = mid
        else:
            lo = mid
    need_memory = hi
    more = None
    for factor in range(2, 9):
        outer = cluster.levels[-1]
        bigger = replace(cluster, levels=cluster.levels[:-1] + (
            replace(outer, workers=outer.workers * factor),))
        if bigger.workers > 4096:
            break
        if fits(bigger, float(limit or 0.0)):
            more = bigger.workers
            break
    how = (f"at least {more} workers" if more is not None
           else f"more than {cluster.workers * 8} workers")
    return PlanError(
        f"{graph.graph.get('name') or 'the model'} does not fit {format_bytes(limit or 0)} per "
        f"worker on {cluster.workers} workers under any plan; it needs "
        f"{_bytes_up(need_memory)} per worker on this cluster, or {how} with "
        f"{format_bytes(limit or 0)} each (pass memory=... / --memory, or a bigger cluster)")


def _bytes_up(value: float) -> str:
    """Bytes in GiB/MiB with two decimals, rounded up (so that the figure shown suffices)."""
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if value >= scale:
            return f"{math.ceil(value / scale * 100) / 100:.2f} {unit}"
    return f"{math.ceil(value)} B"


__all__ = ["plan", "Plan", "Stage"]
