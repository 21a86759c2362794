"""An exact CP-SAT model of pipeline partitioning over a general DAG (OR-Tools).

Decides, for every node, its stage; for every stage, its replicas and its rank position (stages
take consecutive ranks in pipeline order, every worker is used); minimises the slowest stage under
the native model's planning terms (costmodel.placement), which are the DP's: compute over replicas
plus ring all-reduce, against asynchronous communication of every edge crossing the stage's
boundary, skip connections included; per-worker memory must fit. Stages are convex (every edge
goes to the same or a later stage). Zero-cost inputs stay on the first stage, as in the DP.
A stage holding a reader of a tied parameter but not the reader whose params count it keeps a
copy (cost/ties.py), in its parameters' time and memory, as in the DP; under a streaming
schedule the stages holding a tie's readers take equal replica counts, as in the DP and as the
runtime requires (`ties.updates_apart`).

Times are scaled to integers (the model's rounding is below 1e-5 of the slowest stage); the
solution is re-priced exactly with costmodel.evaluate and kept only if it beats the DP's plan,
which is also the solver's hint, so the result is never worse than the hint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx

from pdcompile.cost.costgraph import edge_bytes, topological_order
from pdcompile.cost.crossing import input_nodes
from pdcompile.cost.pipeline_time import update_share
from pdcompile.cost.ties import copied_bytes, tie_readers
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner.costmodel import (
    ModelOptions,
    Placement,
    default_in_flight,
    placement,
)
from pdcompile.schedule.kinds import kind, weight_versions

ILP_WORKERS = 1  # CP-SAT's search workers: one, so that its search is deterministic
ILP_SEED = 0  # CP-SAT's random seed
WALL_GUARD = 100.0  # wall-clock guard, in multiples of the deterministic limit (a 2-core VM
# at load 15 took over 20 times the deterministic limit: the guard must never bind in practice)
SCALE_UNITS = 1e9  # integer units for the largest possible stage time
MEMORY_UNITS = 1_000_000  # integer units of the memory limit
BUCKET_UNITS = 100_000  # integer units of a gradient bucket (a stage's min(params, bucket))


def improve(graph: nx.DiGraph, cluster: Cluster, hint: Plan, *, options: ModelOptions,
            memory: float | None, time_limit: float, model_graph: nx.DiGraph | None = None,
            mapping: dict[str, list[str]] | None = None) -> Plan:
    """Solve the CP-SAT model warm-started from `hint` (a plan of `graph`); return its plan (the
    hint's stages where the solver found none in time), with planner "ilp", the solver's status
    and its lower bound on the model's objective (`ilp_objective`). The planner then prices it
    like its other candidates.

    `model_graph` (with `mapping` block -> nodes of `graph`) is a coarsened graph to solve
    instead; its plan is expanded to `graph`. The bound is then a bound for plans that keep
    each block whole."""
    if options.cost_model != "native":
        raise PlanError("the CP-SAT planner prices plans with the native cost model; use "
                        "planner='dp' with cost_model='pipedream'")
    started = time.perf_counter()
    coarse = graph if model_graph is None else model_graph
    solution = solve(coarse, cluster, options=options, memory=memory, time_limit=time_limit,
                     hint=_coarse_hint(hint, mapping) if mapping else hint)
    if solution.get("stages") and mapping:
        solution["stages"] = [([m for block in nodes for m in mapping.get(block, [block])], ranks)
                              for nodes, ranks in solution["stages"]]
    extra = dict(hint.extra) | {"ilp_status": solution["status"],
                                "ilp_seconds": time.perf_counter() - started}
    best = hint
    if solution.get("stages"):
        stages = tuple(Stage(tuple(nodes), len(ranks), tuple(ranks))
                       for nodes, ranks in solution["stages"])
        # the solver may use ranks the hint left idle (a hint of 1-1-1 on 4 workers)
        used = 1 + max(r for stage in stages for r in stage.ranks)
        best = replace(hint, stages=stages, workers=max(hint.workers, used))
    status = solution["status"]
    if status not in ("OPTIMAL", "FEASIBLE"):  # no solution in time: the hint stands
        status = "FEASIBLE"
    return replace(best, planner="ilp", status=status, bound=solution.get("bound"), extra=extra)


def solve(graph: nx.DiGraph, cluster: Cluster, *, options: ModelOptions, memory: float | None,
          time_limit: float, hint: Plan | None = None) -> dict[str, Any]:
    """Build and solve the model. Returns {"status", "bound" (seconds, lower bound on the slowest
    stage), "stages" ([(nodes, ranks)] or None), "slack" (seconds the coefficients' rounding can
    move the optimum)}."""
    from ortools.sat.python import cp_model

    built = time.perf_counter()
    order = topological_order(graph)
    nodes = list(order)
    workers = cluster.workers
    pinned = list(input_nodes(graph))
    stages = min(workers, len(nodes) - len(pinned))
    edges = [(u, v, edge_bytes(graph, u, v)) for u, v in graph.edges]
    comp = {v: 0.0 if v in pinned else float(graph.nodes[v]["fwd"]) + float(graph.nodes[v]["bwd"])
            for v in nodes}
    bwd = {v: 0.0 if v in pinned else float(graph.nodes[v]["bwd"]) for v in nodes}
    par = {v: float(graph.nodes[v]["params"]) for v in nodes}
    keep = {v: float(graph.nodes[v].get("keep", graph.nodes[v]["act"])) for v in nodes}
    coef = {(a, k): placement(cluster, a, k, workers)
            for a in range(workers) for k in range(1, workers - a + 1)
            if _allowed(k, options)}
    terms = {key: _linear_terms(c, workers - key[0], options) for key, c in coef.items()}
    ties = tie_readers(graph)
    most_copied = sum(tie.nbytes * len(tie.others) for tie in ties)  # by any plan
    # scale: the slowest conceivable stage maps to SCALE_UNITS
    worst = sum(comp.values()) * max(x.per_compute for x in terms.values()) \
        + max(x.per_param for x in terms.values()) * (sum(par.values()) + most_copied) \
        + max(x.fixed for x in terms.values()) \
        + sum(b for *_, b in edges) * 2 * max(max(c.in_per_byte, c.out_per_byte)
                                              for c in coef.values()) \
        + len(edges) * 2 * max(max(c.in_per_msg, c.out_per_msg) for c in coef.values()) \
        + sum(b for *_, b in edges) * 2 * max(max(c.copy_in_per_byte, c.copy_out_per_byte)
                                              for c in coef.values()) * options.microbatches
    scale = SCALE_UNITS / worst if worst > 0 else 1.0
    if not math.isfinite(scale):  # the largest cost below 1e-300 s (5e-324 gave inf,
        # and round(inf) failed): every plan costs nothing worth telling apart
        scale = 1.0

    model = cp_model.CpModel()
    # x[v, s]: node v runs in stage s
    x = {(v, s): model.new_bool_var(f"x[{v},{s}]") for v in nodes for s in range(stages)}
    # used[s]: stage s has at least one node (stages are used from 0 up)
    used = [model.new_bool_var(f"used[{s}]") for s in range(stages)]
    # z[s, a, k]: stage s runs on ranks [a, a + k)
    z = {(s, a, k): model.new_bool_var(f"z[{s},{a},{k}]")
         for s in range(stages) for (a, k) in coef}
    # t: the slowest stage, in integer units
    t = model.new_int_var(0, int(SCALE_UNITS * 2) + 1, "t")

    for v in nodes:  # each node in exactly one stage
        model.add_exactly_one(x[v, s] for s in range(stages))
    for v in pinned:  # inputs on the first stage
        model.add(x[v, 0] == 1)
    for s in range(stages):  # a stage is used iff it has nodes; used stages come first
        for v in nodes:
            model.add_implication(x[v, s], used[s])
        model.add(sum(x[v, s] for v in nodes if v not in pinned) >= 1).only_enforce_if(used[s])
        model.add(sum(x[v, s] for v in nodes) == 0).only_enforce_if(~used[s])
        if s + 1 < stages:
            model.add_implication(used[s + 1], used[s])
    model.add(used[0] == 1)
    stage_index = {v: sum(s * x[v, s] for s in range(1, stages)) for v in nodes}
    for u, v, _ in edges:  # convex stages: edges never go backwards
        model.add(stage_index[u] <= stage_index[v])
    # placement: a used stage has one position; positions are consecutive; all workers used
    start = [model.new_int_var(0, workers - 1, f"start[{s}]") for s in range(stages)]
    reps = [model.new_int_var(0, workers, f"replicas[{s}]") for s in range(stages)]
    for s in range(stages):
        model.add(sum(z[s, a, k] for (a, k) in coef) == used[s])
        model.add(start[s] == sum(a * z[s, a, k] for (a, k) in coef))
        model.add(reps[s] == sum(k * z[s, a, k] for (a, k) in coef))
        if s + 1 < stages:
            model.add(start[s + 1] == start[s] + reps[s]).only_enforce_if(used[s + 1])
    model.add(start[0] == 0)
    model.add(sum(reps) == workers)
    # held[t, s]: stage s keeps a copy of tie t, that is holds one of its readers but not the
    # one whose params count its bytes (cost/ties.py `copied_bytes`, the DP's `tie_copies`);
    # the copy counts in the stage's parameters as the node's own do. own[s]: the stage's
    # parameter terms, (variable, bytes) pairs
    held = {(i, s): model.new_bool_var(f"held[{i},{s}]")
            for i in range(len(ties)) for s in range(stages)}
    for (i, s), var in held.items():
        tie = ties[i]
        for r in tie.others:
            model.add(var >= x[r, s] - x[tie.owner, s])
        model.add(var <= 1 - x[tie.owner, s])
        model.add(var <= sum(x[r, s] for r in tie.others))
    own = [[(x[v, s], par[v]) for v in nodes]
           + [(held[i, s], tie.nbytes) for i, tie in enumerate(ties)] for s in range(stages)]
    if not kind(options.schedule).flush:
        # reads[t, s]: stage s holds a reader of tie t. Outside a flush a replica updates once
        # per round of its stage's replicas, so stages sharing a tie need equal replica counts
        # or its all-reduce loses its partner (cost/ties.py `updates_apart`)
        for i, tie in enumerate(ties):
            reads = [model.new_bool_var(f"reads[{i},{s}]") for s in range(stages)]
            for s in range(stages):
                for r in (tie.owner, *tie.others):
                    model.add_implication(x[r, s], reads[s])
            for s in range(stages):
                for q in range(s + 1, stages):
                    model.add(reps[s] == reps[q]).only_enforce_if([reads[s], reads[q]])
    # last[s]: min(the stage's parameter bytes, one gradient bucket), in BUCKET_UNITS of the
    # bucket: the all-reduce of the last bucket, left after the backward (`_overlap`)
    bucket = cluster.allreduce_bucket
    last: list[Any] = []
    if bucket is not None:
        bucket_unit = bucket / BUCKET_UNITS
        for s in range(stages):
            last.append(model.new_int_var(0, BUCKET_UNITS, f"last_bucket[{s}]"))
            model.add_min_equality(last[s], [sum(round(b / bucket_unit) * var
                                                 for var, b in own[s]), BUCKET_UNITS])
    # e_in[e, s] / e_out[e, s]: edge e enters / leaves stage s (>= is enough: minimising)
    before = {(v, s): sum(x[v, q] for q in range(s)) for v in nodes for s in range(stages)}
    after = {(v, s): sum(x[v, q] for q in range(s + 1, stages)) for v in nodes
             for s in range(stages)}
    e_in: dict[tuple[int, int], Any] = {}
    e_out: dict[tuple[int, int], Any] = {}
    for i, (u, v, _) in enumerate(edges):
        for s in range(stages):
            if s > 0:
                e_in[i, s] = model.new_bool_var(f"in[{i},{s}]")
                model.add(e_in[i, s] >= x[v, s] + before[u, s] - 1)
            if s + 1 < stages:
                e_out[i, s] = model.new_bool_var(f"out[{i},{s}]")
                model.add(e_out[i, s] >= x[u, s] + after[v, s] - 1)
    mem_limit = math.inf if memory is None else memory
    for s in range(stages):
        if time.perf_counter() - built > WALL_GUARD * time_limit:  # too big to build
            return {"status": "MODEL_TOO_BIG", "bound": None, "stages": None}
        for (a, k), c in coef.items():
            zz = z[s, a, k]
            lin = terms[a, k]
            work = [(x[v, s], round(scale * comp[v] * lin.per_compute)) for v in nodes] \
                + [(var, round(scale * b * lin.per_param)) for var, b in own[s]]
            tail: list[tuple[Any, int]] = []
            if bucket is not None and c.sync_per_byte > 0:  # the all-reduce overlaps the
                # backward: the whole all-reduce less the backward, or the last bucket's
                sync = lin.per_sync * c.sync_per_byte
                tail = [(x[v, s], round(scale * comp[v] * lin.per_compute)) for v in nodes] \
                    + [(var, round(scale * b * (lin.per_param - sync))) for var, b in own[s]]
                tail.append((last[s], round(scale * sync * bucket_unit)))
                behind = scale * lin.per_sync / options.per_minibatch
                work += [(x[v, s], -round(behind * bwd[v])) for v in nodes if bwd[v]]
            comm = []
            copies = []
            # on the busiest server interface: its share of the stage's bytes and the rings
            # of its all-reduces (`costmodel.stage_parts`)
            ring = [(var, round(scale * b * c.nic_ring_per_byte * lin.per_sync))
                    for var, b in own[s] if b and c.nic_ring_per_byte]
            shared_in, shared_out = list(ring), list(ring)
            for i, (_, _, b) in enumerate(edges):
                if (i, s) in e_in and c.in_nic_per_byte:
                    shared_in.append((e_in[i, s], round(scale * b * c.in_nic_per_byte)))
                if (i, s) in e_out and c.out_nic_per_byte:
                    shared_out.append((e_out[i, s], round(scale * b * c.out_nic_per_byte)))
                if (i, s) in e_in:
                    comm.append((e_in[i, s], round(scale * (b * c.in_per_byte + c.in_per_msg)
                                                   / k)))
                    if c.copy_in_per_byte:  # sent back by this stage's CPU (loopback)
                        copies.append((e_in[i, s], round(scale * b * c.copy_in_per_byte
                                                         * lin.per_copy)))
                if (i, s) in e_out:
                    comm.append((e_out[i, s],
                                   round(scale * (b * c.out_per_byte + c.out_per_msg) / k)))
                    if c.copy_out_per_byte:
                        copies.append((e_out[i, s], round(scale * b * c.copy_out_per_byte
                                                          * lin.per_copy)))
            for branch in (work, tail) if tail else (work,):
                model.add(sum(w * var for var, w in branch + copies) + round(scale * lin.fixed)
                          <= t).only_enforce_if(zz)
            for links in (comm, shared_in, shared_out):
                if links:
                    model.add(sum(w * var for var, w in links) <= t).only_enforce_if(zz)
            if math.isfinite(mem_limit):
                per_byte = lin.versions + 1.0 + options.optimizer_state
                per_var = [(x[v, s], par[v] * per_byte
                            + keep[v] * lin.in_flight / options.per_minibatch) for v in nodes] \
                    + [(held[i, s], tie.nbytes * per_byte) for i, tie in enumerate(ties)]
                if sum(bytes_ for _, bytes_ in per_var) > mem_limit:
                    # memory in millionths of the limit, rounded up (a stage within a millionth
                    # per node of the limit may be refused): with billionths, CP-SAT's presolve
                    # (OR-Tools 9.15) returned OPTIMAL for a plan 33% slower than the optimum
                    unit = mem_limit / MEMORY_UNITS
                    model.add(sum(math.ceil(bytes_ / unit) * var for var, bytes_ in per_var
                                  if bytes_) <= MEMORY_UNITS).only_enforce_if(zz)
    # a valid cut that tightens the bound: the workers share all the compute, so the slowest
    # stage takes at least total compute x the least compute share of a worker (k replicas'
    # per_compute x k: 1 unflushed, (ceil(m / k) - 1) k / m under a flush, whose fill and drain
    # the model leaves to the DP) / workers, less a margin for the coefficients' rounding
    least = min(key[1] * x.per_compute for key, x in terms.items())
    model.add(t >= math.floor(scale * sum(comp.values()) * least / workers) - len(nodes) - 1)
    model.minimize(t)
    # symmetry is broken by the ordering of stages; hint the DP's plan
    if hint is not None:
        _add_hint(model, hint, x, used, z, nodes, stages, coef)
    solver = cp_model.CpSolver()
    # bounded by deterministic time, on one worker with a fixed seed, so that the same inputs
    # give the same plan on an idle machine or a loaded one; the wall-clock limit is only a
    # guard against a machine far slower than CP-SAT's deterministic clock assumes
    solver.parameters.max_deterministic_time = max(0.05, time_limit)
    solver.parameters.max_time_in_seconds = WALL_GUARD * max(0.05, time_limit) + 10.0
    solver.parameters.num_workers = ILP_WORKERS
    solver.parameters.random_seed = ILP_SEED
    code = solver.solve(model)
    status = solver.status_name(code)
    # the rounding of coefficients can move the optimum by up to one unit per term
    slack = (len(nodes) + len(ties) + 2 * len(edges) + 1) / scale
    if bucket is not None:  # each node's parameters in units of the bucket, and the
        # coefficient of a stage's bucket units (up to half a time unit per bucket unit)
        slack += (len(nodes) + len(ties)) * bucket / BUCKET_UNITS * max(
            terms[key].per_sync * c.sync_per_byte for key, c in coef.items()) \
            + BUCKET_UNITS / 2 / scale
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound_so_far = None
        if code == cp_model.UNKNOWN and math.isfinite(solver.best_objective_bound):
            bound_so_far = max(0.0, solver.best_objective_bound / scale - slack)
        return {"status": status, "bound": bound_so_far, "stages": None, "slack": slack}
    bound = solver.best_objective_bound / scale
    result = []
    for s in range(stages):
        if not solver.value(used[s]):
            continue
        members = [v for v in nodes if solver.value(x[v, s])]
        ranks = tuple(range(solver.value(start[s]), solver.value(start[s]) + solver.value(reps[s])))
        result.append((members, ranks))
    return {"status": status, "bound": max(0.0, bound - slack), "stages": result, "slack": slack}


@dataclass(frozen=True)
class _Linear:
    """A stage's work per minibatch at one position, linear in its nodes' compute and params
    (costmodel.stage_values without the round trip: CP-SAT plans with the schedule's default
    in-flight count)."""

    per_compute: float
    per_param: float
    per_copy: float  # on loopback bytes per minibatch
    fixed: float
    versions: int
    in_flight: int
    per_sync: float  # all-reduces per minibatch per replica in the work (per_param's share)


def _allowed(replicas: int, options: ModelOptions) -> bool:
    """Replica counts the schedule can feed (as stage_values)."""
    row = kind(options.schedule)
    if not row.microbatched:
        return True
    m = options.per_minibatch
    return replicas <= m and (row.flush or m % replicas == 0)


def _linear_terms(c: Placement, workers_from_here: int, options: ModelOptions) -> _Linear:
    row = kind(options.schedule)
    m = options.per_minibatch
    k = c.replicas
    flight = default_in_flight(k, workers_from_here, options)
    copies = row.copies_weights and flight > 1
    versions = weight_versions(options.schedule, flight, copies=copies)
    if row.flush:  # the microbatches it adds to fill and drain, then its all-reduce and step
        # (not the fill and drain through it, which the DP's objective adds: CP-SAT starts from
        # the DP's plan, and every plan is priced by the closed form and simulated)
        share = math.ceil(m / k)
        return _Linear((share - 1) / m, c.sync_per_byte + c.step_per_byte, (share - 1) / m,
                       c.sync_fixed, versions, flight, 1.0)
    copy = c.copy_per_byte if copies else 0.0
    per = update_share(options.schedule, m, k) * m / k  # updates per minibatch per replica
    return _Linear(1.0 / k, (c.sync_per_byte + c.step_per_byte + copy) * per,
                   1.0 / k, c.sync_fixed * per, versions, flight, per)


def ilp_objective(graph: nx.DiGraph, stages: list[tuple[list[str], tuple[int, ...]]],
                  cluster: Cluster, *, options: ModelOptions, memory: float | None) -> float:
    """The objective the CP-SAT model minimises, for a plan given as (nodes, ranks) per stage:
    the slowest stage's work (`_linear_terms`) or its links (every edge crossing its boundary),
    inf where a stage does not fit `memory` with the schedule's default in-flight count.

    Where the cluster's replicas all-reduce in buckets during the backward
    (`Cluster.allreduce_bucket`), a stage's all-reduce counts as the larger of two linear
    forms of `cost.links.exposed_allreduce_seconds`: the whole all-reduce less the stage's
    backward, and the all-reduce of min(its parameters, one bucket). The exact form,
    max(A / n, A - (1 - 1/n) backward), is not linear in the stage's nodes (n = params / bucket);
    the linear forms leave out the backward's last-bucket share and charge the ring's latencies
    whole, so this objective can sit below the DP's by up to backward / n. Plans are priced
    exactly afterwards. A stage's parameters count the copies of the ties it holds
    (cost/ties.py `copied_bytes`), as the model's do."""
    stage_of = {v: i for i, (nodes, _) in enumerate(stages) for v in nodes}
    pinned = set(input_nodes(graph))
    workers = cluster.workers
    copied = copied_bytes(graph, stage_of, len(stages))  # a tie's copies on its later holders
    worst = 0.0
    for i, (nodes, ranks) in enumerate(stages):
        k = len(ranks)
        c = placement(cluster, ranks[0], k, workers)
        lin = _linear_terms(c, workers - ranks[0], options)
        params = copied[i]
        work = lin.fixed + params * lin.per_param
        comm = 0.0
        mem = params * (lin.versions + 1.0 + options.optimizer_state)
        backward = 0.0
        for v in nodes:
            d = graph.nodes[v]
            comp = 0.0 if v in pinned else float(d["fwd"]) + float(d["bwd"])
            backward += 0.0 if v in pinned else float(d["bwd"])
            params += float(d["params"])
            work += comp * lin.per_compute + float(d["params"]) * lin.per_param
            mem += float(d["params"]) * (lin.versions + 1.0 + options.optimizer_state) \
                + float(d.get("keep", d["act"])) * lin.in_flight / options.per_minibatch
        shared_in = shared_out = params * c.nic_ring_per_byte * lin.per_sync
        for u, v in graph.edges:
            b = edge_bytes(graph, u, v)
            if stage_of[v] == i and stage_of[u] < i:
                comm += (b * c.in_per_byte + c.in_per_msg) / k
                work += b * c.copy_in_per_byte * lin.per_copy
                shared_in += b * c.in_nic_per_byte
            if stage_of[u] == i and stage_of[v] > i:
                comm += (b * c.out_per_byte + c.out_per_msg) / k
                work += b * c.copy_out_per_byte * lin.per_copy
                shared_out += b * c.out_nic_per_byte
        if memory is not None and mem > memory * (1 + 1e-12):
            return math.inf
        bucket = cluster.allreduce_bucket
        if bucket is not None and c.sync_per_byte > 0:  # two linear forms (docstring)
            sync = lin.per_sync * c.sync_per_byte
            work = max(work - lin.per_sync * backward / options.per_minibatch,
                       work - sync * (params - min(params, bucket)))
        worst = max(worst, work, comm, shared_in, shared_out)
    return worst


def _coarse_hint(hint: Plan, mapping: dict[str, list[str]]) -> Plan:
    """The hint with each block in the stage of its first member."""
    stage_of = hint.stage_of()
    stages = []
    for i, stage in enumerate(hint.stages):
        blocks = tuple(b for b, members in mapping.items() if stage_of.get(members[0]) == i)
        stages.append(replace(stage, nodes=blocks))
    return replace(hint, stages=tuple(stages))


def _add_hint(model: Any, hint: Plan, x: dict[Any, Any], used: list[Any], z: dict[Any, Any],
              nodes: list[str], stages: int, coef: dict[Any, Any]) -> None:
    if len(hint.stages) > stages:
        return
    stage_of = hint.stage_of()
    for v in nodes:
        for s in range(stages):
            model.add_hint(x[v, s], stage_of.get(v) == s)
    for s in range(stages):
        model.add_hint(used[s], s < len(hint.stages))
        for (a, k) in coef:
            on = s < len(hint.stages) and hint.stages[s].ranks[0] == a \
                and hint.stages[s].replicas == k
            model.add_hint(z[s, a, k], on)
