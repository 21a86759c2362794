"""Plans for mixed clusters: stages placed on device groups by their speed and memory.

A CostGraph holds the reference device's times (`Cluster.device`); a rank of a mixed cluster
computes at `Cluster.speed_of(rank)` times that speed. The candidates, every one priced on the
mixed cluster itself by `price_plan` (the simulator where a simulation is cheap):

- each device group alone (`group_alone`): the homogeneous planner on the group, with the
  CostGraph's times divided by the group's speed, its ranks mapped onto the group's (this and
  the next two without CP-SAT where the homogeneous planner's DP is exact, `seeding`);
- the whole model on one rank of each group, the others idle (`_one_rank_each_group`), where
  sharing the work costs more in all-reduces and transfers than it saves;
- the whole cluster as if every device were the slowest (`as_slowest`): the homogeneous planner
  on the cluster with the slowest group's device, the times divided by its speed;
- the whole cluster as if every device had the mean speed (`as_mean`), its replicas given
  shares in proportion to their speed;
- data parallelism over every rank (`data_parallel`), with shares in proportion to speed;
- the plans as slowest and at the mean speed with their ranks dealt out again over their
  stages (`dealt_by_work`: the slowest stage's compute least; `dealt_in_proportion`: each
  stage a share of every group as large as its replicas'), for in rank order each of their
  stages sits on one kind;
- every candidate above and below whose ranks lie in one server with the same pipeline on
  every server (`on_every_server`: stage i on the same places of each server, replicas
  all-reducing across them), which gives each stage one rank of each kind where the groups
  are servers;
- every candidate above and below again with shares in proportion to speed where a stage's
  replicas mix kinds (`with_shares`, cost/shares.py: a faster replica takes more of each
  round, so the stage runs at its replicas' combined speed rather than the slowest's);
- pipelines across the groups (`_across_groups`): a dynamic program over a topological order of
  the (coarsened) graph that cuts it into stages, each on r consecutive ranks of one group,
  visiting the groups in every order, that minimises the slowest stage's time (its compute at
  its group's speed over its replicas, their all-reduce and step, the link into it) where the
  stage's weights fit its device (a tied parameter's copy on each later holder counted,
  cost/ties.py). A stage may also take the rest of one group and the first ranks of the next
  (replicas of two kinds), priced at their shared speed with shares in proportion to speed
  (`cost/shares.py`; `with_shares` then gives the plan those shares). A stage's link term
  counts the cut's bytes once (activations one way, their gradients the other, each at the
  link's rate, as the pricing does);
- one rank per stage with the groups in any order, coming back to a group (fast, slow, fast:
  `_straight_any_order`), which the pipelines across the groups, visiting each group once,
  leave out.

The fastest candidate that fits every rank's memory is then refined by planner/refine.py's
local search by simulation (asynchronous 1F1B over every worker), which moves boundaries and
replicas where the slower ranks hold a plan back. Last, the fastest few pipelines (the refined
one included) each descend over their stages' rank sets (planner/rank_moves.py: swap two
stages' ranks, exchange ranks of two kinds, move one rank), which places a stage with
parameters alone on a fast rank and the heavy stage without them on the rest, an arrangement
in no rank order. The fastest of all is the plan. On clusters of more than DESCENT_WORKERS
workers both descents are left out (their steps grow with the workers; the candidates and
their pricing stay bounded), and the planner plans at most MOST_MIXED_WORKERS (search.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import networkx as nx

from pdcompile.cost.costgraph import coarsen, edge_bytes, topological_order
from pdcompile.cost.crossing import input_nodes
from pdcompile.cost.links import ring_allreduce_seconds
from pdcompile.cost.memory import OPTIMIZER_STATE
from pdcompile.cost.shares import proportional_shares, round_shares, shared_speed
from pdcompile.cost.ties import shared_weights, tie_readers, updates_apart
from pdcompile.cost.updates import step_seconds
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.machine.device import Device
from pdcompile.plan import Plan, Stage
from pdcompile.planner.search_cache import SearchCache
from pdcompile.schedule.kinds import kind

BLOCKS = 40  # the DP cuts a graph coarsened to at most this many blocks
REFINE_EVALUATIONS = 240  # simulations of the local search from the best candidate
RANK_EVALUATIONS = 32  # simulations of the descents over stages' rank sets, all seeds together
RANK_SEEDS = 3  # the fastest pipelines (distinct stages' nodes) those descents start from
# above this many workers neither descent runs: each step prices every neighbour, whose closed
# form (the circuits of the replicas' rounds) and simulation grow with the workers; on VGG-16
# over 32 A100 and 32 V100 the local search took 400 s and the descents over rank sets 30-150 s
# of a planning call that takes 30 s without them
DESCENT_WORKERS = 32
Stages = list[tuple[list[str], tuple[int, ...]]]
Pricer = Callable[..., Plan]
Planner = Callable[..., Plan]


def scaled_graph(graph: nx.DiGraph, speed: float) -> nx.DiGraph:
    """`graph` with its forward and backward times divided by `speed` (times on a device that
    many times faster than the reference)."""
    out = graph.copy()
    for _, data in out.nodes(data=True):
        data["fwd"] = float(data["fwd"]) / speed
        data["bwd"] = float(data["bwd"]) / speed
        if "wgrad" in data:
            data["wgrad"] = float(data["wgrad"]) / speed
    return out


def group_alone(graph: nx.DiGraph, cluster: Cluster, group: int, *, homogeneous: Planner,
                **options: Any) -> Plan:
    """The homogeneous planner's plan on device group `group` alone, its ranks moved onto the
    group's ranks of `cluster` (not yet priced on the mixed cluster)."""
    alone = cluster.group_cluster(group)
    made = homogeneous(scaled_graph(graph, cluster.group_speed(group)), alone, **options)
    return _shifted(made, cluster.group_ranks(group).start)


def as_slowest(graph: nx.DiGraph, cluster: Cluster, *, homogeneous: Planner,
               **options: Any) -> Plan:
    """The homogeneous planner's plan on every rank of `cluster` as if each had the slowest
    group's device and speed (not yet priced on the mixed cluster)."""
    slowest = min(range(len(cluster.groups)), key=cluster.group_speed)
    flat = replace(cluster, groups=(), device=cluster.groups[slowest].device)
    return homogeneous(scaled_graph(graph, cluster.group_speed(slowest)), flat, **options)


def as_mean(graph: nx.DiGraph, cluster: Cluster, *, homogeneous: Planner,
            **options: Any) -> Plan:
    """The homogeneous planner's plan on every rank of `cluster` as if each computed at the
    mean speed of all (memory and updates the slowest group's device's): the plan to give
    proportional shares (`with_shares`), where a stage on every kind runs at their mean."""
    slowest = min(range(len(cluster.groups)), key=cluster.group_speed)
    mean = sum(cluster.speed_of(r) for r in range(cluster.workers)) / cluster.workers
    flat = replace(cluster, groups=(), device=cluster.groups[slowest].device)
    return homogeneous(scaled_graph(graph, mean), flat, **options)


def with_shares(plan: Plan, cluster: Cluster) -> Plan | None:
    """`plan` with each stage whose replicas differ in speed giving them shares in proportion
    (`cost/shares.py`: a flush schedule's microbatches, `proportional_shares`; a round of
    asynchronous 1F1B, `round_shares`); None where no stage changes or the schedule does not
    take shares (interleaved, zero bubble, 2BW)."""
    row = kind(plan.schedule)
    if row.chunked or row.microbatched_stream:
        return None
    stages, changed = [], False
    for stage in plan.stages:
        speeds = [cluster.speed_of(r) for r in stage.ranks]
        counts: tuple[int, ...] = ()
        if stage.replicas > 1 and max(speeds) > min(speeds) * (1 + 1e-9):
            counts = proportional_shares(speeds, max(plan.microbatches, stage.replicas)) \
                if row.flush else round_shares(speeds)
            if len(set(counts)) == 1:
                counts = ()
        changed = changed or counts != stage.shares
        stages.append(replace(stage, shares=counts, in_flight=0))
    if not changed:
        return None
    return replace(plan, stages=tuple(stages), extra={})


def dealt_by_work(plan: Plan, cluster: Cluster, graph: nx.DiGraph) -> Plan | None:
    """`plan` with the ranks it uses dealt out again over its stages, each stage keeping its
    replica count, so that the slowest stage's compute (its work over the sum of its ranks'
    speeds, as with shares in proportion) is least; each stage takes consecutive ranks of a
    group (on as few servers as may be), stages in order. None where no stage changes.

    The homogeneous planner's plan for the cluster at its mean speed (`as_mean`) balances its
    stages as if each replica computed at the mean; in rank order its stages sit on one kind
    each (8-8 over 8 fast and 8 slow ranks: the second stage all slow), and only dealt out
    (4 fast and 4 slow each, with shares) does each stage run at the mean it was cut for.
    Where the counts cannot be even (3-1 over 2 fast and 2 slow) the work decides which stage
    gets the faster ranks: a single-replica stage on a fast rank, the other on the rest."""
    pools: dict[int, list[int]] = {}
    for r in sorted({r for s in plan.stages for r in s.ranks}):
        pools.setdefault(cluster.group_of(r), []).append(r)
    if len(pools) < 2:
        return None
    groups = sorted(pools)
    speed = [cluster.group_speed(g) for g in groups]
    work = [sum(float(graph.nodes[n]["fwd"]) + float(graph.nodes[n]["bwd"])
                for n in s.nodes if n in graph) for s in plan.stages]
    Left = tuple[int, ...]
    # best[(i, left)]: (slowest stage time, sum of stage times) over stages i.., with `left`
    # ranks of each group still free, and the counts of stage i
    memo: dict[tuple[int, Left], tuple[tuple[float, float], tuple[int, ...]] | None] = {}

    def best(i: int, left: Left) -> tuple[tuple[float, float], tuple[int, ...]] | None:
        if i == len(plan.stages):
            return ((0.0, 0.0), ()) if not any(left) else None
        key = (i, left)
        if key in memo:
            return memo[key]
        found: tuple[tuple[float, float], tuple[int, ...]] | None = None
        for counts in _compositions_within(plan.stages[i].replicas, left):
            rest = best(i + 1, tuple(x - c for x, c in zip(left, counts, strict=True)))
            if rest is None:
                continue
            time = work[i] / sum(c * v for c, v in zip(counts, speed, strict=True))
            value = (max(time, rest[0][0]), time + rest[0][1])
            if found is None or value < found[0]:
                found = (value, counts)
        memo[key] = found
        return found

    left: Left = tuple(len(pools[g]) for g in groups)
    if best(0, left) is None:
        return None
    taken = [0] * len(groups)
    stages = []
    for i, stage in enumerate(plan.stages):
        found = best(i, left)
        assert found is not None
        ranks: list[int] = []
        for k, (g, c) in enumerate(zip(groups, found[1], strict=True)):
            ranks += pools[g][taken[k]:taken[k] + c]
            taken[k] += c
        left = tuple(x - c for x, c in zip(left, found[1], strict=True))
        stages.append(replace(stage, ranks=tuple(ranks), shares=(), in_flight=0))
    if all(a.ranks == b.ranks for a, b in zip(stages, plan.stages, strict=True)):
        return None
    return replace(plan, stages=tuple(stages), extra={})


def dealt_in_proportion(plan: Plan, cluster: Cluster) -> Plan | None:
    """`plan` with the ranks it uses dealt out again so that every stage takes each device
    group's ranks in proportion to its replicas (largest remainders first), each stage's ranks
    of a group consecutive, stages in order; None where no stage changes. Where the stages'
    work is even, this is `dealt_by_work`'s deal; where it is not, the servers the stages'
    all-reduces and sends cross may still favour it, and the simulator decides."""
    pools: dict[int, list[int]] = {}
    for r in sorted({r for s in plan.stages for r in s.ranks}):
        pools.setdefault(cluster.group_of(r), []).append(r)
    if len(pools) < 2:
        return None
    left = {g: len(p) for g, p in pools.items()}
    taken = {g: 0 for g in pools}
    stages = []
    for stage in plan.stages:
        total = sum(left.values())
        ideal = {g: stage.replicas * left[g] / total for g in pools}
        counts = {g: math.floor(ideal[g]) for g in pools}
        by_remainder = sorted(pools, key=lambda g: (counts[g] - ideal[g], g))
        for g in by_remainder[:stage.replicas - sum(counts.values())]:
            counts[g] += 1
        ranks: list[int] = []
        for g in sorted(pools):
            ranks += pools[g][taken[g]:taken[g] + counts[g]]
            taken[g] += counts[g]
            left[g] -= counts[g]
        stages.append(replace(stage, ranks=tuple(ranks), shares=(), in_flight=0))
    if all(a.ranks == b.ranks for a, b in zip(stages, plan.stages, strict=True)):
        return None
    return replace(plan, stages=tuple(stages), extra={})


def _compositions_within(total: int, most: Sequence[int]) -> list[tuple[int, ...]]:
    """Ways to write `total` as a sum of len(most) counts, each at most its `most`."""
    if len(most) == 1:
        return [(total,)] if total <= most[0] else []
    return [(c, *rest) for c in range(min(total, most[0]) + 1)
            for rest in _compositions_within(total - c, most[1:])]


def on_every_server(plan: Plan, cluster: Cluster) -> Plan | None:
    """`plan`, whose ranks all lie in one server, with the same pipeline on every server: stage
    i on the same places of each, its replicas all-reducing across the servers (what the
    homogeneous planner does above 16 workers). From one group's plan where the groups are
    servers, it gives each stage one rank of each kind: a 2-stage chain on two servers of a
    fast pair and a slow pair ran 2-2 over (0, 2), (1, 3) with shares 2:1 at 6.02 ms, where the
    best candidate before was data parallelism at 6.67 ms. None where the cluster has one
    server or the plan spans several."""
    if len(cluster.levels) < 2 or not plan.stages:
        return None
    servers = cluster.levels[-1].workers
    per = cluster.workers // servers
    used = {r // per for s in plan.stages for r in s.ranks}
    if len(used) != 1:
        return None
    stages = tuple(replace(s, replicas=s.replicas * servers, shares=(), in_flight=0,
                           ranks=tuple(k * per + r % per for k in range(servers)
                                       for r in s.ranks))
                   for s in plan.stages)
    return replace(plan, stages=stages, workers=servers * per, extra={})


def data_parallel(graph: nx.DiGraph, cluster: Cluster, *, schedule: str,
                  microbatches: int) -> Plan:
    """Every node in one stage replicated on every rank of `cluster` (its shares by speed come
    from `with_shares`): the homogeneous planner weighs data parallelism against its pipelines
    but hands back only its best, and on a mixed cluster priced in rank order."""
    order = topological_order(graph)
    ranks = tuple(range(cluster.workers))
    return Plan(stages=(Stage(tuple(order), len(ranks), ranks),), time_per_minibatch=0.0,
                dp_time=0.0, workers=len(ranks), schedule=schedule, microbatches=microbatches)


def seeding(homogeneous: Planner) -> Planner:
    """`homogeneous` for the sub-plans: under planner="auto" the DP's plan where the DP is
    exact (status "OPTIMAL": every downset of the graph a state, its objective minimised over
    every cut), else the plan of "auto" with its CP-SAT run; any other planner as asked.

    Why: the sub-plans are seeds, each priced again on the mixed cluster, dealt out, given
    shares and descended from by simulation; CP-SAT's part in "auto" is to certify the DP's
    plan or to find a cut the DP's states leave out. Where the DP is exact there is none to
    find: on VGG-16 over 8 A100 and 8 V100 its four runs (each group alone, the cluster as its
    slowest and at its mean speed) returned the DP's plan unchanged and took 8.9 s of a 21 s
    planning call (two stopped at their deterministic limit, 1.4% from their bound). Where it
    is not (GNMT's DP cuts prefixes of one topological order) CP-SAT's cut of the cluster as
    its slowest (15.0 ms against the DP's 15.3 on mixed-A) is the seed of the plan, 12.9 ms
    against 15.2 without it."""
    def planned(graph: nx.DiGraph, cluster: Cluster, **options: Any) -> Plan:
        if options.get("planner", "auto") != "auto":
            return homogeneous(graph, cluster, **options)
        exact = homogeneous(graph, cluster, **(options | {"planner": "dp"}))
        if exact.status == "OPTIMAL":
            return exact
        return homogeneous(graph, cluster, **options)

    return planned


def _one_rank_each_group(graph: nx.DiGraph, cluster: Cluster,
                         schedules: Sequence[tuple[str, int]]) -> list[tuple[str, Plan]]:
    """The whole model on one rank of each group, the others idle: where a tied or heavy
    model's all-reduces and transfers over a slow network cost more than the work they share,
    one fast rank alone beats every plan on more of them (a tied chain on 2 fast and 2 slow
    ranks over 1 GB/s: 52.2 ms alone, 61.4 ms for the best plan on all four)."""
    name, m = next(((n, k) for n, k in schedules if not kind(n).chunked), schedules[0])
    nodes = list(topological_order(graph))
    return [(f"one rank of group {group}",
             _as_plan([(nodes, (cluster.group_ranks(group).start,))], name, m))
            for group in range(len(cluster.groups))]


def _shifted(plan: Plan, start: int) -> Plan:
    stages = tuple(replace(s, ranks=tuple(r + start for r in s.ranks)) for s in plan.stages)
    return replace(plan, stages=stages)


def plan_mixed(graph: nx.DiGraph, cluster: Cluster, *, homogeneous: Planner, pricer: Pricer,
               schedules: Sequence[tuple[str, int]], memory: float | str | None,
               optimizer_state: float = OPTIMIZER_STATE, straight: bool = False,
               refine: int = REFINE_EVALUATIONS, rank_moves: int = RANK_EVALUATIONS,
               cache: SearchCache | None = None, **options: Any) -> Plan:
    """The best plan for a mixed cluster (module docstring). `homogeneous(graph, cluster, ...)` is
    the homogeneous planner and `pricer(graph, plan, cluster, ...)` prices a plan on a
    cluster (search.plan and search.price_plan, handed in so that this module stays below
    them); `schedules`: the (schedule, microbatches) pairs to cut pipelines for; `options`
    go to the homogeneous planner. `straight`: one worker per stage. `refine`: simulations
    the local search from the best candidate may spend (0: none); `rank_moves`: pricings the
    descent over the stages' rank sets may spend (`_rank_sets_rearranged`; 0: none).
    `cache`: the search's schedules (planner/search_cache.py), for the local search's
    simulations; `homogeneous` and `pricer` come bound to the same one."""
    if not cluster.is_mixed:
        raise PlanError("plan_mixed plans for a mixed cluster; this one has one kind of device")
    homogeneous = seeding(homogeneous)
    pricer = _runnable_only(pricer)
    made: list[tuple[str, Plan]] = []
    for group in range(len(cluster.groups)):
        try:
            made.append((f"group {group} alone", group_alone(
                graph, cluster, group, homogeneous=homogeneous, memory=memory,
                optimizer_state=optimizer_state, straight=straight, **options)))
        except PlanError:
            pass
    made += _one_rank_each_group(graph, cluster, schedules)
    try:
        made.append(("as slowest", as_slowest(graph, cluster, homogeneous=homogeneous,
                                              memory=memory, optimizer_state=optimizer_state,
                                              straight=straight, **options)))
    except PlanError:
        pass
    mean: list[tuple[str, Plan]] = []
    if not straight:
        try:
            mean.append(("as the mean speed", as_mean(
                graph, cluster, homogeneous=homogeneous, memory=memory,
                optimizer_state=optimizer_state, straight=straight, **options)))
        except PlanError:
            pass
    for name, m in schedules:
        row = kind(name)
        if row.interleaved or row.v_shape:
            continue  # chunks of one worker each: the group-alone plans cover these
        for order in itertools.permutations(range(len(cluster.groups))):
            for most in (1, None) if not (row.split_backward or straight) else (1,):
                stages = _across_groups(graph, cluster, order, name=name, microbatches=m,
                                        most_replicas=most, optimizer_state=optimizer_state)
                if stages is not None:
                    made.append((f"across groups {order}", _as_plan(stages, name, m)))
        if not row.split_backward:
            stages = _across_groups(graph, cluster, None, name=name, microbatches=m,
                                    most_replicas=1, optimizer_state=optimizer_state)
            if stages is not None:
                made.append(("one rank per stage, groups in any order",
                             _as_plan(stages, name, m)))
    if not straight:
        for name, m in schedules:
            if not (kind(name).chunked or kind(name).microbatched_stream):
                mean.append((f"data parallel {name}", data_parallel(
                    graph, cluster, schedule=name, microbatches=m)))
    dealt: list[tuple[str, Plan]] = []
    for how, c in made + mean:
        if how not in ("as slowest", "as the mean speed"):
            continue
        for deal, d in (("by work", dealt_by_work(c, cluster, graph)),
                        ("in proportion", dealt_in_proportion(c, cluster))):
            if d is not None and all(d.stages != e.stages for _, e in dealt):
                dealt.append((f"{how}, dealt {deal}", d))
    made += [(f"{how}, on every server", e) for how, c in list(made)
             if (e := on_every_server(c, cluster)) is not None]
    made += _tie_equalized(graph, cluster, made + mean + dealt)
    shared = [(f"{how}, shares by speed", s) for how, c in made + mean + dealt
              if (s := with_shares(c, cluster)) is not None]
    priced: list[tuple[str, Plan]] = []
    for how, candidate in made + shared:
        try:
            plan = pricer(graph, candidate, cluster, memory=memory,
                          optimizer_state=optimizer_state)
        except PlanError:
            continue
        if plan.extra.get("fits", True):
            priced.append((how, plan))
    if not priced:
        raise PlanError(f"no plan fits the memory of {cluster.describe()}: each device group "
                        "alone, the cluster as its slowest device and pipelines across the "
                        "groups all exceed some rank's device; give more or larger devices, "
                        "or a smaller minibatch")
    how, best = min(priced, key=lambda item: item[1].time_per_minibatch)
    descents = not straight and cluster.workers <= DESCENT_WORKERS
    refined = _refined(graph, cluster, best, pricer=pricer, memory=memory,
                       optimizer_state=optimizer_state,
                       evaluations=refine if descents else 0, cache=cache)
    if refined is not None:
        priced.append((f"refined {how}", refined))
        if refined.time_per_minibatch < best.time_per_minibatch:
            how, best = f"refined {how}", refined
        shared_refined = with_shares(refined, cluster)
        if shared_refined is not None:
            try:
                again: Plan | None = pricer(graph, shared_refined, cluster, memory=memory,
                                            optimizer_state=optimizer_state)
            except PlanError:
                again = None
            if again is not None and again.extra.get("fits", True):
                priced.append((f"refined {how}, shares by speed", again))
                if again.time_per_minibatch < best.time_per_minibatch:
                    how, best = f"refined {how}, shares by speed", again
    for how_r, rearranged in _rank_sets_rearranged(priced, cluster, graph=graph, pricer=pricer,
                                                    memory=memory,
                                                    optimizer_state=optimizer_state,
                                                    evaluations=rank_moves if descents
                                                    else 0):
        priced.append((how_r, rearranged))
        if rearranged.time_per_minibatch < best.time_per_minibatch:
            how, best = how_r, rearranged
    times: dict[str, float] = {}
    for h, p in priced:  # the best of each kind of candidate, for reports and benchmarks
        times[h] = min(times.get(h, math.inf), p.time_per_minibatch)
    ranking = [f"{h}: {p.config} {p.schedule} x{p.microbatches} "
               f"{p.time_per_minibatch * 1e3:.3f} ms"
               for h, p in sorted(priced, key=lambda item: item[1].time_per_minibatch)]
    return replace(best, planner="mixed", extra=best.extra | {
        "found_by": how, "mixed_candidates": ranking[:10], "mixed_times": times})


def ties_update_apart(graph: nx.DiGraph, plan: Plan) -> bool:
    """Whether `plan` puts a tied parameter on stages that update a different number of times,
    which a streaming schedule cannot run (cost/ties.py `updates_apart`): a replica updates
    once per round of its stage, `Stage.shares`' sum of microbatches where it has shares, else
    one per replica."""
    if not graph.graph.get("ties"):
        return False
    stage_of = plan.stage_of()
    if any(node not in stage_of for node in graph.nodes):
        return False  # stages over another graph's nodes: the simulator decides
    rounds = [sum(s.shares) if s.shares else s.replicas for s in plan.stages]
    return updates_apart(shared_weights(graph, stage_of), rounds,
                         kind(plan.schedule).flush) is not None


def _runnable_only(pricer: Pricer) -> Pricer:
    """`pricer` refusing (PlanError) a plan whose tied stages update apart: the simulator
    refuses it and the pricing would fall back to the closed form, so that a plan the runtime
    cannot run would compete with those it can (every candidate, the local search's result
    and the descents over rank sets are priced through it)."""
    def priced(graph: nx.DiGraph, plan: Plan, cluster: Cluster, **options: Any) -> Plan:
        if ties_update_apart(graph, plan):
            raise PlanError(f"plan {plan.config} updates the stages sharing a tied parameter "
                            "a different number of times")
        return pricer(graph, plan, cluster, **options)

    return priced


def _tie_equalized(graph: nx.DiGraph, cluster: Cluster,
                   candidates: Sequence[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """The candidates whose tied stages update apart, with their cuts kept and those stages
    set to one replica count each way planner/tie_repair.py `equalized` offers (their ranks
    then dealt out and given shares as any candidate's): the cuts are often good where only
    the replicas cannot run."""
    from pdcompile.planner.tie_repair import equalized

    out: list[tuple[str, Plan]] = []
    for how, plan in candidates:
        if not ties_update_apart(graph, plan):
            continue
        stages = [(list(s.nodes), s.ranks) for s in plan.stages]
        for fixed in equalized(graph, stages, cluster.workers, flush=kind(plan.schedule).flush):
            made = _as_plan(fixed, plan.schedule, plan.microbatches)
            if all(made.stages != p.stages for _, p in out):
                out.append((f"{how}, tied stages equalized", made))
    return out


def _refined(graph: nx.DiGraph, cluster: Cluster, best: Plan, *, pricer: Pricer,
             memory: float | str | None, optimizer_state: float,
             evaluations: int, cache: SearchCache | None) -> Plan | None:
    """The best candidate after planner/refine.py's local search by simulation (merge, split,
    move a replica or a boundary; ranks consecutive from 0, fast groups first), priced as the
    candidates are; None where it does not apply (asynchronous 1F1B over every worker only).
    The whole budget goes to the descent from the candidate: data parallelism over every rank
    is a candidate of its own (`data_parallel`), priced with its shares. One step of the
    descent looks at every neighbour (a hundred or more on GNMT's nine stages): on GNMT over
    mixed-A the candidate's first two steps (14.99 -> 14.53 -> 13.91 ms) take 240."""
    from pdcompile.planner.refine import refine_plan

    if evaluations < 1 or best.schedule != "1f1b" or best.workers != cluster.workers:
        return None
    try:
        plain = replace(best, stages=tuple(replace(s, shares=()) for s in best.stages))
        found = refine_plan(plain, graph, cluster, max_evaluations=evaluations,
                            from_data_parallel=False, cache=cache).plan
        plan = pricer(graph, replace(found, extra={}), cluster, memory=memory,
                      optimizer_state=optimizer_state)
    except PlanError:
        return None
    return plan if plan.extra.get("fits", True) else None


def _rank_sets_rearranged(priced: Sequence[tuple[str, Plan]], cluster: Cluster, *,
                          graph: nx.DiGraph, pricer: Pricer, memory: float | str | None,
                          optimizer_state: float, evaluations: int) -> list[tuple[str, Plan]]:
    """The fastest RANK_SEEDS pipelines among `priced` (each cut of the nodes once, schedules
    whose stages may sit on any ranks), each after planner/rank_moves.py's descent over its
    stages' rank sets on an equal part of `evaluations` pricings: the moves that weigh where
    a stage's parameters are against the ranks' speeds (a stage with parameters alone on a
    fast rank, the heavy stage without them on the rest)."""
    from pdcompile.planner.rank_moves import descend_rank_sets

    seeds: list[tuple[str, Plan]] = []
    for how, plan in sorted(priced, key=lambda item: item[1].time_per_minibatch):
        row = kind(plan.schedule)
        if len(plan.stages) < 2 or row.chunked or row.v_shape:
            continue
        if any([s.nodes for s in plan.stages] == [s.nodes for s in p.stages] for _, p in seeds):
            continue
        seeds.append((how, plan))
        if len(seeds) == RANK_SEEDS:
            break
    found = []
    for index, (how, plan) in enumerate(seeds):
        budget = evaluations // len(seeds) + (1 if index < evaluations % len(seeds) else 0)
        made = descend_rank_sets(
            plan, cluster, evaluations=budget, shares=lambda p: with_shares(p, cluster),
            price=lambda p: pricer(graph, p, cluster, memory=memory,
                                   optimizer_state=optimizer_state),
            screen=lambda p: pricer(graph, p, cluster, memory=memory,
                                    optimizer_state=optimizer_state, simulate=False))
        if made is not None:
            found.append((f"{how}, ranks rearranged", made))
    return found


def _as_plan(stages: Stages, schedule: str, microbatches: int) -> Plan:
    built = tuple(Stage(tuple(nodes), len(ranks), ranks) for nodes, ranks in stages)
    workers = max(r for _, ranks in stages for r in ranks) + 1
    return Plan(stages=built, time_per_minibatch=0.0, dp_time=0.0, workers=workers,
                schedule=schedule, microbatches=microbatches)


def _linear_order(graph: nx.DiGraph) -> tuple[nx.DiGraph, dict[str, list[str]], list[str]]:
    """The graph coarsened to at most BLOCKS blocks, the blocks' members, and a topological
    order of the blocks with the blocks holding inputs first (they must be in stage 0)."""
    if graph.number_of_nodes() > BLOCKS:
        coarse, members = coarsen(graph, target=BLOCKS)
    else:
        coarse, members = graph, {n: [n] for n in graph.nodes}
    inputs = set(input_nodes(graph))
    order = topological_order(coarse)
    first = [b for b in order if inputs & set(members.get(b, [b]))]
    return coarse, members, first + [b for b in order if b not in first]


def _across_groups(graph: nx.DiGraph, cluster: Cluster, order: Sequence[int] | None, *,
                   name: str, microbatches: int, most_replicas: int | None,
                   optimizer_state: float) -> Stages | None:
    """Stages cut from a topological order over the groups in `order` (module docstring):
    value[i][g][u] is the smallest slowest-stage time that places the first i blocks with
    groups order[:g] done and u ranks of group order[g] used. `order` None: one rank per
    stage, each stage on the next free rank of any group (`_straight_any_order`)."""
    coarse, members, blocks = _linear_order(graph)
    n = len(blocks)
    position = {b: i for i, b in enumerate(blocks)}
    work = [0.0]
    params = [0.0]
    for b in blocks:
        data = coarse.nodes[b]
        work.append(work[-1] + float(data["fwd"]) + float(data["bwd"]))
        params.append(params[-1] + float(data["params"]))
    copied = _tie_copies(graph, members, position)
    crossing = [0.0] * (n + 1)  # bytes from blocks before i to blocks at or after i
    for u, v in coarse.edges:
        for i in range(position[u] + 1, position[v] + 1):
            crossing[i] += edge_bytes(coarse, u, v)
    pinned = sum(1 for b in blocks if set(members.get(b, [b])) & set(input_nodes(graph)))
    row = kind(name)
    m = microbatches if row.microbatched else 1
    streaming = not row.microbatched

    speeds = [cluster.group_speed(group) for group in range(len(cluster.groups))]

    def stage_time(i: int, j: int, group: int, start: int, r: int) -> float:
        return ranks_time(i, j, list(range(start, start + r)), cluster.groups[group].device,
                          speeds[group])

    # what a stage's ranks alone decide (the level its all-reduce crosses, the link into it,
    # a straddle's shared speed), looked up once per DP rather than once per cut: on 64
    # workers the DP prices some 400,000 stages
    levels: dict[tuple[int, int, int], Level] = {}
    links: dict[int, float] = {}
    pair_links: dict[tuple[int, int], float] = {}

    def ranks_time(i: int, j: int, ranks: list[int], device: Device, speed: float,
                   previous: int | None = None) -> float:
        """The slowest-stage term of blocks i..j-1 on `ranks` of `device` (the smallest memory
        and slowest updates among them) computing at `speed` each; `previous`: the rank
        sending into it (None: the rank before its first; -1: no link counted). The link
        carries the activations one way and their gradients the other, each at its rate (as
        the closed form and the simulator price them)."""
        r, start = len(ranks), ranks[0]
        p = params[j] - params[i] + copied.get((i, j), 0.0)
        if p * (2.0 + optimizer_state) > device.memory:
            return math.inf
        span = (start, ranks[-1], r)  # a straddle's ranks are not always consecutive
        if span not in levels:
            levels[span] = cluster.levels[cluster.slowest_level_of(ranks)]
        sync = ring_allreduce_seconds(p, r, levels[span]) + step_seconds(p, device)
        compute = (work[j] - work[i]) / speed
        own = (compute + sync) / r if streaming else compute / r + sync * (1 if row.flush
                                                                            else r / m)
        link = 0.0
        if previous is not None and previous >= 0 and i > 0:
            link = link_time(i, previous, start, r)
        elif previous is None and i > 0 and start > 0:
            if start not in links:
                links[start] = cluster.flow_rate_between(start - 1, start)
            link = crossing[i] / links[start] / r
        return max(own, link)

    def link_time(i: int, previous: int, start: int, r: int) -> float:
        """The link from rank `previous` into a stage of r replicas from `start` whose first
        block is i."""
        if (previous, start) not in pair_links:
            pair_links[previous, start] = cluster.flow_rate_between(previous, start)
        return crossing[i] / pair_links[previous, start] / r

    straddles: dict[tuple[int, int, int], tuple[list[int], Device, float]] = {}

    def straddle(g: int, u: int, v: int) -> tuple[list[int], Device, float]:
        """The rest of group order[g] from its u-th rank and the first v of order[g+1]: their
        ranks, the device with less memory (the slower, on a tie) and their shared speed
        (worked out once per (g, u, v): the shares of 64 replicas take a tenth of a second)."""
        if (g, u, v) in straddles:
            return straddles[g, u, v]
        assert order is not None  # (None: `_straight_any_order`, which has no straddles)
        here, there = order[g], order[g + 1]
        ranks = list(cluster.group_ranks(here))[u:] + list(cluster.group_ranks(there))[:v]
        speeds = [cluster.speed_of(x) for x in ranks]
        counts = round_shares(speeds) if streaming else proportional_shares(
            speeds, max(m, len(speeds)))
        device = min((cluster.groups[here].device, cluster.groups[there].device),
                     key=lambda d: (d.memory, d.flops))
        straddles[g, u, v] = (ranks, device, shared_speed(speeds, counts))
        return straddles[g, u, v]

    if order is None:
        return _straight_any_order(cluster, n, pinned, blocks, members, ranks_time, link_time)
    # value[(i, g, u)] = (best bottleneck, previous state, stage placed)
    Key = tuple[int, int, int]
    value: dict[Key, tuple[float, Key | None, tuple[int, int, int, int] | None]] = {
        (0, 0, 0): (0.0, None, None)}
    for g, group in enumerate(order):
        size = cluster.groups[group].workers
        first = cluster.group_ranks(group).start
        for u in range(size + 1):
            for i in range(n + 1):
                here = value.get((i, g, u))
                if here is None:
                    continue
                if g + 1 < len(order):  # leave the rest of this group unused
                    _relax(value, (i, g + 1, 0), here[0], (i, g, u), None)
                if i == n:
                    continue
                for r in _replica_counts(size - u, most_replicas):
                    for j in range(max(i + 1, pinned if i == 0 else 0), n + 1):
                        t = stage_time(i, j, group, first + u, r)
                        if t < math.inf:
                            _relax(value, (j, g, u + r), max(here[0], t), (i, g, u),
                                   (i, j, group, first + u))
                if most_replicas is not None or g + 1 >= len(order) or u >= size \
                        or row.microbatched_stream:  # 2BW takes no shares
                    continue
                for v in _replica_counts(cluster.groups[order[g + 1]].workers, None):
                    ranks, device, speed = straddle(g, u, v)
                    for j in range(max(i + 1, pinned if i == 0 else 0), n + 1):
                        t = ranks_time(i, j, ranks, device, speed)
                        if t < math.inf:
                            _relax(value, (j, g + 1, v), max(here[0], t), (i, g, u),
                                   (i, j, group, first + u, tuple(ranks)))
    ends = [(v[0], key) for key, v in value.items() if key[0] == n and v[2] is not None]
    if not ends:
        return None
    _, key = min(ends)
    stages: Stages = []
    state: Key | None = key
    while state is not None:
        _, previous, placed = value[state]
        if placed is not None and previous is not None:
            i, j, _, start = placed[:4]
            nodes = [x for b in blocks[i:j] for x in members.get(b, [b])]
            if len(placed) > 4:  # a stage over two groups
                stages.append((nodes, placed[4]))
            else:
                r = state[2] - previous[2]
                stages.append((nodes, tuple(range(start, start + r))))
        state = previous
    stages.reverse()
    return stages


ANY_ORDER_STATES = 200_000  # (blocks placed, ranks used per group, last rank) states, at most


def _straight_any_order(cluster: Cluster, n: int, pinned: int, blocks: Sequence[str],
                        members: dict[str, list[str]],
                        ranks_time: Callable[..., float],
                        link_time: Callable[[int, int, int, int], float]) -> Stages | None:
    """One rank per stage, the stages visiting the groups in any order and coming back to a
    group (fast, slow, fast): value[(i, used)] is the smallest slowest-stage time that places
    the first i blocks with used[g] ranks of each group g taken, each stage on the next free
    rank of its group. Why: the pipelines across the groups visit each group once, so where
    a light stage wants a slow rank between two heavy ones on fast ranks (a chain of heavy,
    light, heavy blocks over 2 fast and 2 slow ranks: 10.1 ms, against 12.3 ms for the best
    of those) none of them reaches it, nor the descent over rank sets, whose seeds all cut
    the chain otherwise. None where no such plan fits or the states would exceed
    ANY_ORDER_STATES (many groups of many ranks)."""
    sizes = [group.workers for group in cluster.groups]
    if (n + 1) * math.prod(s + 1 for s in sizes) * (sum(sizes) + 1) > ANY_ORDER_STATES:
        return None
    starts = [cluster.group_ranks(g).start for g in range(len(sizes))]
    # a state: blocks placed, ranks used per group, the rank of the last stage (-1: none yet)
    Key = tuple[int, tuple[int, ...], int]
    value: dict[Key, tuple[float, Key | None, int]] = {
        (0, (0,) * len(sizes), -1): (0.0, None, 0)}
    # a stage on one rank: its own time depends on its group alone (no all-reduce), the link
    # on the rank before it
    own: dict[tuple[int, int, int], float] = {}
    by_blocks: dict[int, list[Key]] = {}
    for key in value:
        by_blocks.setdefault(key[0], []).append(key)
    for i in range(n):
        for key in sorted(by_blocks.get(i, ())):
            here, used, last = value[key][0], key[1], key[2]
            for g, size in enumerate(sizes):
                if used[g] >= size:
                    continue
                rank = starts[g] + used[g]
                nxt = tuple(u + (1 if x == g else 0) for x, u in enumerate(used))
                link = link_time(i, last, rank, 1) if last >= 0 else 0.0
                for j in range(max(i + 1, pinned if i == 0 else 0), n + 1):
                    if (i, j, g) not in own:
                        own[i, j, g] = ranks_time(i, j, [rank], cluster.groups[g].device,
                                                  cluster.group_speed(g), previous=-1)
                    t = max(own[i, j, g], link)
                    if t < math.inf:
                        target = (j, nxt, rank)
                        if target not in value:
                            by_blocks.setdefault(j, []).append(target)
                        _relax(value, target, max(here, t), key, rank)
    ends = [(v[0], key) for key, v in value.items() if key[0] == n and v[1] is not None]
    if not ends:
        return None
    _, state = min(ends)
    stages: Stages = []
    while value[state][1] is not None:
        _, previous, rank = value[state]
        assert previous is not None
        nodes = [x for b in blocks[previous[0]:state[0]] for x in members.get(b, [b])]
        stages.append((nodes, (rank,)))
        state = previous
    stages.reverse()
    return stages


def _tie_copies(graph: nx.DiGraph, members: dict[str, list[str]], position: dict[str, int],
                ) -> dict[tuple[int, int], float]:
    """Bytes of tied parameters that a stage of blocks i..j-1 (in `position`'s order) holds a
    copy of: a reader of the tie but not the one whose params count it (cost/ties.py
    `copied_bytes`), keyed (i, j) where not 0. The copy is weights, gradient and optimizer state
    on the stage's device, stepped and all-reduced by its replicas as its own parameters are."""
    ties = tie_readers(graph)
    if not ties:
        return {}
    block_of = {m: b for b, group in members.items() for m in group}
    place = [(tie.nbytes, position[block_of.get(tie.owner, tie.owner)],
              sorted(position[block_of.get(r, r)] for r in tie.others)) for tie in ties]
    out: dict[tuple[int, int], float] = {}
    n = len(position)
    for i in range(n):
        for j in range(i + 1, n + 1):
            held = sum(nbytes for nbytes, owner, others in place
                       if not i <= owner < j and any(i <= p < j for p in others))
            if held:
                out[i, j] = held
    return out


def _relax(value: dict[Any, Any], key: Any, time: float, previous: Any, placed: Any) -> None:
    if key not in value or time < value[key][0]:
        value[key] = (time, previous, placed)


def _replica_counts(free: int, most: int | None) -> list[int]:
    """Replica counts a stage may take from `free` ranks: powers of two and all of them."""
    top = free if most is None else min(free, most)
    counts = {1 << k for k in range(top.bit_length()) if 1 << k <= top}
    if top >= 1:
        counts.add(top)
    return sorted(counts)


__all__ = ["as_mean", "as_slowest", "data_parallel", "dealt_by_work", "dealt_in_proportion",
           "group_alone", "plan_mixed", "scaled_graph", "with_shares"]
