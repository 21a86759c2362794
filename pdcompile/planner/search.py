"""`plan` and `price_plan`: choose stages, replicas and ranks for a CostGraph on a Cluster.

`plan` validates the input and, for every schedule (and microbatch count) it tries, gathers
candidates: the DP's plans over antichain states (dp_search.py, dp.py), interleaved placements
of its straight cuts (interleave.py) and, on small graphs, the exact CP-SAT model's (ilp.py). Each
is priced with the one cost model (costmodel.py), its in-flight counts and recomputation chosen
within the memory (in_flight.py); the best few by the closed form are simulated (simulation.py)
and the fastest in simulation is the plan. `price_plan` prices a plan made by hand the same way.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from pdcompile.cost.costgraph import topological_order, validate
from pdcompile.cost.crossing import input_nodes
from pdcompile.cost.flush_path import FlushOrders
from pdcompile.cost.memory import OPTIMIZER_STATE
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import shared_weights, updates_apart
from pdcompile.errors import PlanError, ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner.costmodel import (
    ModelOptions,
    closed_form_floor,
    data_parallel_options,
    data_parallel_stage,
    data_parallel_time,
    default_in_flight,
    evaluate,
    evaluate_timed,
    plan_costs,
    priced_time,
)
from pdcompile.planner.dp_search import (
    MOST_STAGES,
    Prepared,
    coarse_with_pinned,
    expand,
    pinned_inputs,
    pipedream_budget,
    planning_graph,
    prepare,
    solve,
)
from pdcompile.planner.in_flight import choose_in_flight, choose_recompute, rank_memory
from pdcompile.planner.memory_floor import SLACK, least_memory, node_floor
from pdcompile.planner.search_cache import SearchCache
from pdcompile.planner.simulation import simulate_steady, steady_minibatches
from pdcompile.schedule.kinds import KINDS, kind, replicas_refused, unknown
from pdcompile.schedule.placement import chunk_placement
from pdcompile.units import format_bytes, parse_quantity

PLANNERS = ("auto", "dp", "ilp")
ILP_AUTO_NODES = 60  # "auto" runs CP-SAT after the DP on graphs this small (after coarsening)
# ... and clusters of at most EXACT_WORKERS workers (its model grows with workers squared)
ILP_DEFAULT_LIMIT = 10.0  # seconds, for planner="ilp"
ILP_AUTO_LIMIT = 2.0  # seconds, for planner="auto" on small graphs (CP-SAT mostly certifies)
AUTO_MICROBATCHES = (8, 32)  # what schedule="auto" tries for microbatched schedules
# what schedule="auto" tries: GPipe and interleaved 1F1B are left out, as the same plans run
# at least as fast with 1F1B-flush (GPipe's bubble, less memory) and interleaved zero bubble
AUTO_SCHEDULES = ("1f1b", "1f1b-flush", "2bw", "zb-h1", "interleaved-zb", "zb-v", "dualpipev")
VARIANT_STAGES = (2,)  # the DP's short-pipeline variants (at most this many stages)
GROUPS_FROM = 1.5  # a flat cluster wider than EXACT_WORKERS whose best plan is this many times
# its compute spread over every worker is also planned in groups (`_replica_groups`)
EXACT_WORKERS = 16  # above this, multi-level clusters get one server's pipeline on every server
ACROSS_SERVERS = 32  # ... or, up to this many servers, stages of whole servers
STRAIGHT_WORKERS = 64  # ... or, up to this many workers, a straight pipeline over all of them
SIMULATED_CANDIDATES = 4  # the best candidates by the closed form that the simulator ranks
SIMULATED_WITHIN = 1.5  # ... among those at most this much slower than the best in closed form
SIMULATION_BUDGET = 100_000  # actions and all-reduce waits per simulation; above: closed form
PLANNED_ON_FEWER = "on the first"  # how a candidate the planner made on fewer workers begins
# the most workers a cluster may have to be planned or priced: the planner holds every rank of
# a plan (a stage replicated on all of them), so its time and memory grow with the workers;
# at 10^6 a plan takes about 20 s and 300 MB on one core (10^7: minutes and gigabytes, 10^12
# MemoryError)
MOST_WORKERS = 1_000_000
# the most workers a mixed cluster may have to be planned: the mixed planner's DP across device
# groups grows faster than the workers squared (VGG-16 over a100*N/2,v100*N/2 on the 2-core VM,
# loaded: N=64 17 s, N=128 20 s in all; N=256: one of its two group orders ran over 4 minutes);
# pricing a plan on a larger one is not refused
MOST_MIXED_WORKERS = 128
POLISH_FROM = 8  # the best candidates per schedule that closed-form descents start from ...
POLISH_BUDGET = 2400  # ... pricing at most this many plans in all (planner/polish.py) ...
POLISH_STREAMING = 300  # ... or this many for a streaming schedule (each a circuit search)
# ... from a plan of at most this many stages; from a deeper one, fewer by the cube of the
# ratio: a streaming price's circuit search grows about so with the stages (a 1,500-node DAG
# on 8x6@1e10,1.25e9: 0.015 s at 3 stages, 0.10 s at 24, 0.76 s at 48), and 300 prices of
# 48-stage plans made a 5,000-node DAG's plan take 740 s of CPU
POLISH_STREAMING_STAGES = 16
# ... and, under a flush schedule, from those of its POLISH_FROM best that the closed form
# prices this much above the DP's own objective for them (the objective misjudged them)
POLISH_DISAGREEMENT = 0.10
REPAIRED_CANDIDATES = 4  # the refused candidates per schedule option whose tied stages are
# set to equal replicas and priced again (planner/tie_repair.py)


def plan(cost_graph: nx.DiGraph, cluster: Cluster | str, *, planner: str = "auto",
         cost_model: str = "native", straight: bool = False, memory: float | str | None = None,
         time_limit: float | None = None, schedule: str = "1f1b",
         microbatches: int | None = None, stages: int | None = None,
         simulate: bool | None = None, optimizer_state: float = OPTIMIZER_STATE,
         symmetric: bool | None = None, cache: SearchCache | None = None) -> Plan:
    """Partition `cost_graph` over `cluster` and return the Plan (see pdcompile.plan.Plan).

    planner: "dp" (PipeDream's dynamic program), "ilp" (DP, then the exact CP-SAT model warm-started
    from it), "auto" (CP-SAT only when the graph is small). cost_model: "native" or "pipedream"
    (the original optimizer's model; it applies a memory constraint only when `memory` is given,
    as the original does with --use_memory_constraint). memory: bytes per worker (or "16GiB"),
    default the cluster device's memory. time_limit: seconds for CP-SAT (default 10).

    schedule: one of schedule.kinds, or "auto" to choose among them (and their microbatches).
    microbatches: per minibatch for the microbatched schedules (None: the planner chooses among
    AUTO_MICROBATCHES; '1f1b' runs whole minibatches). stages: exactly that many straight stages
    (one worker each, on the first `stages` ranks), balanced by cost; with an interleaved or
    V-shaped schedule, that many workers holding two chunks each. simulate: rank the best
    candidates with the simulator and predict its steady state (None: where a simulation is
    cheap, SIMULATION_BUDGET). optimizer_state: optimizer bytes per parameter byte (Adam 2,
    SGD with momentum 1) for memory. symmetric: plan one server's pipeline and give every server
    the same (None: on multi-level clusters of more than EXACT_WORKERS workers). cache: the
    schedules and prices of the search this call is part of (planner/search_cache.py; None:
    a new one for this call).

    A mixed cluster (device groups of several kinds, `Cluster.groups`) is planned by
    planner/mixed.py: each rank at its device's speed, within its device's memory (`memory`
    then caps every device's).
    """
    started = time.perf_counter()
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r}; use one of {', '.join(PLANNERS)}")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be a pdcompile.Cluster or a cluster string, not "
                        f"{type(cluster).__name__}")
    check_plannable(cluster)
    if isinstance(cost_graph, (str, os.PathLike)):
        raise PlanError(f"plan takes a cost graph, not the {type(cost_graph).__name__} "
                        f"{str(cost_graph)!r}: for a PipeDream profile (a shipped name such as "
                        f"'vgg16', or a graph.txt) pass "
                        f"pdcompile.profiles.load_pipedream({str(cost_graph)!r}); for a model, "
                        "pdcompile.compile(model, ...) plans it")
    validate(cost_graph)
    limit = _memory(memory, cluster, cost_model)
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(
            time_limit, int | float) or not time_limit > 0):
        raise PlanError(f"time_limit must be a number of seconds > 0 (got {time_limit!r})")
    choices = _schedule_choices(schedule, microbatches, cost_model, cost_graph)
    if stages is not None:
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise PlanError(f"stages must be a positive integer (got {stages!r})")
        if stages > cluster.workers:
            raise PlanError(f"stages={stages} needs {stages} workers; the cluster has "
                            f"{cluster.workers} ({cluster.describe()})")
        if stages > MOST_STAGES:
            raise PlanError(f"stages={stages}: the planner balances at most {MOST_STAGES} "
                            "straight stages (its DP grows with the cube of their number); "
                            f"pass stages={MOST_STAGES} or fewer, or none to let it choose")
        # a stage holds at least one operation; inputs (sources that compute nothing) go along
        operations = sum(1 for n, d in cost_graph.nodes(data=True)
                         if cost_graph.in_degree(n) or d["fwd"] or d["bwd"])
        chunks = stages * (2 if all(kind(name).interleaved for name, _ in choices) else 1)
        if chunks > operations:
            what = f"{chunks} chunks ({stages} workers with two each)" if chunks > stages \
                else f"{stages} stages"
            raise PlanError(f"stages={stages}: the graph has {operations} operations, too few "
                            f"for {what}; use at most {operations // (chunks // stages)}")
        straight = True
    if planner == "ilp" and (straight or cost_model != "native"):
        raise PlanError("the CP-SAT planner handles the native cost model without --straight; "
                        "use planner='dp' for cost_model='pipedream' or straight pipelines")
    cache = cache if cache is not None else SearchCache()
    if cluster.is_mixed:
        return _plan_mixed(cost_graph, cluster, choices, planner=planner, cost_model=cost_model,
                           straight=straight, memory=memory, time_limit=time_limit,
                           schedule=schedule, microbatches=microbatches, stages=stages,
                           simulate=simulate, optimizer_state=optimizer_state,
                           started=started, cache=cache)
    if cost_model == "pipedream":
        options = ModelOptions(cost_model=cost_model, schedule=choices[0][0],
                               microbatches=choices[0][1], optimizer_state=optimizer_state)
        result = _pipedream_plan(cost_graph, cluster, options, limit, straight)
        return replace(result, solve_seconds=time.perf_counter() - started)

    workers = stages or cluster.workers
    if limit is not None and min(
            node_floor(cost_graph, ModelOptions(schedule=name, microbatches=m,
                                                optimizer_state=optimizer_state)).on(workers)
            for name, m in choices) > limit * (1 + SLACK):
        # no plan on these workers (or fewer) fits under any schedule: refused without the
        # search, whose DPs would all fail (a 1,546-node DAG on 6 servers of 8: 16 s of them)
        refusal = _schedule_refusal(choices, workers)
        if refusal is not None:
            raise PlanError(refusal)
        options = ModelOptions(schedule=choices[0][0], microbatches=choices[0][1],
                               optimizer_state=optimizer_state)
        raise _no_fit(cost_graph, cluster, options, limit, straight)
    candidates: list[_Candidate] = []
    fewer_plans: list[_FewerPlan] = []
    kinds_seen = []
    if symmetric is None:
        symmetric = (stages is None and not straight and len(cluster.levels) > 1
                     and workers > EXACT_WORKERS)
    elif symmetric and (stages is not None or straight or len(cluster.levels) < 2):
        raise PlanError("symmetric=True plans one server's pipeline for every server: it needs "
                        "a cluster of several servers and neither stages= nor straight")
    for name, m in choices:
        options = ModelOptions(schedule=name, microbatches=m, optimizer_state=optimizer_state)
        row = kind(name)
        try:
            if row.interleaved:
                if symmetric:
                    continue  # interleaving is planned on one level of unreplicated chunks
                # stages=K: K workers (the first K ranks), each holding the schedule's chunks
                found = _interleaved_candidates(cost_graph, cluster, options, limit, workers)
            elif symmetric and not row.split_backward:  # both ways to use servers alike
                try:
                    found = _dp_candidates(cost_graph, cluster, options, limit, straight,
                                           workers, fill=False, layout="per server", cache=cache)
                except PlanError:  # no pipeline fits within one server: the others below,
                    found = _Found("servers alike", [])  # then every worker on its own
                alike = len(found.candidates)
                # a straight pipeline over every worker (its DP has one replica count)
                if workers <= STRAIGHT_WORKERS:
                    try:
                        line = _dp_candidates(cost_graph, cluster, options, limit, True,
                                              workers, fill=False, cache=cache)
                        found.candidates += line.candidates
                    except PlanError:
                        pass
                # whole servers per stage too, where a DP over the servers stays small
                if cluster.levels[-1].workers <= ACROSS_SERVERS:
                    try:
                        across = _dp_candidates(cost_graph, cluster, options, limit, straight,
                                                workers, fill=False, layout="across servers",
                                                cache=cache)
                        alike += len(across.candidates)
                        found.candidates += across.candidates
                    except PlanError:
                        pass
                if not alike and len(cluster.levels) == 2:
                    # no replicated plan keeps every server alike (within the memory): one
                    # pipeline per group of servers, every group alike, its stages spanning
                    # servers within the group and replicated across the groups (a tied LM in
                    # 10 GB on 8 servers of 4: 917 ms from the DP over every worker below,
                    # 470 ms in groups of 4 servers). Not tried where servers alike fit:
                    # GPT-2 XL on 16 x 8 H100 (4 times its compute floor) planned 1.5-2 s
                    # longer for the same plan
                    for servers in _server_groups(cluster):
                        try:
                            grouped = _dp_candidates(cost_graph, cluster, options, limit,
                                                     straight, workers, fill=False,
                                                     layout="per server", group=servers,
                                                     cache=cache)
                            alike += len(grouped.candidates)
                            found.candidates += grouped.candidates
                        except PlanError:
                            pass
                if not alike:  # no replicated plan keeps the servers or their groups
                    # alike (within the memory): every worker on its own, where a stage's
                    # replicas need not span the servers alike (a tied LM in 10 GB on 8
                    # servers of 4, before groups were tried: none but the straight
                    # pipeline, 646 ms, and without it no plan at all)
                    try:
                        found.candidates += _dp_candidates(cost_graph, cluster, options, limit,
                                                           straight, workers,
                                                           fill=False, cache=cache).candidates
                    except PlanError:
                        pass
            else:  # zero-bubble schedules run every stage on one worker
                found = _dp_candidates(cost_graph, cluster, options, limit,
                                       straight or row.split_backward, workers,
                                       fill=stages is not None, cache=cache)
                best = min((c.closed for c in found.candidates), default=math.inf)
                if stages is None and not straight and not row.split_backward \
                        and len(cluster.levels) == 1 and not cluster.is_mixed \
                        and workers > EXACT_WORKERS \
                        and best > GROUPS_FROM * _work_bound(cost_graph, workers):
                    for group, line in _replica_groups(workers):
                        try:
                            found.candidates += _dp_candidates(
                                cost_graph, cluster, options, limit, line, workers,
                                fill=line, layout="per server", group=group, cache=cache).candidates
                        except PlanError:
                            pass
        except PlanError:
            continue
        kinds_seen.append(found.kind)
        candidates += found.candidates
        fewer_plans += found.fewer
    candidates += _priced_fewer(cost_graph, cluster, fewer_plans, candidates, limit)
    if not straight:  # its moves merge, split and replicate stages
        candidates += _polished(cost_graph, cluster, candidates, limit)
    ilp_found: list[_Candidate] = []
    best_row = kind(min(candidates, key=lambda c: c.closed).options.schedule) if candidates \
        else None
    if planner != "dp" and not straight and best_row is not None \
            and not (best_row.split_backward or best_row.interleaved) \
            and (planner == "ilp" or (not symmetric and workers <= EXACT_WORKERS)):
        ilp_found = _ilp_candidate(cost_graph, cluster, planner, limit, time_limit,
                                   min(candidates, key=lambda c: c.closed))
        candidates += ilp_found
    candidates += _tie_repaired(cost_graph, cluster, candidates, limit, workers)
    if candidates and all(_ties_update_apart(cost_graph, c) for c in candidates):
        # every plan found puts a tie on unequal replicas, which a streaming schedule cannot
        # run: one worker per stage (on as many workers as fit) keeps its stages' updates equal
        best = min(candidates, key=lambda c: c.closed)
        try:
            candidates += _dp_candidates(cost_graph, cluster, best.options, limit, True, workers,
                                         fill=False, cache=cache).candidates
        except PlanError:
            pass
    if stages is None and workers > 1:  # the whole model on one worker, or on fewer
        # the smaller clusters without CP-SAT under "auto" (its DP's plan is the candidate;
        # CP-SAT's 2 s per schedule were most of what the half added on 16 workers)
        sub_planner = "dp" if planner == "auto" else planner

        def again(sub: Cluster) -> Plan | PlanError:
            """The plan on `sub`, made once per search: the plans on every smaller count
            plan the same smaller counts again."""
            def make() -> Plan | PlanError:
                try:
                    return plan(cost_graph, sub, planner=sub_planner, straight=straight,
                                memory=limit, time_limit=time_limit, schedule=schedule,
                                microbatches=microbatches, simulate=simulate,
                                optimizer_state=optimizer_state, cache=cache)
                except PlanError as err:
                    return err
            key = ("plan on fewer workers", id(cost_graph), sub, sub_planner, straight,
                   limit, time_limit, schedule, microbatches, simulate, optimizer_state)
            return cache.made(key, cost_graph, make)

        candidates += _on_fewer_workers(cost_graph, cluster, choices, candidates, limit,
                                        optimizer_state, again)
    if not candidates:
        refusal = _schedule_refusal(choices, workers)
        if refusal is not None:  # not the memory: the schedule cannot run on these workers
            raise PlanError(refusal)
        options = ModelOptions(schedule=choices[0][0], microbatches=choices[0][1],
                               optimizer_state=optimizer_state)
        raise _no_fit(cost_graph, cluster, options, limit, straight)
    chosen, simulated = _choose(cost_graph, cluster, candidates, simulate, cache)
    if _ties_update_apart(cost_graph, chosen):  # every candidate would: none can run
        raise PlanError(
            f"no {chosen.options.schedule!r} plan of {cost_graph.graph.get('name') or 'the model'} "
            f"on {workers} workers keeps the stages sharing a tied parameter on equal replicas "
            f"within the memory (the best found, {chosen.describe()}, would update them a "
            "different number of times, which the runtime refuses); use a flush schedule "
            "(schedule='1f1b-flush'), more memory per worker, or other workers")
    options = chosen.options
    everything = [data_parallel_stage(cost_graph, cluster, workers)]
    dp_options = data_parallel_options(options, cluster, workers)
    dp_priced, dp_time = evaluate(cost_graph, everything, cluster, options=dp_options)
    extra: dict[str, Any] = {
        "states": kinds_seen[0] if kinds_seen else "", "memory_limit": limit,
        "dp_fits": limit is None or dp_priced[0].memory <= limit,
        "closed_form_time_per_minibatch": chosen.closed, "bound": chosen.bound,
        "candidates": [c.describe() for c in sorted(candidates, key=lambda c: c.closed)[:8]],
    }
    if simulated is not None:
        extra["simulated_time_per_minibatch"] = simulated
    extra["found_by"] = chosen.how
    # the DP's own objective for the plan, where the DP made it (the closed form above it:
    # what the objective left out, planner/polish.py)
    extra["dp_objective"] = chosen.objective
    status, label = chosen.status, "dp"
    if ilp_found:  # CP-SAT ran: the plan is the best of its plan and the DP's
        extra |= ilp_found[0].ilp or {}
        status, label = ilp_found[0].status, "ilp"
    # several chunks per rank (interleaved, a V): recorded as interleave/fold_v record it
    extra |= chunk_placement([s.ranks for s in chosen.priced],
                             v_shape=kind(options.schedule).v_shape)
    used = 1 + max(r for s in chosen.priced for r in s.ranks)
    if stages is None and used < workers:
        extra["idle_workers"] = _why_idle(cost_graph, cluster, chosen, simulated, candidates,
                                          workers, simulate, cache)
    result = Plan(stages=chosen.priced, time_per_minibatch=simulated or chosen.closed,
                  dp_time=dp_time, workers=used if stages is None else workers,
                  cost_model=cost_model,
                  planner=label, status=status, bound=None,
                  solve_seconds=0.0, cluster=cluster.to_dict(), extra=extra,
                  schedule=options.schedule, microbatches=options.per_minibatch)
    return replace(result, solve_seconds=time.perf_counter() - started)


def price_plan(cost_graph: nx.DiGraph, given: Plan, cluster: Cluster | str, *,
               schedule: str | None = None, microbatches: int | None = None,
               memory: float | str | None = None, simulate: bool | None = None,
               optimizer_state: float = OPTIMIZER_STATE,
               cache: SearchCache | None = None) -> Plan:
    """A plan made by hand (or loaded), priced as the planner prices its own: stage costs and
    memory from the one cost model, in-flight counts chosen within the memory where the plan
    has none, the time per minibatch from the simulator where a simulation is cheap (else the
    closed form), and data parallelism's time beside it. `schedule` / `microbatches` default
    to the plan's. `cache`: the schedules and prices of the search this call is part of
    (planner/search_cache.py: a plan priced before in it is not priced again)."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    check_plannable(cluster, searching=False)
    validate(cost_graph)
    name = schedule or given.schedule
    if name not in KINDS:
        raise PlanError(unknown(name))
    per = (microbatches or given.microbatches) if kind(name).microbatched else 1
    options = ModelOptions(schedule=name, microbatches=per, optimizer_state=optimizer_state)
    limit = _memory(memory, cluster, "native")
    refused = replicas_refused(name, [s.ranks for s in given.stages])
    if refused is not None:
        raise PlanError(f"plan {given.config} cannot run under schedule {name!r}: {refused}")
    placed = given.stage_of()
    stage_of = {n: placed[n] for n in placed if n in cost_graph}
    from pdcompile.cost.crossing import stage_of_every_node

    every = stage_of_every_node(cost_graph, stage_of)
    order = topological_order(cost_graph)
    stages = [([n for n in order if every[n] == i], tuple(s.ranks))
              for i, s in enumerate(given.stages)]
    flight = [s.in_flight for s in given.stages] if all(s.in_flight for s in given.stages) \
        else None
    again = [s.recompute for s in given.stages]
    shares = given.shares()
    workers = max(r for s in given.stages for r in s.ranks) + 1

    def closed() -> tuple[_Candidate, float, bool]:
        """The plan's candidate in closed form, data parallelism's time and whether data
        parallelism fits (what pricing with and without the simulator share)."""
        # in-flight counts chosen within the memory where they fit (priced once: the counts
        # chosen without a limit are only wanted where these do not fit)
        candidate = None
        if flight is None and limit is not None:
            candidate = _priced(cost_graph, cluster, stages, options, limit, recompute=again,
                                shares=shares)
        if candidate is None:  # over the memory either way: the default counts
            candidate = _priced(cost_graph, cluster, stages, options, None, in_flight=flight,
                                recompute=again, shares=shares)
        if candidate is None:  # priced without a memory limit: a cut the cost model refuses
            # says why (it raises), else a schedule that cannot feed its replicas
            plan_costs(cost_graph, stages, options=options)
            raise PlanError(f"schedule {name!r} with {per} microbatches per minibatch cannot "
                            f"feed the replicas of plan {given.config} (each replica takes a "
                            "share of a minibatch's microbatches); give at least as many "
                            "microbatches as the most replicas, a multiple of them for '2bw'")
        dp_options = data_parallel_options(options, cluster, workers)
        dp_priced, dp_time = evaluate(cost_graph,
                                      [data_parallel_stage(cost_graph, cluster, workers)],
                                      cluster, options=dp_options)
        return candidate, dp_time, limit is None or dp_priced[0].memory <= limit

    if cache is None:
        candidate, dp_time, dp_fits = closed()
        chosen, simulated = _choose(cost_graph, cluster, [candidate], simulate, cache)
    else:  # everything closed() reads; the graph by identity (the cache holds it meanwhile)
        key = (id(cost_graph), cluster, _key(stages), None if flight is None else tuple(flight),
               tuple(again), None if shares is None else tuple(map(tuple, shares)), name, per,
               limit, optimizer_state)
        candidate, dp_time, dp_fits = cache.price(("closed form", *key), cost_graph, closed)
        chosen, simulated = cache.price(
            ("chosen", *key, simulate), cost_graph,
            lambda: _choose(cost_graph, cluster, [candidate], simulate, cache))
    extra = dict(given.extra) | {
        "memory_limit": limit, "dp_fits": dp_fits,
        "closed_form_time_per_minibatch": chosen.closed, "bound": chosen.bound,
        "fits": limit is None or all(s.memory <= rank_memory(limit, cluster, s.ranks)
                                     * (1 + 1e-9) for s in chosen.priced)}
    if simulated is not None:
        extra["simulated_time_per_minibatch"] = simulated
    return replace(given, stages=chosen.priced, time_per_minibatch=simulated or chosen.closed,
                   dp_time=dp_time, workers=workers, cost_model="native",
                   cluster=cluster.to_dict(), extra=extra, schedule=name, microbatches=per,
                   planner=given.planner or "given")


def check_plannable(cluster: Cluster, *, searching: bool = True) -> None:
    """PlanError, in one line and at once, for a cluster too large to plan or price (more than
    MOST_WORKERS workers), or a mixed cluster too large to plan (`searching`: a search for a
    plan, not the pricing of one; more than MOST_MIXED_WORKERS), instead of a MemoryError or
    hours of work."""
    if cluster.workers > MOST_WORKERS:
        raise PlanError(f"the cluster has {cluster.workers:,} workers ({cluster.describe()}); "
                        f"the planner plans and prices at most {MOST_WORKERS:,} (it holds "
                        f"every rank of a plan: time and memory grow with the workers); plan "
                        f"for a cluster of at most {MOST_WORKERS:,} workers")
    if searching and cluster.is_mixed and cluster.workers > MOST_MIXED_WORKERS:
        raise PlanError(f"the mixed cluster has {cluster.workers:,} workers "
                        f"({cluster.describe()}); the planner plans mixed clusters of at most "
                        f"{MOST_MIXED_WORKERS} workers (its search across device groups grows "
                        "faster than the workers squared); plan for at most "
                        f"{MOST_MIXED_WORKERS} of them, or price a plan made by hand on the "
                        "whole cluster (pdcompile.price_plan)")


@dataclass
class _Candidate:
    """A plan the planner considers: its stages priced in closed form (`closed`, seconds per
    minibatch) under its schedule options, and what bounds it."""

    stages: list[tuple[list[str], tuple[int, ...]]]
    options: ModelOptions
    priced: tuple[Stage, ...]
    closed: float
    bound: str
    planner: str = "dp"
    status: str = "OPTIMAL"
    ilp: dict[str, Any] | None = None
    how: str = ""  # which search found it
    objective: float | None = None  # the DP's own objective for it, where the DP made it

    def describe(self) -> str:
        replicas = "-".join(str(s.replicas) for s in self.priced)
        return (f"{self.options.schedule} x{self.options.per_minibatch} {replicas}: "
                f"{self.closed * 1e3:.3f} ms ({self.bound}; {self.how})")

    def as_plan(self) -> Plan:
        """The candidate as a Plan on the ranks it uses (an interleaved one holds several
        chunks per rank, so not one worker per replica)."""
        workers = 1 + max(r for s in self.priced for r in s.ranks)
        return Plan(stages=self.priced, time_per_minibatch=self.closed, dp_time=0.0,
                    workers=workers, schedule=self.options.schedule,
                    microbatches=self.options.per_minibatch)


@dataclass
class _Found:
    kind: str
    candidates: list[_Candidate]
    # the DP table's plans on fewer workers, unpriced (`_FewerPlan`): priced once the whole
    # search's best is known (`_priced_fewer`)
    fewer: list[_FewerPlan] = field(default_factory=list)


@dataclass(frozen=True)
class _FewerPlan:
    """A DP plan on the first `workers` of the cluster's workers, as (nodes, ranks) stages."""

    stages: list[tuple[list[str], tuple[int, ...]]]
    options: ModelOptions
    workers: int
    objective: float  # the DP's, which ranks the plans of one count
    status: str
    how: str


def _schedule_choices(schedule: str, microbatches: int | None, cost_model: str,
                      graph: nx.DiGraph) -> list[tuple[str, int]]:
    """(schedule, microbatches) pairs to plan for."""
    if schedule != "auto" and schedule not in KINDS:
        raise PlanError(unknown(schedule, auto=True))
    if microbatches is not None and (not isinstance(microbatches, int)
                                     or isinstance(microbatches, bool) or microbatches < 1):
        raise PlanError(f"microbatches must be a positive integer (got {microbatches!r})")
    if schedule == "auto" and cost_model != "native":
        raise PlanError("schedule='auto' needs the native cost model (the pipedream model knows "
                        "PipeDream's 1F1B only)")
    names = list(AUTO_SCHEDULES) if schedule == "auto" else [schedule]
    batch = graph.graph.get("batch_size")
    out = []
    for name in names:
        if not kind(name).microbatched:
            out.append((name, 1))
        elif microbatches is not None:
            out.append((name, microbatches))
        else:
            out += [(name, m) for m in AUTO_MICROBATCHES if batch is None or m <= int(batch)]
    return out or [(names[0], 1)]


def _replica_groups(workers: int) -> list[tuple[int, bool]]:
    """Sizes of the groups a flat cluster wider than EXACT_WORKERS is also planned in, one
    pipeline per group and every group alike (`_dp_candidates`' "per server" layout), each
    with whether the group's pipeline is straight: the largest divisor of `workers` from 2 to
    EXACT_WORKERS with replicated stages, and every such divisor straight. The flat DP over
    every worker (or units of them) minimises its slowest stage, and among the many plans that
    tie there it may return a deep one whose later stages' in-flight counts leave the first
    stage's round trips exposed (GPT-2 XL on 32 H100s on one fabric: 18 stages at 872 ms,
    where the 8-8-8-8 that the same machines in servers of 8 get runs at 116 ms)."""
    divisors = [g for g in range(min(EXACT_WORKERS, workers // 2), 1, -1) if workers % g == 0]
    return [(g, False) for g in divisors[:1]] + [(g, True) for g in divisors]


def _server_groups(cluster: Cluster) -> list[int]:
    """Numbers of servers a two-level cluster is also planned in groups of, one pipeline per
    group and every group alike (`_dp_candidates`' "per server" layout with `group`): each
    proper divisor of the server count above 1 whose group has at most EXACT_WORKERS workers
    (the DP then spans them exactly, as on a cluster that small). One server's pipeline on
    every server keeps a stage inside a server, and a straight pipeline or whole servers per
    stage are the other extremes; a model whose stages need more memory than one server's
    pipeline gives them runs fastest in between."""
    per, servers = cluster.levels[0].workers, cluster.levels[-1].workers
    return [k for k in range(2, servers) if servers % k == 0 and k * per <= EXACT_WORKERS]


def _dp_candidates(graph: nx.DiGraph, cluster: Cluster, options: ModelOptions,
                   limit: float | None, straight: bool, workers: int, *, fill: bool,
                   layout: str = "flat", group: int | None = None,
                   cache: SearchCache | None = None) -> _Found:
    """The DP's plans under `options`, each priced: the optimum of the planning objective
    (costmodel.stage_values) with in-flight counts as deep as memory allows, the same with
    PipeDream's NOAM, short pipelines (at most VARIANT_STAGES stages), for streaming schedules
    the fastest period the circuits allow (`dp.native_dp_bisect`, which also chooses the
    in-flight counts), and plain data parallelism. The closed form and the simulator then rank
    them (`_choose`): the DP's objective is a maximum over stages and cannot see everything
    that couples them (how the in-flight counts of later stages bound an earlier one's round
    trips, replicas of different counts all-reducing in lockstep).

    `layout` (what makes clusters of hundreds of workers tractable: the DP spans a few units
    instead of every worker): "flat", every worker on its own; "per server", the DP plans one
    server (the cluster's innermost group) and every server gets the same pipeline, each
    stage's replicas on all servers all-reducing together; "across servers", the DP plans
    whole servers (the outermost level's members) and a stage on k servers runs on all their
    workers, replicated within each server. `group` (with "per server"): on a one-level
    cluster the DP plans `group` workers, on two levels `group` servers, and every group of
    them gets the same pipeline. `cache`: the search this is part of (its DPs share their
    coarsened graphs)."""
    from pdcompile.planner.dp import (
        native_dp,
        native_dp_bisect,
        stage_grid,
        state_tables,
        unit_bounds,
    )
    from pdcompile.planner.tie_repair import equalized

    copies, search, span, link = 1, cluster, workers, cluster.levels[-1]
    # the period's bisection and the recomputation search, where the DP is small enough
    thorough = layout == "flat" and workers <= EXACT_WORKERS
    if layout == "per server" and group is not None and len(cluster.levels) > 1:
        span = group * cluster.levels[0].workers
        copies = workers // span
        search = replace(cluster, levels=(cluster.levels[0],
                                          replace(cluster.levels[1], workers=group)),
                         name=f"{group} servers of {cluster.name}")
    elif layout == "per server" and group is not None:
        span, copies = group, workers // group
        search = replace(cluster, levels=(replace(cluster.levels[0], workers=group),),
                         name=f"{group} workers of {cluster.name}")
    elif layout == "per server":
        span = cluster.levels[0].workers
        copies = workers // span
        search = replace(cluster, levels=cluster.levels[:1], name=f"one server of {cluster.name}")
    elif layout == "across servers":
        span = cluster.levels[-1].workers
        copies = workers // span
        search = replace(cluster, levels=cluster.levels[-1:], name=f"servers of {cluster.name}")
        link = cluster.levels[-2]
    prepared = prepare(graph, "native", span, straight=straight, least=span + 1 if fill else 0,
                       cache=cache)
    if fill and len(prepared.states) - 1 < span:
        raise PlanError(f"{span} stages need {span + 1} states; the DP has "
                        f"{len(prepared.states)} ({prepared.kind})")
    units = len(unit_bounds(span, straight=straight)) - 1
    grouped = units < span  # the DP places units of several workers
    status = "OPTIMAL" if prepared.kind == "all downsets" and copies == 1 and not grouped \
        else "HEURISTIC"
    tables = state_tables(prepared.graph, prepared.states, prepared.pinned)
    found: list[_Candidate] = []
    later: list[_FewerPlan] = []  # the table's plans on fewer workers (`_Found.fewer`)

    def expanded(result: Any) -> list[tuple[list[str], tuple[int, ...]]]:
        states = prepared.states
        stages = [(states.stage_nodes(s.before, s.after),
                   _spread(s.ranks, copies, span, layout)) for s in result.stages]
        if stages and prepared.pinned:
            stages[0] = (list(prepared.pinned) + stages[0][0], stages[0][1])
        return expand(stages, prepared.mapping, {}, graph, order=prepared.order)

    def add(result: Any, flight: tuple[int, ...] | None = None, how: str = "",
            equalize: bool = False) -> None:
        plans = [(expanded(result), flight, how)]
        if equalize and result.free is not None:
            # the cuts of the optimum without the tie rule, its tied stages set equal (which
            # may leave workers idle, as the DP's own plans never do)
            plans += [(stages, None, f"{how}, tied stages of the optimum without the rule "
                                     f"equalized") for stages in equalized(
                graph, expanded(result.free), workers, flush=kind(options.schedule).flush)]
        for stages, depths, tag in plans:
            if all(stages != c.stages for c in found):
                # the objective is the DP's for its own plan, on one copy of the pipeline
                objective = result.objective if tag == how and copies == 1 else None
                candidate = _priced(graph, cluster, stages, options, limit, planner="dp",
                                    status=status, in_flight=depths, how=tag,
                                    objective=objective)
                if candidate is not None:
                    found.append(candidate)

    # no chain of these states fits the memory in `units` stages: every DP below would fail
    hopeless = limit is not None and limit <= least_memory(
        tables.params, tables.keep, tables.valid, units, options)

    def search_grid(recompute: bool) -> None:
        grid = stage_grid(tables, search, options=options, memory=limit, straight=straight,
                          workers=span, copies=copies, copy_link=link,
                          recompute=recompute)
        tag = "recompute " if recompute else ""
        variants: list[tuple[ModelOptions, int | None]] = [(options, None)]
        if not kind(options.schedule).flush:
            variants.append((replace(options, flight="noam"), None))
        if not straight:
            variants += [(options, k) for k in VARIANT_STAGES if k < span]
        grids = [(grid, tag)]
        if search.allreduce_bucket is not None and not straight and not recompute:
            # the objective hides a bucketed all-reduce behind its stage's backward, which
            # replicas waiting for each other in lockstep do not fully achieve (the closed form
            # and the simulator see them wait): also the optima with the whole all-reduce
            grids.append((stage_grid(tables, replace(search, allreduce_bucket=None),
                                     options=options, memory=limit, workers=span, copies=copies,
                                     copy_link=link), "whole all-reduce "))
        if kind(options.schedule).flush and len(search.levels) > 1 and copies == 1 \
                and not recompute:
            # a flush is often bound by a server's interface, whose load is a sum over stages
            # that the objective, a maximum over stages, sees only in part (a stage counts
            # nothing on a server it shares with the stage it talks to): also the optima with
            # every server's share crossing
            grids.append((stage_grid(tables, search, options=options, memory=limit,
                                     straight=straight, workers=span, interfaces="whole"),
                          "whole interfaces "))
        fewer: list[tuple[Any, str, bool]] = []  # the table's plans on fewer units
        for searched, label in grids:
            for variant, most in variants:
                try:
                    result = native_dp(searched, options=variant, straight=straight, fill=fill,
                                       max_stages=most)
                except PlanError:
                    continue
                add(result, how=f"{label}{variant.flight}/{most}",
                    equalize=variant is options and most is None and label == tag)
                if most is None:
                    # the one the objective says beats every worker's plan is always priced
                    leader = min(result.fewer, key=lambda f: f.objective, default=None)
                    fewer += [(f, f"{label}{variant.flight}/{most}",
                               f is leader and f.objective < result.objective)
                              for f in result.fewer]
        # the others wait for the whole search's best (`_priced_fewer`)
        for result_, how, leads in fewer:
            moved = _from_first_rank(result_, cluster, layout)
            if moved is None:
                continue
            used = 1 + moved.stages[-1].ranks[-1]
            if leads:
                add(moved, how=f"{how} on {used} of {span} workers")
            elif thorough:
                # not on wider clusters, where the objective misranks them by factors and
                # pricing is dear: GPT-2 XL on flat 32 H100, the flat DP's plans on 9-31
                # workers (objectives 0.11-0.28 s, prices 0.66-0.73 s against the best plan's
                # 0.116 s) took 9 s of CPU to price, more than the rest of the search
                later.append(_FewerPlan(expanded(moved), options, used, result_.objective,
                                        status, f"{how} on {used} of {span} workers"))
        if not kind(options.schedule).flush and thorough:
            # the grid prices one copy of the pipeline: its period is `copies` times the plan's
            high = (min((c.closed for c in found), default=0.0)
                    or _work_bound(graph, workers)) * copies
            low = _work_bound(graph, workers) * copies
            for _ in range(6):  # grow the upper end until some plan reaches it
                bisected = native_dp_bisect(grid, options=options, low=low, high=high,
                                            straight=straight, fill=fill)
                if bisected is not None:
                    # the DP's in-flight counts assume no recomputation; choose both anew
                    add(bisected[0], None if recompute else bisected[1], how=f"{tag}bisect")
                    break
                low, high = high, high * 4

    if not hopeless:
        search_grid(recompute=False)
    if not straight and not hopeless:
        whole = _priced(graph, cluster, [data_parallel_stage(graph, cluster)], options, limit,
                        planner="dp", status=status, how="data parallel")
        if whole is not None:
            found.append(whole)
    capped = any(s.in_flight < default_in_flight(s.replicas, sum(
        x.replicas for x in c.priced[i:]), options) for c in found for i, s in enumerate(c.priced))
    if capped and not kind(options.schedule).flush and thorough:
        # the memory keeps a stage below PipeDream's in-flight count: recomputing activations
        # would let it hold more, and the cuts may then fall elsewhere
        search_grid(recompute=True)
    if grouped and layout == "flat" and not found:
        # nothing fits on units: pipelines of more stages than units, one worker each
        try:
            found += _dp_candidates(graph, cluster, options, limit, True, workers,
                                    fill=False, cache=cache).candidates
        except PlanError:
            pass
    if not found:
        raise PlanError("no plan fits")
    kind_of_states = prepared.kind + (
        f", one pipeline on each of {copies} groups of {span} workers"
        if layout == "per server" and group is not None
        else f", one server's pipeline on each of {copies} servers" if layout == "per server"
        else f", whole servers per stage ({copies} workers each)" if layout == "across servers"
        else "") + (f", {units} units of about {span // units} workers" if grouped else "")
    return _Found(kind_of_states, found, later)


def _priced_fewer(graph: nx.DiGraph, cluster: Cluster, plans: list[_FewerPlan],
                  candidates: list[_Candidate], limit: float | None) -> list[_Candidate]:
    """The DP table's plans on fewer workers (`_Found.fewer`), priced where the price may
    prefer them to every candidate: a plan on w workers takes at least the work bound on w
    (`_work_bound`), and one further than SIMULATED_WITHIN off the best is never simulated
    (`_choose`). The DP's objective, which chose them, can misrank them: under a flush it
    counts no stage's fill before it (1-2-1 on 4 workers over 10 GB/s priced 18.01 ms, where
    straight on 3, which the objective ranked behind, takes 15.11 ms). One plan per count
    and schedule option, the DP's best among them (its variants and grids); none already a
    candidate."""
    if not plans or not candidates:
        return []
    known = min(c.closed for c in candidates)
    total = _work_bound(graph, 1)
    out: list[_Candidate] = []
    seen: set[tuple[Any, ...]] = set()
    for p in sorted(plans, key=lambda p: p.objective):
        key = (p.options, p.workers)
        if key in seen or total / p.workers > known * SIMULATED_WITHIN:
            continue
        seen.add(key)
        if any(c.options == p.options and c.stages == p.stages for c in candidates + out):
            continue
        priced = _priced(graph, cluster, p.stages, p.options, limit, planner="dp",
                         status=p.status, how=p.how, objective=p.objective)
        if priced is not None:
            out.append(priced)
    return out


def _from_first_rank(result: Any, cluster: Cluster, layout: str) -> Any:
    """A DP plan on the grid's last units (`DPResult.fewer`) moved to the first ranks, where
    that prices it alike (a flat DP over every worker, shifted by whole servers on two levels:
    the idle ranks are the last ones, as in every plan on fewer workers); None elsewhere."""
    if layout != "flat" or cluster.is_mixed or not result.stages:
        return None
    shift = result.stages[0].ranks[0]
    inner = math.prod(level.workers for level in cluster.levels[:-1])
    if shift % inner:
        return None
    return replace(result, stages=tuple(
        replace(s, ranks=tuple(r - shift for r in s.ranks)) for s in result.stages))


def _interleaved_candidates(graph: nx.DiGraph, cluster: Cluster, options: ModelOptions,
                            limit: float | None, workers: int, chunks: int = 2) -> _Found:
    """Interleaved plans: the DP's straight cuts into workers x `chunks` stages balanced by
    cost (on the cluster's innermost link), chunk c then placed on rank c mod workers
    (planner/interleave.py), or in a V of 2 chunks per rank for the V-shaped schedules
    (`fold_v`), and priced on the cluster."""
    from pdcompile.planner.interleave import fold_v, interleave

    count = workers * chunks
    if workers < 2 or count > min(graph.number_of_nodes(), MOST_STAGES):
        raise PlanError(f"{count} chunks of {graph.number_of_nodes()} nodes on {workers} "
                        "workers cannot be interleaved")
    flat = cluster.with_workers(count)
    found = _dp_candidates(graph, flat, options, limit, True, count, fill=True)
    out = []
    for candidate in found.candidates:
        straight_plan = candidate.as_plan()
        v_shape = kind(options.schedule).v_shape
        placed = fold_v(straight_plan) if v_shape else interleave(straight_plan, workers)
        stages = [(list(s.nodes), tuple(s.ranks)) for s in placed.stages]
        priced = _priced(graph, cluster, stages, options, limit, planner="dp",
                         status="HEURISTIC",
                         how=f"{'V' if v_shape else 'interleaved'} x{chunks}: {candidate.how}")
        if priced is not None:
            out.append(priced)
    if not out:
        raise PlanError("no interleaved plan fits")
    return _Found(f"{found.kind}, {chunks} chunks per worker", out)


def _spread(ranks: tuple[int, ...], copies: int, span: int, layout: str) -> tuple[int, ...]:
    """A stage's ranks in the DP's units as ranks of the cluster. "across servers": every
    worker of its servers (`copies` each). "per server": its ranks on one server, repeated on
    every server (`copies` of `span` workers), replica i on server i mod copies, so that round
    robin keeps every minibatch's transfers
    between the stages inside one server."""
    if copies == 1:
        return ranks
    if layout == "across servers":
        return tuple(unit * copies + i for unit in ranks for i in range(copies))
    return tuple(server * span + ranks[i // copies] for i in range(len(ranks) * copies)
                 for server in (i % copies,))


def _work_bound(graph: nx.DiGraph, workers: int) -> float:
    """A lower bound on any plan's time per minibatch: all compute shared by all workers."""
    inputs = set(input_nodes(graph))
    total = sum(float(d["fwd"]) + float(d["bwd"]) for n, d in graph.nodes(data=True)
                if n not in inputs)
    return total / workers


def _priced(graph: nx.DiGraph, cluster: Cluster,
            stages: list[tuple[list[str], tuple[int, ...]]], options: ModelOptions,
            limit: float | None, *, in_flight: Sequence[int] | None = None,
            recompute: Sequence[bool] | None = None,
            shares: Sequence[Sequence[int]] | None = None, costs: StageCosts | None = None,
            orders: FlushOrders | None = None, **tags: Any) -> _Candidate | None:
    """A candidate priced with its in-flight counts (given, else `choose_in_flight`) and its
    stages' recomputation (given, else `choose_recompute`); None if it does not fit, or if the
    schedule cannot feed its replicas (a microbatched schedule gives each replica of a stage
    its share of a minibatch's microbatches: no more replicas than microbatches, and 2bw a
    whole number each). `costs`: `plan_costs` of these stages and options, where the caller
    has them (made here otherwise, once for the choices and the price); `orders`: flush
    orders made before (`cost.flush_path.FlushOrders`), for a search pricing many cuts."""
    row = kind(options.schedule)
    m = options.per_minibatch
    if replicas_refused(options.schedule, [ranks for _, ranks in stages]) is not None:
        return None
    for _, ranks in stages:
        if row.microbatched and (len(ranks) > m or (not row.flush and m % len(ranks))):
            return None
    timed_here = shares is None and options.cost_model == "native"  # the bound is its own
    if costs is None and (recompute is None or in_flight is None or timed_here):
        try:
            costs = plan_costs(graph, stages, options=options)
        except PlanError:  # a plan priced as given says why; one to choose for is refused
            if in_flight is not None and recompute is not None:
                raise
            return None
    try:
        if recompute is None and in_flight is None:
            again, flight = choose_recompute(graph, stages, cluster, options=options,
                                             memory=limit, costs=costs)
        else:
            again = list(recompute) if recompute is not None else \
                choose_recompute(graph, stages, cluster, options=options, memory=limit,
                                 costs=costs)[0]
            flight = list(in_flight) if in_flight is not None else \
                choose_in_flight(graph, stages, cluster, options=options, memory=limit,
                                 recompute=again, costs=costs)
    except PlanError:
        return None
    if timed_here:
        priced, closed, timed = evaluate_timed(graph, stages, cluster, options=options,
                                               in_flight=flight, recompute=again, costs=costs,
                                               orders=orders)
    else:
        priced, closed = evaluate(graph, stages, cluster, options=options, in_flight=flight,
                                  recompute=again, shares=shares)
    held: dict[int, float] = {}  # per worker: a rank holding several chunks holds them all
    for stage in priced:
        for rank in stage.ranks:
            held[rank] = held.get(rank, 0.0) + stage.memory
    if limit is not None and any(used > rank_memory(limit, cluster, (rank,)) * (1 + 1e-9)
                                 for rank, used in held.items()):
        return None
    workers = len(held)
    if (row.interleaved or row.split_backward) and not row.v_shape and m >= workers \
            and m % workers:
        return None  # these orders take microbatches in rounds of one per rank
    if len(stages) == 2 * workers and m < row.microbatches_per_rank * workers:
        return None  # a V whose order needs more microbatches (DualPipeV: 2 per rank)
    if shares is not None or options.cost_model != "native":
        timed = priced_time(graph, stages, cluster, options=options, in_flight=flight,
                            recompute=again)
    bound = timed.bound
    return _Candidate(stages, options, priced, closed, bound, **tags)


def _polished(graph: nx.DiGraph, cluster: Cluster, candidates: list[_Candidate],
              limit: float | None) -> list[_Candidate]:
    """Where a schedule's best candidate (a flush schedule's: one of its POLISH_FROM best) is
    bound by a server's network interface (a load the
    DP's objective, a maximum over stages, sees only in part where stages share a server),
    the plans closed-form descents reach from its POLISH_FROM best candidates
    (planner/polish.py), each priced as any candidate (POLISH_BUDGET prices in all per
    schedule, a millisecond or so each on a graph of a few dozen nodes; POLISH_STREAMING for a
    streaming schedule, whose in-flight choice searches circuits: 0.1-0.2 s each on GNMT).

    Under a flush schedule, also where none binds: from those of its POLISH_FROM best that the
    closed form prices more than POLISH_DISAGREEMENT above the DP's objective for them, or
    that the DP's objective did not rank (data parallelism, a 4 that 2-2 beat). The
    objective is a maximum over stages, each seen alone (its fill and drain, its work, its
    share of an interface), so where the price of a plan is well above it the objective
    misjudged that plan, and may have misjudged its neighbours too (inception_v3 on
    cluster B: it ranked 11-5 at 79.5 ms ahead of 8-8 at 80.4 ms; the closed form prices 11-5
    at 100.2 ms, and no interface binds there: the planner returned 8 of the 16 workers at
    86.81 ms where a descent from 11-5 reaches 7-1-8 at 63.74 ms)."""
    from pdcompile.planner.moves import runs_nothing
    from pdcompile.planner.polish import polish

    out: list[_Candidate] = []
    priced: dict[tuple[Any, ...], _Candidate | None] = {}  # per options and plan
    floored: set[tuple[Any, ...]] = set()  # plans a lower bound kept from pricing
    # the stages' costs of the plan floored last: the walk prices a plan right after its floor
    # lets it through, and its costs (a pass over every node and edge) are the same
    floor_costs: tuple[tuple[Any, ...], StageCosts] | None = None  # (plan's key, its costs)
    orders = FlushOrders()  # the walks change nodes far more often than ranks or depths
    inputs = set(input_nodes(graph))
    for option in dict.fromkeys(c.options for c in candidates):
        ranked = sorted((c for c in candidates if c.options == option), key=lambda c: c.closed)
        # a flush schedule, priced exactly and cheaply (cost/flush_path.py), descends where
        # any of its best few is bound by an interface (resnext101 on cluster A: 1-2-2-3-1-3-3-1,
        # 123 ms and second best, walks to 3-5-1-3-3-1 at 92.5 ms, under the best's 102.4 ms)
        flush = kind(option.schedule).flush
        watched = ranked[:POLISH_FROM] if flush else ranked[:1]
        starts = watched if any(c.bound == "server interface" for c in watched) else [
            c for c in watched if flush and (c.objective is None  # not the DP's (data parallel)
                                             or c.closed > c.objective * (1 + POLISH_DISAGREEMENT))]
        if not starts:
            continue

        def price(stages: list[tuple[list[str], tuple[int, ...]]],
                  options: ModelOptions = option) -> float:
            key = (options, _key(stages))
            if key not in priced and runs_nothing(stages, inputs):
                # a stage of the input alone, which the split refuses: a walk that stepped
                # there (a plateau move, as fast) lost the cheaper plan it had reached before
                priced[key] = None
            if key not in priced:
                try:
                    priced[key] = _priced(graph, cluster, stages, options, limit,
                                          costs=floor_costs[1] if floor_costs is not None
                                          and floor_costs[0] == key else None, orders=orders)
                except PlanError:  # e.g. an input moved out of the first stage
                    priced[key] = None
            found = priced[key]
            return math.inf if found is None else found.closed

        def floor(stages: list[tuple[list[str], tuple[int, ...]]],
                  options: ModelOptions = option) -> float:
            key = (options, _key(stages))
            if key in priced:
                found = priced[key]
                return math.inf if found is None else found.closed
            floored.add(key)  # counted against the budget as a price (polish.polish)
            if runs_nothing(stages, inputs):
                return math.inf  # never taken (see price)
            nonlocal floor_costs
            floor_costs = None
            try:
                floor_costs = (key, plan_costs(graph, stages, options=options))
                return closed_form_floor(graph, stages, cluster, options=options,
                                         costs=floor_costs[1])
            except PlanError:
                return -math.inf  # priced, and refused there

        for start in starts:
            budget = POLISH_BUDGET if flush else _streaming_budget(len(start.stages))
            left = budget - sum(1 for key in priced.keys() | floored if key[0] == option)
            if left <= 0:
                break
            walked = polish(graph, start.stages, price, budget=left, floor=floor)
            if walked is None:  # (it never ends on a stage of the input alone: see price)
                continue
            stages, _, moves = walked
            found = priced.get((option, _key(stages)))
            if found is not None and all((found.options, found.stages) != (c.options, c.stages)
                                         for c in candidates + out):
                found.how = f"polished from {start.how or 'the DP'}, {len(moves)} moves"
                found.status = "HEURISTIC"
                out.append(found)
    return out


def _streaming_budget(stages: int) -> int:
    """Prices a streaming schedule's descent may spend from a plan of `stages` stages: the
    same work, about, whatever the depth (POLISH_STREAMING_STAGES); deterministic, so that
    the plan does not depend on the machine's load."""
    deeper = max(1.0, stages / POLISH_STREAMING_STAGES)
    return max(1, int(POLISH_STREAMING / deeper**3))


def _key(stages: Sequence[tuple[Sequence[str], Sequence[int]]]) -> tuple[Any, ...]:
    """A plan as a hashable value: each stage's nodes and ranks."""
    return tuple((tuple(nodes), tuple(ranks)) for nodes, ranks in stages)


def _choose(graph: nx.DiGraph, cluster: Cluster, candidates: list[_Candidate],
            simulate: bool | None,
            cache: SearchCache | None = None) -> tuple[_Candidate, float | None]:
    """The best candidate: by the simulator's steady state among the best few by the closed
    form where simulating is cheap (or asked for), else by the closed form. Where every
    simulated choice fails (depths that cannot run), the next candidates by the closed form are
    simulated until one runs: a candidate the simulator refused was returned before."""
    ranked = sorted(candidates, key=lambda c: c.closed)
    # plans whose tied stages would update apart cannot run (cost/ties.py `updates_apart`):
    # out before the closed form picks one without the simulator to refuse it
    ranked = [c for c in ranked if not _ties_update_apart(graph, c)] or ranked
    if simulate is False:
        return ranked[0], None
    best: tuple[float, _Candidate] | None = None
    # the DP's best few within SIMULATED_WITHIN of the best closed form, and every CP-SAT plan
    # (adding CP-SAT never loses the DP's choice)
    near = [c for c in ranked if c.closed <= ranked[0].closed * SIMULATED_WITHIN]
    chosen = [c for c in near if c.planner != "ilp"][:SIMULATED_CANDIDATES] \
        + [c for c in ranked if c.planner == "ilp"]
    # and plain data parallelism wherever it fits: the planner never returns a plan that it
    # predicts slower than data parallelism
    chosen += [c for c in ranked if c.how == "data parallel" and c not in chosen]
    # and the whole model on one worker where it is near the best (the planner is never slower
    # than it; further off, the closed form of one stage, exact, already says it loses)
    chosen += [c for c in near if c.how == "the whole model on one worker" and c not in chosen]
    # and every plan the planner made on fewer of the workers: it never returns a plan that
    # it predicts slower than one of those (planner/fewer_workers.py)
    chosen += [c for c in ranked if c.how.startswith(PLANNED_ON_FEWER) and c not in chosen]
    # and the best of every schedule and microbatch count (schedule="auto"): the closed form
    # ranks plans of one schedule better than plans of different ones
    for option in {(c.options.schedule, c.options.per_minibatch) for c in ranked}:
        leader = next(c for c in ranked
                      if (c.options.schedule, c.options.per_minibatch) == option)
        if leader not in chosen:
            chosen.append(leader)
    failed: list[_Candidate] = []  # candidates whose chosen depths cannot run

    def simulated(candidate: _Candidate) -> float | None:
        """The simulator's time per minibatch; None where it is over the budget or fails."""
        plan_ = candidate.as_plan()
        if simulate is None and _simulation_cost(plan_) > SIMULATION_BUDGET:
            return None
        try:
            return simulate_steady(graph, plan_, cluster, cache=cache)[1].time_per_minibatch
        except ScheduleError:  # the chosen depths cannot run: that candidate is out
            failed.append(candidate)
            return None

    for candidate in chosen:
        seconds = simulated(candidate)
        if seconds is not None and (best is None or seconds < best[0]):
            best = (seconds, candidate)
    if best is None and failed:
        # every simulated choice failed: the next candidates by the closed form, until one
        # runs in the simulator (a plan that cannot run is never returned in its place)
        for candidate in (c for c in ranked if c not in chosen):
            seconds = simulated(candidate)
            if seconds is not None:
                return candidate, seconds
    if best is None:  # nothing simulated: by the closed form, one not known to fail first
        return next((c for c in ranked if c not in failed), ranked[0]), None
    return best[1], best[0]


def _ties_update_apart(graph: nx.DiGraph, candidate: _Candidate) -> bool:
    """Whether the candidate puts a tie on stages that update a different number of times."""
    placed = {node for nodes, _ in candidate.stages for node in nodes}
    if graph.graph.get("ties") and any(node not in placed for node in graph.nodes):
        return False  # stages over another graph's nodes: the simulator decides
    return _stages_update_apart(graph, candidate.stages, candidate.options.schedule)


def _tie_repaired(graph: nx.DiGraph, cluster: Cluster, candidates: list[_Candidate],
                  limit: float | None, workers: int) -> list[_Candidate]:
    """The best REPAIRED_CANDIDATES per schedule option among the candidates whose tied stages
    update apart (which a streaming schedule cannot run), with their cuts kept and the stages
    sharing a tie set to one replica count (planner/tie_repair.py), each priced as any
    candidate: a cheap way back to the DP's cuts where the DP's replicas were refused."""
    from pdcompile.planner.tie_repair import equalized

    out: list[_Candidate] = []
    seen = {(c.options, _key(c.stages)) for c in candidates}
    refused = sorted((c for c in candidates if _ties_update_apart(graph, c)),
                     key=lambda c: c.closed)
    taken: dict[ModelOptions, int] = {}
    for candidate in refused:
        if taken.get(candidate.options, 0) >= REPAIRED_CANDIDATES:
            continue
        taken[candidate.options] = taken.get(candidate.options, 0) + 1
        for stages in equalized(graph, candidate.stages, workers,
                                flush=kind(candidate.options.schedule).flush):
            key = (candidate.options, _key(stages))
            if key in seen:
                continue
            seen.add(key)
            replicas = "-".join(str(len(ranks)) for _, ranks in stages)
            found = _priced(graph, cluster, stages, candidate.options, limit,
                            planner=candidate.planner, status="HEURISTIC",
                            how=f"tied stages equalized to {replicas} from "
                                f"{candidate.how or candidate.planner}")
            if found is not None:
                out.append(found)
    return out


def _on_fewer_workers(graph: nx.DiGraph, cluster: Cluster, choices: list[tuple[str, int]],
                      candidates: list[_Candidate], limit: float | None,
                      optimizer_state: float, again: Any) -> list[_Candidate]:
    """Candidates that leave workers idle (planner/fewer_workers.py): the whole model on rank 0
    under every schedule option that runs on one worker (not the interleaved ones), and the plan
    `again(sub)` makes (a Plan, or the PlanError it raised) for each smaller cluster `sub` of
    `fewer_workers.fewer_clusters`, priced on the cluster with its in-flight counts and
    recomputation. Every count of a small flat cluster where `sub`'s compute bound
    (`_work_bound`: no plan there can be faster) leaves it a chance against the best candidate
    so far, within SIMULATED_WITHIN; the first half of any other where the best candidate is
    slower than that bound and some stage of it pays more in all-reduces and transfers than the
    half's bound exceeds the cluster's (what the half saves is at most that communication;
    where memory or the pipeline's round trips bind, as GPT-2 XL's on 16 x 8 H100 at 25% of
    its compute bound, a half searched in 46 s of CPU, recursively, found nothing faster)."""
    from pdcompile.planner.fewer_workers import fewer_clusters

    out: list[_Candidate] = []
    known = min((c.closed for c in candidates), default=math.inf)
    # one worker computes everything: where that alone is far slower than the best plan here
    # (beyond what `_choose` simulates), it is not priced (5,000 nodes: 0.07 s of 1.3)
    total = _work_bound(graph, 1)
    alone_too = total <= known * SIMULATED_WITHIN
    for name, m in choices:
        if kind(name).interleaved or not alone_too:  # interleaved: chunks on several workers
            continue
        options = ModelOptions(schedule=name, microbatches=m, optimizer_state=optimizer_state)
        alone = _priced(graph, cluster, [(topological_order(graph), (0,))], options, limit,
                        status="HEURISTIC",
                        how="the whole model on one worker")
        if alone is not None:
            out.append(alone)
    subs = fewer_clusters(cluster, graph.number_of_nodes())
    if not subs or not candidates:
        return out
    best = min(candidates, key=lambda c: c.closed)  # on the cluster's workers
    fastest = min(c.closed for c in candidates + out)
    full = total / cluster.workers
    # the most the best plan here pays in all-reduces and transfers in a stage
    paid = max(s.sync + s.comm for s in best.priced)
    for sub, every in subs:
        floor = total / sub.workers
        # no plan on `sub` is faster than its work bound, and one further than
        # SIMULATED_WITHIN off the best is never simulated; the half computes at least
        # `floor - full` longer than every worker could, and can only win back what the best
        # plan here pays in all-reduces and transfers
        if every and floor > fastest * SIMULATED_WITHIN:
            continue
        if not every and not (fastest > floor * (1 + 1e-9) and paid > floor - full):
            continue
        planned = again(sub)
        if isinstance(planned, PlanError):
            continue
        options = ModelOptions(schedule=planned.schedule, microbatches=planned.microbatches,
                               optimizer_state=optimizer_state)
        flight = [s.in_flight for s in planned.stages]
        found = _priced(graph, cluster,
                        [(list(s.nodes), tuple(s.ranks)) for s in planned.stages],
                        options, limit, in_flight=flight if all(flight) else None,
                        recompute=[s.recompute for s in planned.stages],
                        planner=planned.planner, status="HEURISTIC",
                        how=f"{PLANNED_ON_FEWER} {sub.workers} of {cluster.workers} workers: "
                            f"{planned.extra.get('found_by') or 'planned'}")
        if found is not None:
            out.append(found)
    return out


def _why_idle(graph: nx.DiGraph, cluster: Cluster, chosen: _Candidate,
              simulated: float | None, candidates: list[_Candidate], workers: int,
              simulate: bool | None, cache: SearchCache | None) -> str:
    """Why the chosen plan leaves workers idle, in one line (fewer_workers.idle_reason): the
    best candidate on every worker, priced as the chosen one was."""
    from pdcompile.planner.fewer_workers import idle_reason

    everyone = [c for c in candidates
                if len({r for _, ranks in c.stages for r in ranks}) == workers]
    if not everyone:
        return idle_reason(cluster, chosen.priced, simulated or chosen.closed, None, None, "")
    best, seconds = _choose(graph, cluster, everyone, simulate, cache)
    return idle_reason(cluster, chosen.priced, simulated or chosen.closed, best.priced,
                       seconds or best.closed, best.as_plan().config)


def _simulation_cost(plan_: Plan) -> int:
    """About how many actions and dependencies simulating a plan visits: every stage's actions
    for every microbatch, and each all-reduce waiting for all of its stage's replicas (a
    streaming schedule's first two runs, `simulate_steady`)."""
    stream = 3 * steady_minibatches(plan_) if not kind(plan_.schedule).flush else 1
    return sum(stream * plan_.microbatches * (8 + s.replicas) for s in plan_.stages)


def _ilp_candidate(graph: nx.DiGraph, cluster: Cluster, planner: str, limit: float | None,
                   time_limit: float | None, hint: _Candidate) -> list[_Candidate]:
    """CP-SAT's plan for the hint's options ("ilp", or "auto" on small graphs), priced."""
    model_graph, model_mapping = graph, None
    if graph.number_of_nodes() > ILP_AUTO_NODES:
        model_graph, model_mapping = coarse_with_pinned(graph, ILP_AUTO_NODES)
    blocks = model_graph.number_of_nodes() - len(pinned_inputs(graph))
    if planner != "ilp" and blocks > ILP_AUTO_NODES:
        return []
    from pdcompile.planner.ilp import improve

    seed = hint.as_plan()
    solved = improve(graph, cluster, seed, options=hint.options, memory=limit,
                     time_limit=time_limit or (ILP_DEFAULT_LIMIT if planner == "ilp"
                                               else ILP_AUTO_LIMIT),
                     model_graph=model_graph, mapping=model_mapping)
    stages = [(list(s.nodes), tuple(s.ranks)) for s in solved.stages]
    found = _priced(graph, cluster, stages, hint.options, limit, planner="ilp",
                    status=solved.status,
                    ilp={k: v for k, v in solved.extra.items() if k.startswith("ilp")}
                    | {"ilp_bound": solved.bound})
    return [found] if found is not None else []


def _pipedream_plan(cost_graph: nx.DiGraph, cluster: Cluster, options: ModelOptions,
                    limit: float | None, straight: bool) -> Plan:
    """The original optimizer's plan and figures (cost_model="pipedream"), its DP on states
    within `pipedream_budget` (a graph too big for it is coarsened first)."""
    work, attach = planning_graph(cost_graph, "pipedream")
    levels = tuple(level.workers for level in cluster.levels)
    if straight:
        _straight_fits(work, cluster, limit)
    prepared = prepare(work, "pipedream", cluster.workers, straight=straight, levels=levels,
                       memory=limit is not None, least=cluster.workers + 1 if straight else 0)
    try:
        result = solve(prepared, cluster, options, limit, straight)
    except PlanError:
        raise _no_fit(cost_graph, cluster, options, limit, straight) from None
    states = prepared.states

    def nodes_and_ranks(found: Any) -> list[tuple[list[str], tuple[int, ...]]]:
        stages = [(states.stage_nodes(s.before, s.after), s.ranks) for s in found.stages]
        return expand(stages, prepared.mapping, attach, cost_graph)

    nodes_ranks = nodes_and_ranks(result)
    if _stages_update_apart(cost_graph, nodes_ranks, options.schedule):
        result, nodes_ranks = _pipedream_under_tie_rule(
            cost_graph, cluster, options, limit, straight, prepared, nodes_and_ranks,
            nodes_ranks)
    priced, predicted = evaluate(cost_graph, nodes_ranks, cluster, options=options)
    extra: dict[str, Any] = {"states": prepared.kind, "memory_limit": limit}
    everything = [data_parallel_stage(cost_graph, cluster)]
    dp_priced, _ = evaluate(cost_graph, everything, cluster, options=options)
    extra["dp_fits"] = limit is None or dp_priced[0].memory <= limit
    objective = predicted
    if len(cluster.levels) > 1:
        # The original's hierarchical objective is recursive (a level's stage time is the best
        # pipeline of the level below); it is what the original reports, so we report it too.
        extra["flattened_time"] = predicted
        objective = result.objective
    elif not straight and len(priced) > 1:
        dp_time = data_parallel_time(cost_graph, cluster, options=options)
        if dp_time < predicted and extra["dp_fits"]:
            priced, objective = dp_priced, dp_time
            extra["fallback"] = "data parallel (cheaper than the DP's plan on the full graph)"
    return Plan(stages=priced, time_per_minibatch=objective,
                dp_time=data_parallel_time(cost_graph, cluster, options=options),
                workers=cluster.workers, cost_model="pipedream", planner="dp",
                status="OPTIMAL" if prepared.kind == "all downsets" else "HEURISTIC",
                bound=None, solve_seconds=0.0, cluster=cluster.to_dict(), extra=extra)


def _stages_update_apart(graph: nx.DiGraph,
                         stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                         schedule: str) -> bool:
    """Whether `stages` (every node of `graph`) put a tie on stages that a streaming
    `schedule` updates a different number of times (cost/ties.py `updates_apart`)."""
    if not graph.graph.get("ties"):
        return False
    stage_of = {node: i for i, (nodes, _) in enumerate(stages) for node in nodes}
    ties = shared_weights(graph, stage_of)
    replicas = [len(ranks) for _, ranks in stages]
    return updates_apart(ties, replicas, kind(schedule).flush) is not None


def _pipedream_under_tie_rule(cost_graph: nx.DiGraph, cluster: Cluster, options: ModelOptions,
                              limit: float | None, straight: bool, prepared: Any,
                              nodes_and_ranks: Any, refused: list[tuple[list[str],
                                                                        tuple[int, ...]]],
                              ) -> tuple[Any, list[tuple[list[str], tuple[int, ...]]]]:
    """The pipedream DP's best plan whose stages sharing a tie hold equal replicas, for a
    streaming schedule where its optimum `refused` does not (the runtime refuses that one):
    on one level, the DP again under the rule for every choice of the tie-splitting stages'
    replica counts (`dp.pipedream_dp` `tie_counts`, as the native DP searches per count,
    TIE_CHOICES at most, those of `refused` first), the lowest objective kept; on several
    levels (the recurrence nests the levels' replica counts), the refused plan's cuts with
    the tied stages set equal (planner/tie_repair.py), priced by the model. PlanError where
    no plan keeps the rule within the memory."""
    import itertools

    from pdcompile.cost.ties import tie_owners
    from pdcompile.planner.dp import TIE_CHOICES, DPResult, DPStage
    from pdcompile.planner.tie_repair import equalized

    flush = kind(options.schedule).flush
    best: tuple[float, Any, list[tuple[list[str], tuple[int, ...]]]] | None = None
    if len(cluster.levels) == 1:
        ties = sum(1 for owner in tie_owners(prepared.graph) if owner is not None)
        stage_of = {n: i for i, (nodes, _) in enumerate(refused) for n in nodes}
        near = sorted({len(refused[s][1]) for tie in shared_weights(cost_graph, stage_of)
                       for s in tie.stages})
        widths = [1] if straight else list(range(1, cluster.workers + 1))
        choices = [(w,) * ties for w in near if w in widths]
        choices += [c for c in itertools.product(widths, repeat=ties) if c not in choices]
        for counts in choices[:TIE_CHOICES]:
            try:
                found = solve(prepared, cluster, options, limit, straight, tie_counts=counts)
            except PlanError:
                continue
            stages = nodes_and_ranks(found)
            if _stages_update_apart(cost_graph, stages, options.schedule):
                continue  # a tie the DP's states see as unsplit (a removed reader)
            if best is None or found.objective < best[0]:
                best = (found.objective, found, stages)
    else:
        for stages in equalized(cost_graph, refused, cluster.workers, flush=flush):
            priced, objective = evaluate(cost_graph, stages, cluster, options=options)
            if limit is not None and any(s.memory > limit * (1 + 1e-12) for s in priced):
                continue
            if best is None or objective < best[0]:
                best = (objective, DPResult(stages=tuple(
                    DPStage(0, 0, tuple(ranks)) for _, ranks in stages), objective=objective),
                    [(list(nodes), tuple(ranks)) for nodes, ranks in stages])
    if best is None:
        raise PlanError(
            f"no {options.schedule!r} plan of {cost_graph.graph.get('name') or 'the model'} "
            f"on {cluster.workers} workers keeps the stages sharing a tied parameter on equal "
            "replicas within the memory under cost_model='pipedream'; use a flush schedule "
            "(schedule='1f1b-flush'), more memory per worker, or cost_model='native'")
    return best[1], best[2]


def _plan_mixed(cost_graph: nx.DiGraph, cluster: Cluster, choices: list[tuple[str, int]], *,
                planner: str, cost_model: str, straight: bool, memory: float | str | None,
                time_limit: float | None, schedule: str, microbatches: int | None,
                stages: int | None, simulate: bool | None, optimizer_state: float,
                started: float, cache: SearchCache) -> Plan:
    """`plan` on a mixed cluster (planner/mixed.py), with this module's planner and pricing."""
    from functools import partial

    from pdcompile.planner.mixed import plan_mixed

    if cost_model != "native":
        raise PlanError("the pipedream cost model knows one kind of device; plan a mixed "
                        f"cluster ({cluster.describe()}) with cost_model='native'")
    if stages is not None:
        raise PlanError("stages= places straight stages on the first ranks; on a mixed cluster "
                        "let the planner place them (leave stages out, or pass straight=True)")
    result = plan_mixed(cost_graph, cluster, homogeneous=partial(plan, cache=cache),
                        pricer=partial(price_plan, simulate=simulate, cache=cache),
                        schedules=choices, memory=memory, optimizer_state=optimizer_state,
                        straight=straight, cache=cache, planner=planner,
                        time_limit=time_limit, schedule=schedule, microbatches=microbatches,
                        simulate=simulate)
    # a homogeneous sub-plan's words on its workers left idle are about another cluster
    extra = {k: v for k, v in result.extra.items() if k != "idle_workers"}
    return replace(result, extra=extra, solve_seconds=time.perf_counter() - started)


# ------------------------------------------------------------------------------ helpers
def _memory(memory: float | str | None, cluster: Cluster, cost_model: str) -> float | None:
    """Bytes per worker: `memory`, else the device's; on a mixed cluster the largest device's,
    and each rank is held to its own device's below that (`rank_memory`)."""
    if memory is None:
        if cost_model == "pipedream":
            return None
        if cluster.is_mixed:
            return float(max(g.device.memory for g in cluster.groups))
        return float(cluster.device.memory)
    try:
        value = parse_quantity(memory, "bytes")
    except (ValueError, TypeError) as err:
        raise PlanError(f"memory {memory!r}: {err}") from None
    if not value > 0 or math.isinf(value):
        raise PlanError(f"memory per worker must be a positive number of bytes (got {memory!r}); "
                        "write e.g. memory='16GiB'")
    return value


def _straight_fits(work: nx.DiGraph, cluster: Cluster, limit: float | None) -> None:
    """cost_model="pipedream" with straight=True gives every worker a stage of its own: refuse
    up front, in one line, a cluster with more workers than the graph has nodes or than
    the DP's state budget (dp_search.pipedream_budget) allows stages."""
    levels = tuple(level.workers for level in cluster.levels)
    budget = pipedream_budget(levels, straight=True, memory=limit is not None)
    nodes = work.number_of_nodes()
    most = min(nodes, budget - 1)
    if cluster.workers > most:
        why = (f"the graph has only {nodes} nodes" if nodes <= budget - 1 else
               f"on this cluster its DP plans a graph of {nodes} nodes in at most "
               f"{budget - 1} stages (the state budget that bounds its time and memory)")
        raise PlanError(
            f"cost_model='pipedream' with straight=True gives each of the {cluster.workers} "
            f"workers a stage of its own, but {why}; use cost_model='native' (its straight "
            f"pipelines may leave workers out) or a cluster of at most {most} workers")


def _schedule_refusal(choices: list[tuple[str, int]], workers: int) -> str | None:
    """Why the one schedule asked for cannot run its microbatches on `workers` workers, in the
    schedule's words (DualPipeV needs 2 per rank); None where it can, or several were tried."""
    if len({name for name, _ in choices}) != 1:
        return None
    from pdcompile.schedule.generators import generate
    from pdcompile.schedule.placement import v_position

    name, m = choices[0]
    row = kind(name)
    if row.v_shape:
        ranks: list[list[int]] = [[v_position(c, workers)] for c in range(2 * workers)]
    elif row.interleaved:
        ranks = [[c % workers] for c in range(2 * workers)]
    else:
        ranks = [[r] for r in range(workers)]
    try:
        generate(name, ranks, m)
    except ScheduleError as err:
        return f"schedule={name!r} with microbatches={m} on {workers} workers: {err}"
    return None


def _no_fit(graph: nx.DiGraph, cluster: Cluster, options: ModelOptions, limit: float | None,
            straight: bool) -> PlanError:
    """The error for a model that fits no plan: the memory or the workers that would fit.
    Each cluster's states are prepared once for the ~30 probes of the search (they depend on
    the workers, not on the memory tried; prepared anew per probe, a 2,000-node graph took
    93% of a refusal's time here)."""
    from pdcompile.planner.dp import state_tables, unit_bounds

    work, _ = planning_graph(graph, options.cost_model)
    native = options.cost_model == "native"
    prepared_for: dict[tuple[int, ...], tuple[Prepared, float]] = {}

    def prepared(c: Cluster) -> tuple[Prepared, float]:
        """The cluster's states and the memory below which no DP on them fits (0: unknown)."""
        levels = tuple(level.workers for level in c.levels)
        if levels not in prepared_for:
            if options.cost_model == "pipedream":  # its budget: the cluster's, with memory
                ready = prepare(work, "pipedream", c.workers, straight=straight,
                                levels=levels, memory=True)
            else:
                ready = prepare(work, options.cost_model, c.workers)
            least = 0.0
            if native:
                tables = state_tables(ready.graph, ready.states, ready.pinned)
                # the DP's stages: at most one per unit of workers
                units = len(unit_bounds(c.workers, straight=straight)) - 1
                least = least_memory(tables.params, tables.keep, tables.valid, units,
                                     options, floor=floor.on(c.workers))
            prepared_for[levels] = (ready, least)
        return prepared_for[levels]

    def fits(c: Cluster, mem: float) -> bool:
        ready, least = prepared(c)
        if mem <= least:  # proven without the DP: no chain of its states fits
            return False
        try:
            solve(ready, c, options, mem, straight)
            return True
        except PlanError:
            return False

    floor = node_floor(work, options) if native else None
    largest = floor.largest if floor is not None else 0.0
    total = floor.total if floor is not None else 0.0
    lo, hi = 0.0, float(limit or 1.0)
    if floor is not None:
        # nothing fits at or below the relaxation's bound: start just above it (where the
        # DP's plans need no more than the relaxation, one solve finds the figure)
        least = prepared(cluster)[1]
        start = max(floor.on(cluster.workers), least * (1 + 2e-4))
        if start > hi:
            lo, hi = max(least, floor.on(cluster.workers) * (1 - 1e-12)), start
    while not fits(cluster, hi) and hi < 1e18:
        lo, hi = hi, hi * 2
    for _ in range(14):  # to 1 part in 1,000 of the figure (at most 1 in 16,000 of the range)
        if hi - lo <= hi * 1e-3:
            break
        mid = (lo + hi) / 2
        if fits(cluster, mid):
            hi = mid
        else:
            lo = mid
    need_memory = hi
    if limit is not None and need_memory <= limit:  # the memory is not why: say so
        row, m, workers = kind(options.schedule), options.per_minibatch, cluster.workers
        rounds = ""
        if (row.interleaved or row.split_backward) and not row.v_shape and m >= workers \
                and m % workers:  # what _priced refuses: say which counts it takes
            rounds = (f" ({options.schedule!r} takes microbatches in rounds of one per worker: "
                      f"give a multiple of {workers}, e.g. microbatches={m + workers - m % workers}"
                      f", or fewer than {workers})")
        return PlanError(
            f"no {options.schedule!r} plan of {graph.graph.get('name') or 'the model'} with "
            f"microbatches={options.microbatches} on {workers} workers, though it fits "
            f"{format_bytes(limit)} per worker{rounds}; try schedule='auto' or another "
            "microbatch count")
    more, tried = None, cluster.workers
    for factor in range(2, 9):
        outer = cluster.levels[-1]
        bigger = replace(cluster, levels=cluster.levels[:-1] + (
            replace(outer, workers=outer.workers * factor),))
        if bigger.workers > 4096 or largest > float(limit or 0.0):
            break  # (the largest node alone exceeds the limit: no number of workers fits)
        tried = bigger.workers
        if total / bigger.workers > float(limit or 0.0):
            continue  # the floor says no: not worth a solve
        if fits(bigger, float(limit or 0.0)):
            more = bigger.workers
            break
    name = graph.graph.get('name') or 'the model'
    has = format_bytes(limit or 0)
    other = _other_schedule_fits(work, prepared(cluster)[0], cluster, options, limit, straight)
    instead = (f"; schedule={other[0]!r} with microbatches={other[1]} fits it on these "
               f"{cluster.workers} workers" if other is not None else "")
    if more is not None:
        how = f"at least {more} workers"
    elif tried > cluster.workers:  # what the loop tried, not a promise that more would fit
        how = f"none of the bigger clusters tried, up to {tried} workers, fits"
    else:
        how = None
    if more is None and largest > float(limit or 0.0) and floor is not None:
        if floor.node_weights + floor.node_activations >= floor.inputs:
            culprit = (f"its node {floor.node!r} alone needs "
                       f"{_bytes_up(floor.node_weights + floor.node_activations)} "
                       f"({_bytes_up(floor.node_weights)} of weights, gradients and optimizer "
                       f"state, {_bytes_up(floor.node_activations)} of one microbatch's kept "
                       "activations)")
            heavy = floor.node_activations > floor.node_weights
        else:
            culprit = (f"its inputs, which sit together on the first stage, need "
                       f"{_bytes_up(floor.inputs)} of one microbatch's activations")
            heavy = True
        fix = ("more microbatches per minibatch or a smaller minibatch (activations dominate), "
               "or memory=... / --memory" if heavy else
               "memory=... / --memory, or a smaller layer there (weights dominate)")
        return PlanError(
            f"{name} does not fit {has} per worker under any plan with schedule="
            f"{options.schedule!r} on any number of workers: "
            f"{culprit}, more than a worker's {has} (on these {cluster.workers} workers it "
            f"needs {_bytes_up(need_memory)} per worker){instead}; fix: "
            f"{'another schedule, ' if other is not None else ''}{fix}")
    together = (f"its nodes together need {_bytes_up(total)}, " if floor is not None
                and total / cluster.workers > float(limit or 0.0) else "")
    bigger_cluster = (f", or {how} with {has} each" if more is not None
                      else f" (with {has} each, {how})" if how is not None else "")
    return PlanError(
        f"{name} does not fit {has} per worker on {cluster.workers} workers under any "
        f"plan with schedule={options.schedule!r}; {together}it needs "
        f"{_bytes_up(need_memory)} per worker on this cluster{bigger_cluster}{instead} "
        "(pass memory=... / --memory, "
        f"{'another schedule, ' if other is not None else ''}or a bigger cluster)")


def _other_schedule_fits(work: nx.DiGraph, ready: Prepared, cluster: Cluster,
                         options: ModelOptions, limit: float | None,
                         straight: bool) -> tuple[str, int] | None:
    """The first schedule of `AUTO_SCHEDULES` (one stage per rank, the user's microbatches
    or those "auto" tries) other than the refused one whose plan fits `limit` on `cluster`:
    one DP solve each on the states already prepared, after the node floor. A refusal of
    schedule='1f1b' (one microbatch per minibatch, a stage keeping one in flight per later
    stage) said only "more workers" where '1f1b-flush' fit on the same workers."""
    if options.cost_model != "native" or limit is None:
        return None
    given = options.microbatches if kind(options.schedule).microbatched else None
    for name in AUTO_SCHEDULES:
        row = kind(name)
        if name == options.schedule or row.interleaved or row.v_shape:
            continue
        counts = [1] if not row.microbatched else [given] if given else list(AUTO_MICROBATCHES)
        for m in counts:
            other = replace(options, schedule=name, microbatches=m)
            if node_floor(work, other).on(cluster.workers) > limit * (1 + SLACK):
                continue
            try:
                solve(ready, cluster, other, limit, straight)
            except PlanError:
                continue
            return name, m
    return None


def _bytes_up(value: float) -> str:
    """Bytes in GiB/MiB with two decimals, rounded up (so that the figure shown suffices)."""
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if value >= scale:
            return f"{math.ceil(value / scale * 100) / 100:.2f} {unit}"
    return f"{math.ceil(value)} B"


__all__ = ["AUTO_SCHEDULES", "MOST_MIXED_WORKERS", "MOST_WORKERS", "PLANNERS", "check_plannable",
           "plan", "price_plan"]
