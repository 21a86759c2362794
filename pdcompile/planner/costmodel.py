"""The cost of a pipeline plan: per-stage compute, weight sync, communication, memory, time.

One function, `evaluate`, prices a plan for every planner and every report. Two models:

* ``"pipedream"``: exactly the model of PipeDream's optimizer (Narayanan et al., SOSP 2019;
  ``optimizer_graph_hierarchical.py``). A stage of T seconds of fwd+bwd and P parameter bytes on
  r replicas costs ``(T + 4 (r-1) P / (B r)) / r`` (the all-reduce is added to compute, not
  overlapped); a cut with O output bytes costs ``2 O / (B r)`` on each side of it (r: that side's
  replicas) and the stage time is the maximum of the three. O is the activation bytes of the
  cut's *augmented antichain* (see antichain.py). `Input` sources and unused `__getitem__` sinks
  are dropped first, as the original does, and (a quirk of its recurrence, kept) the first stage's
  output transfer is never charged, only the second stage's input. Memory:
  ``ceil(D / r) (act + P)`` with D the workers downstream of the stage (the original's stash
  estimate).

* ``"native"``: this project's runtime as the simulator runs it, from the shared formulas of
  `pdcompile.cost`: what crosses between stages (a tensor once per reading stage), ring
  all-reduces, optimizer steps and weight-version copies, loopback copies, memory per worker
  (weights, gradients, optimizer state, stashed versions, activations in flight), and the
  schedule-aware time per minibatch of `cost.pipeline_time` (a streaming schedule's steady state
  bounded by work, links and in-flight round trips; a flush schedule's minibatch as the
  longest path through its actions, cost/flush_path.py). Each stage keeps `in_flight` microbatches in flight: the planner's choice
  (`Stage.in_flight`) or the schedule's default, PipeDream's NOAM. Where a host's workers
  outnumber its cores (`Level.cores`, as `local-N` on a small machine), a minibatch takes at
  least their CPU work over the cores (`shared_core_time`).

  The dynamic program and CP-SAT need an objective that is a maximum over stages; `stage_values`
  is that objective, from the same formulas: per stage the work, its links and (streaming) its
  round trip over the most microbatches its memory allows in flight (or PipeDream's NOAM, the
  planner's second variant: the DP cannot see how later stages' in-flight counts bound an
  earlier one's), or (flush) the fill and drain through it, the microbatches it adds to them
  and its final all-reduce and step, or its links and server interfaces carrying the
  minibatch's m microbatches, whichever is longer. The planners rank with it;
  plans are then priced with `evaluate` (and, where it is cheap, simulated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from pdcompile.cost.crossing import input_nodes
from pdcompile.cost.flush_path import FlushOrders
from pdcompile.cost.links import exposed_allreduce_seconds, slowest_link, transfer_seconds
from pdcompile.cost.memory import OPTIMIZER_STATE, worker_memory
from pdcompile.cost.pipeline_time import (
    PipelineTime,
    StageTerms,
    pipeline_time,
    server_interface_seconds,
    stage_terms,
    update_share,
)
from pdcompile.cost.recompute import recompute_costs
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import copied_bytes
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.plan import Stage
from pdcompile.planner.augmented_cut import AugmentedFrontiers
from pdcompile.schedule.kinds import KINDS, kind, unknown, weight_versions

COST_MODELS = ("native", "pipedream")
IN_FLIGHT_CAP = 64  # the planning objective never assumes more microbatches in flight per replica


@dataclass(frozen=True)
class ModelOptions:
    """What `evaluate` and the planners need besides the graph and the cluster."""

    cost_model: str = "native"
    schedule: str = "1f1b"
    microbatches: int = 1
    optimizer_state: float = OPTIMIZER_STATE
    flight: str = "memory"  # the planning objective's in-flight count: "memory" or "noam"

    def __post_init__(self) -> None:
        if self.flight not in ("memory", "noam"):
            raise PlanError(f"flight must be 'memory' or 'noam', not {self.flight!r}")
        if self.cost_model not in COST_MODELS:
            raise PlanError(f"unknown cost model {self.cost_model!r}; use one of {COST_MODELS}")
        if self.schedule not in KINDS:
            raise PlanError(unknown(self.schedule))
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"microbatches must be a positive integer (got {self.microbatches!r})")

    @property
    def per_minibatch(self) -> int:
        """Microbatches a minibatch is cut into under this schedule (1 for '1f1b')."""
        return self.microbatches if kind(self.schedule).microbatched else 1


# ------------------------------------------------------------------------------ in flight
def noam(replicas: int, workers_from_here: int) -> int:
    """PipeDream's NOAM: minibatches a replica keeps in flight, ceil(workers of this stage and
    all later ones / replicas)."""
    return math.ceil(workers_from_here / replicas)


def default_in_flight(replicas: int, workers_from_here: int, options: ModelOptions) -> int:
    """Microbatches a replica keeps in flight under the schedule's default warm-up: NOAM, at
    most the microbatches it gets in a flush; all of them under GPipe."""
    share = math.ceil(options.per_minibatch / replicas)
    if kind(options.schedule).forwards_first:
        return share
    if kind(options.schedule).flush:
        return min(noam(replicas, workers_from_here), share)
    return noam(replicas, workers_from_here)


# ------------------------------------------------------------------------------ pipedream
def pipedream_memory(params: float, act: float, replicas: int, downstream: int) -> float:
    """The original optimizer's stash estimate of a stage's memory per worker."""
    return math.ceil(downstream / replicas) * (act + params)


def pipedream_sync(params: float, replicas: int, bandwidth: float) -> float:
    """The original's all-reduce term per minibatch (added to compute)."""
    if replicas <= 1:
        return 0.0
    r = replicas
    return 4.0 * (r - 1) * params / (bandwidth * r) / r


# ------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class Placement:
    """Per-byte and fixed costs of a stage on ranks [start, start + replicas) of `workers`
    (native model): the all-reduce spans those ranks; what the stage receives crosses the link
    from rank start - 1, what it sends the link to start + replicas. Seconds per byte or per
    message, not divided by anything."""

    replicas: int
    noam: int
    sync_per_byte: float  # ring all-reduce: 2 (r-1)/r / bandwidth
    sync_fixed: float  # ring all-reduce: 2 (r-1) latency
    in_per_byte: float
    in_per_msg: float
    out_per_byte: float
    out_per_msg: float
    copy_in_per_byte: float = 0.0  # CPU time per byte sent back over the input link (loopback)
    copy_out_per_byte: float = 0.0  # CPU time per byte sent forward over the output link
    step_per_byte: float = 0.0  # optimizer step per parameter byte
    copy_per_byte: float = 0.0  # a weight-version copy per parameter byte
    sync_bucket: float = math.inf  # bytes per gradient bucket all-reduced during the backward
    # (Cluster.allreduce_bucket; inf: the all-reduce starts after the backward)
    in_nic_per_byte: float = 0.0  # the busiest server interface per byte the stage receives
    out_nic_per_byte: float = 0.0  # ... and per byte it sends (`server_interfaces`)
    nic_ring_per_byte: float = 0.0  # each interface its ring crosses, per parameter byte of
    # one all-reduce: 2 (r-1)/r / the interface's bandwidth where the replicas span servers
    pass_per_byte: float = 0.0  # bytes passing over the stage (sent before it, read after it):
    pass_per_msg: float = 0.0  # ... the link from rank start - 1 to start + replicas, which
    pass_nic_per_byte: float = 0.0  # ... they cross, and the server interface if it is there
    far_copy_in_per_byte: float = 0.0  # CPU time per byte received or sent over the slowest
    far_copy_out_per_byte: float = 0.0  # loopback link a skip to or from the stage could take


def placement(cluster: Cluster, start: int, replicas: int, workers: int, *,
              copies: int = 1, copy_link: Level | None = None,
              interfaces: str = "seen") -> Placement:
    """Coefficients of a stage at a rank position (see `Placement`). `copies`: the pipeline is
    one of that many identical copies, so the stage's gradients are all-reduced among
    replicas x copies workers over `copy_link` (the level between copies) and, with several
    replicas, the level they span, whichever is slower. `interfaces`: "seen", the stage's
    terms on the servers' interfaces as `server_interfaces` sees them; "whole", every server's
    share crossing (`server_interfaces`' `whole`); "unseen", none (the interfaces free: the
    view of a cluster whose servers' links are not shared)."""
    from pdcompile.cost.links import ring_allreduce_seconds
    from pdcompile.cost.updates import copy_seconds, step_seconds

    r, end = replicas, start + replicas - 1
    sync_a = sync_b = in_a = in_l = out_a = out_l = copy_in = copy_out = 0.0
    if r * copies > 1:
        lv = cluster.levels[cluster.link_level(start, end)]
        if copies > 1 and copy_link is not None:  # the ring spans both: its slower link
            lv = copy_link if r == 1 or copy_link.allreduce_rate < lv.allreduce_rate else lv
        sync_b = ring_allreduce_seconds(0.0, r * copies, lv)
        sync_a = ring_allreduce_seconds(1.0, r * copies, lv) - sync_b
    if start > 0:
        li = cluster.levels[cluster.link_level(start - 1, end)]
        in_a, in_l = 1.0 / li.flow_rate, li.latency
        copy_in = in_a if li.cpu_copies else 0.0
    if end + 1 < workers:
        lo = cluster.levels[cluster.link_level(start, end + 1)]
        out_a, out_l = 1.0 / lo.flow_rate, lo.latency
        copy_out = out_a if lo.cpu_copies else 0.0
    bucket = math.inf if cluster.allreduce_bucket is None else cluster.allreduce_bucket
    if interfaces not in ("seen", "whole", "unseen"):
        raise PlanError(f"interfaces must be 'seen', 'whole' or 'unseen', not {interfaces!r}")
    nic_in, nic_out = server_interfaces(cluster, start, r, workers,
                                        whole=interfaces == "whole")
    ring = _ring_on_interfaces(cluster, start, r) \
        if len(cluster.levels) > 1 and workers == cluster.workers and copies == 1 else 0.0
    pass_a = pass_l = pass_nic = 0.0
    if start > 0 and end + 1 < workers:  # a skip from before the stage to after it crosses
        # every link from rank start - 1 to start + replicas (ranks are contiguous)
        lp = cluster.levels[cluster.link_level(start - 1, end + 1)]
        pass_a, pass_l = 1.0 / lp.flow_rate, lp.latency
        if len(cluster.levels) > 1 and workers == cluster.workers:
            size = cluster.group_size(len(cluster.levels) - 2)
            if (start - 1) // size != (end + 1) // size:
                pass_nic = 1.0 / cluster.levels[-1].bandwidth
    far_in = max((1.0 / lv.flow_rate for lv in cluster.levels[
        cluster.link_level(start - 1, end):cluster.link_level(0, end) + 1] if lv.cpu_copies),
        default=0.0) if start > 0 else 0.0
    far_out = max((1.0 / lv.flow_rate for lv in cluster.levels[
        cluster.link_level(start, end + 1):cluster.link_level(start, workers - 1) + 1]
        if lv.cpu_copies), default=0.0) if end + 1 < workers else 0.0
    if interfaces == "unseen":
        nic_in = nic_out = ring = pass_nic = 0.0
    return Placement(r, noam(r, workers - start), sync_a, sync_b, in_a, in_l, out_a, out_l,
                     copy_in, copy_out, step_seconds(1.0, cluster.device),
                     copy_seconds(1.0, cluster.device), bucket, nic_in, nic_out, ring,
                     pass_a, pass_l, pass_nic, far_in, far_out)


def _ring_on_interfaces(cluster: Cluster, start: int, replicas: int) -> float:
    """Seconds per parameter byte of one ring all-reduce on each server interface it crosses
    (`links.nic_busy_seconds`: 2 (r-1)/r of the bytes each way), 0 where the replicas share
    one server."""
    size = cluster.group_size(len(cluster.levels) - 2)
    if start // size == (start + replicas - 1) // size:
        return 0.0
    return 2.0 * (replicas - 1) / replicas / cluster.levels[-1].bandwidth


def server_interfaces(cluster: Cluster, start: int, replicas: int, workers: int, *,
                      whole: bool = False) -> tuple[float, float]:
    """Seconds per byte that a stage on ranks [start, start + replicas) of `workers` puts on
    the busiest server interface (the outermost level's bandwidth, shared by a server's
    workers: cost/links.nic_busy_seconds) for what it receives and for what it sends: its
    replicas share its bytes evenly (round robin), and a server's share crosses the interface
    unless the server also holds ranks of the stages before it (receiving) or after it
    (sending), whose part the objective cannot see (then 0 for that server), except where
    every rank before it shares its first server (all it receives on other servers leaves that
    one) or every rank after it its last server (all it sends from other servers enters that
    one). 0 on a one-level cluster. `whole`: every server's share crosses, as if the
    neighbouring stages' ranks on it were elsewhere (the most the stage can put there: the
    planner's second view, which steers clear of servers shared by stages whose sends the
    first view cannot see)."""
    if len(cluster.levels) < 2 or workers != cluster.workers:
        return 0.0, 0.0
    size = cluster.group_size(len(cluster.levels) - 2)
    nic = cluster.levels[-1].bandwidth
    end = start + replicas - 1
    counts: dict[int, int] = {}
    for rank in range(start, end + 1):
        counts[rank // size] = counts.get(rank // size, 0) + 1
    first, last = start // size, end // size
    into = max((c for k, c in counts.items() if whole or k != first or start % size == 0),
               default=0)
    out = max((c for k, c in counts.items() if whole or k != last or (end + 1) % size == 0),
              default=0)
    if start > 0 and first == 0:  # the senders all on server 0: the rest leaves it
        into = max(into, replicas - counts[first])
    if end + 1 < workers and last == (workers - 1) // size:  # the receivers all on `last`
        out = max(out, replicas - counts[last])
    return into / replicas / nic, out / replicas / nic


# ------------------------------------------------------------------------------ objective
@dataclass(frozen=True)
class StageParts:
    """The pieces of a stage's objective, per microbatch (numpy arrays that broadcast): computed
    once per candidate stage and position, then combined by `values_of` (the objective) and
    `demand_of` (at a target period) as often as the planner needs."""

    replicas: np.ndarray
    compute: np.ndarray  # fwd+bwd of one microbatch on one replica
    own: np.ndarray  # its work per microbatch with its share of updates (streaming)
    link: np.ndarray  # its busiest link per microbatch, over its replicas
    wire: np.ndarray  # one transfer of what it sends, end to end
    fit: np.ndarray  # microbatches in flight its memory holds (capped; < 1: does not fit)
    allreduce: np.ndarray
    step: np.ndarray
    cpu: np.ndarray
    noam: np.ndarray
    runs: np.ndarray  # the schedule can feed this many replicas
    skip: np.ndarray  # one transfer of what passes over it, end to end (`stage_parts`)


def stage_parts(*, compute: Any, backward: Any, params: Any, keep: Any, received: Any,
                sent: Any, coef: Any, options: ModelOptions, memory: float | None,
                recompute: Any = None, passing: Any = 0.0,
                sent_copies: Any = None) -> StageParts:
    """The pieces of stages' objectives (arguments as in `stage_values`). `recompute`: the
    stages' forward seconds per minibatch, for the stages recomputing their activations
    (pdcompile.cost.recompute): one more forward each, in their backward, and in flight only
    what they received, plus one microbatch's activations while its backward runs.
    `passing`: bytes per minibatch sent from before the stage to after it (skips over it):
    they cross the links around it (`Placement.pass_per_byte`), which no neighbour's sends
    price where the skip leaves a server, and lengthen every circuit through it.
    `sent_copies`: bytes per minibatch the stage's CPU copies out over loopback links, each
    output once per later stage reading it (at most the bytes of its edges to later stages;
    default `sent`); its loopback copies are priced on the slowest link a skip could take."""
    row = kind(options.schedule)
    m = options.per_minibatch
    r = np.asarray(coef.replicas, dtype=np.float64)
    t, p, k = np.asarray(compute) / m, np.asarray(params), np.asarray(keep) / m
    back = np.asarray(backward) / m
    inb, outb = np.asarray(received) / m, np.asarray(sent) / m
    over = np.asarray(passing) / m
    fixed: Any = 0.0  # activation bytes held whatever the number in flight
    if recompute is not None:
        again = np.asarray(recompute) / m
        t, back, fixed, k = t + again, back + again, k, inb
    # what of the ring all-reduce remains after the backward (cost/links.py, as the closed form)
    allreduce = exposed_allreduce_seconds(p * coef.sync_per_byte + coef.sync_fixed,
                                          backward=back, params=p, bucket=coef.sync_bucket)
    step = p * coef.step_per_byte
    copies = outb if sent_copies is None else np.asarray(sent_copies) / m
    cpu = inb * coef.far_copy_in_per_byte + copies * coef.far_copy_out_per_byte
    wire = outb * coef.out_per_byte + np.where(outb > 0, coef.out_per_msg, 0.0)
    limit = (math.inf if memory is None else memory) - fixed
    base = p * (2.0 + options.optimizer_state)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # capped below
        if row.stashed_versions == "in-flight":  # a version per minibatch in flight
            fit = np.floor((limit - base + p) / (k + p))
        else:
            fit = np.floor((limit - base - (int(row.stashed_versions) - 1) * p) / k)
        fit = np.where(np.isnan(fit), IN_FLIGHT_CAP, fit)
    fit = np.minimum(fit, IN_FLIGHT_CAP)
    copy = p * coef.copy_per_byte if row.copies_weights else 0.0
    own = t + cpu + (allreduce + step + copy) * update_share(options.schedule, m, r)
    # the busiest interface: the stage's share of what it receives or sends there, and its
    # ring all-reduces (update_share / r per microbatch, as links.nic_busy_seconds counts them)
    # on every interface it crosses, that server's among them
    ring = p * coef.nic_ring_per_byte * update_share(options.schedule, m, r) / r
    # what passes over the stage occupies the link around it (each skip's whole bytes: a bound
    # on its rank pairs' share) and, where that is a server's interface, adds to the stage's
    # own bytes there (all that crosses a server boundary next to a straight stage)
    skip = over * coef.pass_per_byte
    link = np.maximum(np.maximum(np.maximum(inb * coef.in_per_byte, outb * coef.out_per_byte)
                                 / r, skip),
                      np.maximum(inb * coef.in_nic_per_byte, outb * coef.out_nic_per_byte)
                      + over * coef.pass_nic_per_byte + ring)
    skip = skip + np.where(over > 0, coef.pass_per_msg, 0.0)
    # a microbatched schedule cuts a minibatch into microbatches that the replicas share: no
    # more replicas than microbatches, and 2bw needs a multiple of them
    runs = r <= (m if row.microbatched else math.inf)
    if row.microbatched and not row.flush:
        runs = runs & (np.mod(m, r) == 0)
    return StageParts(r, t, own, link, wire, fit, allreduce, step, cpu,
                      np.asarray(coef.noam, dtype=np.float64), np.asarray(runs), np.asarray(skip))


def stage_values(*, compute: Any, backward: Any, params: Any, keep: Any, received: Any,
                 sent: Any, rest: Any, coef: Any, options: ModelOptions,
                 memory: float | None, passing: Any = 0.0, sent_copies: Any = None) -> np.ndarray:
    """The planning objective of stages (seconds per minibatch; inf where it cannot run), on
    numpy arrays that broadcast: `compute` fwd+bwd and `backward` bwd seconds, `params`, `keep`
    bytes per minibatch of the stage; `received` / `sent` bytes per minibatch over its input /
    output links; `rest` the fwd+bwd of everything after it; `coef` a `Placement` whose fields
    may be arrays (one per candidate position); `passing` bytes per minibatch skipping over it
    (`stage_parts`); `params` counts a tied parameter on every stage holding a copy. See the
    module docstring; the DP and the brute-force tests share it."""
    parts = stage_parts(compute=compute, backward=backward, params=params, keep=keep,
                        received=received, sent=sent, coef=coef, options=options, memory=memory,
                        passing=passing, sent_copies=sent_copies)
    return values_of(parts, rest, options)


def values_of(x: StageParts, rest: Any, options: ModelOptions) -> np.ndarray:
    """`stage_values` from the stages' parts."""
    row = kind(options.schedule)
    m = options.per_minibatch
    r, later = x.replicas, np.asarray(rest) / m
    if row.flush:
        share = np.ceil(m / r)
        flight = share if row.forwards_first else \
            np.minimum(np.minimum(x.fit, share), x.noam)
        period = x.compute + x.cpu
        trip = period + later + 2.0 * x.wire
        with np.errstate(divide="ignore", invalid="ignore"):
            period = np.where(share > flight, np.maximum(period, trip / flight), period)
            # a stage holding no microbatch (flight 0) has an infinite period: where it runs
            # one microbatch (share 1) that is 0 * inf below, NaN, masked by `ok` at the end
            # the fill and drain cross it and every later stage once (one microbatch there and
            # back, `trip`), then it adds its other microbatches, then its all-reduce and step
            # (`cost.pipeline_time._flush`); its links carry all m microbatches of the
            # minibatch: each of its lanes m / r of them and the busiest server interface its
            # share of them (the closed form's and the simulator's bound; CP-SAT's flush
            # objective has it too)
            value = np.maximum(trip + (share - 1.0) * period + x.allreduce + x.step,
                               x.link * m)
        ok = x.fit >= (share if row.forwards_first else 1.0)
    else:
        flight = np.maximum(x.fit, 1.0)
        if options.flight == "noam":
            flight = np.minimum(flight, x.noam)
        trip = x.own + later + 2.0 * x.wire
        value = np.maximum(np.maximum(x.own / r, x.link), trip / (flight * r)) * m
        ok = x.fit >= 1
    return np.where(ok & x.runs, value, math.inf)


def stage_demand(*, compute: Any, backward: Any, params: Any, keep: Any, received: Any,
                 sent: Any, coef: Any, options: ModelOptions, memory: float | None,
                 period: float, demand: Any,
                 passing: Any = 0.0, sent_copies: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """A streaming stage's place in a pipeline that must reach `period` seconds per minibatch
    (arrays broadcast as in `stage_values`; `demand` is that of the pipeline after the stage,
    -inf for none). Returns (its minibatches in flight per replica, N; the pipeline's demand
    from here on), both inf where the stage cannot keep up or does not fit.

    In flight counts as "tokens" T = N r across a stage's replicas. Every circuit of the
    schedule (`cost.pipeline_time`) from this stage s through a later stage k must fit its work
    L(s, k) into T_s - (T_k - r_k) microbatch periods, and L(s, k) = own_s + 2 wire_s + Q(s+1, k)
    where Q sums the compute and wires of the stages after s and what passes over them (a skip
    from s to k is no longer than the transfers of what passes over the stages between). So
    T_s >= (own_s + 2 wire_s) / p + E_{s+1}, with the demand E_s = max(T_s - r_s + t_s / p,
    (t_s + 2 wire_s) / p + E_{s+1}) depending on the pipeline after s alone: the DP keeps, for
    each state and worker count, the continuation of least demand."""
    parts = stage_parts(compute=compute, backward=backward, params=params, keep=keep,
                        received=received, sent=sent, coef=coef, options=options, memory=memory,
                        passing=passing, sent_copies=sent_copies)
    return demand_of(parts, options, period, demand)


def demand_of(x: StageParts, options: ModelOptions, period: float,
              demand: Any) -> tuple[np.ndarray, np.ndarray]:
    """`stage_demand` from the stages' parts."""
    per = period / options.per_minibatch
    r = x.replicas
    after = np.asarray(demand, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        need = np.maximum((x.own + 2.0 * x.wire) / per + after, after + r)
        flight = np.maximum(1.0, np.ceil(need / r - 1e-9))
        ok = (x.own / r <= per * (1 + 1e-12)) & (x.link <= per * (1 + 1e-12)) \
            & (flight <= x.fit) & x.runs
        tokens = flight * r
        here = np.maximum(tokens - r + x.compute / per,
                          (x.compute + 2.0 * (x.wire + x.skip)) / per + after)
    return np.where(ok, flight, math.inf), np.where(ok, here, math.inf)


def planning_objective(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                       cluster: Cluster, *, options: ModelOptions,
                       memory: float | None = None) -> float:
    """The DP's objective of a plan given as (nodes, ranks) per stage: the largest
    `stage_values` (what tests compare the DP and brute force on). Nodes sent across count once
    per source and stage boundary, as the DP's tables count them."""
    stage_of = _checked_stage_of(graph, stages)
    inputs = set(input_nodes(graph))
    count, workers = len(stages), cluster.workers
    compute = [0.0] * count
    backward = [0.0] * count
    params = [0.0] * count
    keep = [0.0] * count
    for node, data in graph.nodes(data=True):
        i = stage_of[node]
        if node not in inputs:
            compute[i] += float(data["fwd"]) + float(data["bwd"])
            backward[i] += float(data["bwd"])
        params[i] += float(data["params"])
        keep[i] += float(data.get("keep", data["act"]))
    for i, copied in enumerate(copied_bytes(graph, stage_of, count)):
        params[i] += copied  # a tie's copy on each later holder (cost/ties.py)
    weight = {u: max((float(graph.edges[u, v].get("bytes", graph.nodes[u]["act"]))
                      for v in graph.successors(u)), default=0.0) for u in graph.nodes}
    worst = 0.0
    for i, (_, ranks) in enumerate(stages):
        received = sum(weight[u] for u in graph.nodes
                       if stage_of[u] < i and any(stage_of[v] == i for v in graph.successors(u)))
        sent = sum(weight[u] for u in graph.nodes
                   if stage_of[u] == i and any(stage_of[v] > i for v in graph.successors(u)))
        passing = sum(weight[u] for u in graph.nodes
                      if stage_of[u] < i and any(stage_of[v] > i for v in graph.successors(u)))
        copies = sum(float(graph.edges[u, v].get("bytes", graph.nodes[u]["act"]))
                     for u, v in graph.edges if stage_of[u] == i < stage_of[v])
        if i == 0:
            received = passing = 0.0
        rest = sum(compute[i + 1:])
        coef = placement(cluster, ranks[0], len(ranks), workers)
        value = stage_values(compute=compute[i], backward=backward[i], params=params[i],
                             keep=keep[i],
                             received=received, sent=sent, rest=rest, coef=coef,
                             options=options, memory=memory, passing=passing,
                             sent_copies=copies)
        worst = max(worst, float(value))
    return worst


def _checked_stage_of(graph: nx.DiGraph,
                      stages: Sequence[tuple[Sequence[str], Sequence[int]]]) -> dict[str, int]:
    stage_of: dict[str, int] = {}
    for i, (nodes, _) in enumerate(stages):
        for node in nodes:
            stage_of[node] = i
    missing = [n for n in graph.nodes if n not in stage_of]
    if missing:
        raise PlanError(f"plan leaves nodes unassigned: {missing[:5]}")
    for u, v in graph.edges:
        if stage_of[u] > stage_of[v]:
            raise PlanError(f"edge {u} -> {v} goes from stage {stage_of[u]} back to stage "
                            f"{stage_of[v]}; stages must be convex")
    return stage_of


# ------------------------------------------------------------------------------ pipedream graph
def pipedream_view(graph: nx.DiGraph) -> tuple[nx.DiGraph, dict[str, str | None]]:
    """The graph PipeDream's optimizer plans over: `Input*` sources and unused `__getitem__` sinks
    removed. Returns it and a map removed node -> the node whose stage it joins (None: the first
    stage, where the original puts its inputs)."""
    view = graph.copy()
    attach: dict[str, str | None] = {}
    for node in list(view.nodes):
        if view.in_degree(node) == 0 and str(view.nodes[node].get("label", "")).startswith("Input"):
            if view.number_of_nodes() > 1:
                attach[node] = None
                view.remove_node(node)
    for node in list(view.nodes):
        if (view.out_degree(node) == 0 and view.number_of_nodes() > 1
                and str(view.nodes[node].get("label", "")).startswith("__getitem__")):
            preds = list(view.predecessors(node))
            if preds:
                attach[node] = preds[0]
                view.remove_node(node)
    for node, target in list(attach.items()):  # chains of removed nodes
        while target is not None and target in attach:
            target = attach[target]
        attach[node] = target
    return view, attach


# ------------------------------------------------------------------------------ evaluate
def evaluate(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
             cluster: Cluster, *, options: ModelOptions, memory: float | None = None,
             in_flight: Sequence[int] | None = None, recompute: Sequence[bool] | None = None,
             shares: Sequence[Sequence[int]] | None = None,
             ) -> tuple[tuple[Stage, ...], float]:
    """Price a plan given as (nodes, ranks) per stage in pipeline order (`shares`: per stage,
    the replicas' shares of each round, `Stage.shares`; default round robin).

    Returns the priced stages and the predicted time per minibatch. `in_flight`: microbatches
    each stage keeps in flight per replica (default: the schedule's, see `default_in_flight`);
    native model only. Nodes of `graph` missing from every stage raise PlanError. `memory` is
    accepted for symmetry with the planners; pricing does not depend on it.
    """
    del memory
    if options.cost_model == "pipedream":
        return _evaluate_pipedream(graph, stages, _checked_stage_of(graph, stages), cluster)
    return _evaluate_native(graph, stages, cluster, options, in_flight, recompute,
                            shares)[:2]


def evaluate_timed(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                   cluster: Cluster, *, options: ModelOptions,
                   in_flight: Sequence[int] | None = None,
                   recompute: Sequence[bool] | None = None,
                   costs: StageCosts | None = None, orders: FlushOrders | None = None,
                   ) -> tuple[tuple[Stage, ...], float, PipelineTime]:
    """`evaluate` and `priced_time` of the native model in one pricing (round robin): the
    planner wants both of each candidate, and on 32 mixed workers one pricing's circuits take
    a tenth of a second. `costs`: `plan_terms`'; `orders`: `pipeline_time`'s."""
    return _evaluate_native(graph, stages, cluster, options, in_flight, recompute,
                            costs=costs, orders=orders)


def priced_time(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                cluster: Cluster, *, options: ModelOptions,
                in_flight: Sequence[int] | None = None,
                recompute: Sequence[bool] | None = None) -> PipelineTime:
    """The native model's closed form of a plan with what bounds it (`cost.pipeline_time`)."""
    return _evaluate_native(graph, stages, cluster, options, in_flight, recompute)[2]


def closed_form_floor(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                      cluster: Cluster, *, options: ModelOptions,
                      costs: StageCosts | None = None) -> float:
    """A lower bound on the closed form of the plan (`evaluate`'s time per minibatch) under any
    in-flight counts and recomputation, without choosing them (what makes pricing a streaming
    plan slow: its circuits): the busiest server's interface, and each stage's work over its
    replicas (streaming: compute and update per microbatch, one in flight, so no weight copies;
    flush: its busiest replica's microbatches less the weight gradients deferred after its
    send). Recomputation adds a forward and hides at most as much all-reduce. 0 for chunked
    schedules (interleaved, zero bubble, V), whose fill the closed form shortens. `costs`:
    `plan_costs` of these stages and options, where the caller has them."""
    row = kind(options.schedule)
    if row.chunked or options.cost_model != "native":
        return 0.0
    built = plan_terms(graph, stages, cluster, options=options, in_flight=[1] * len(stages),
                       costs=costs)
    m = options.per_minibatch if row.microbatched else 1
    terms, ranks = built.terms, built.ranks
    edges, params = dict(built.costs.edges), built.costs.params
    interface = server_interface_seconds(edges, ranks, params, cluster,
                                         schedule=options.schedule, microbatches=m,
                                         ties=built.costs.ties) * m
    if row.flush:
        work = max(t.busiest(m) * t.compute - t.deferred for t in terms)
    else:
        work = max((t.compute + t.cpu_copies + (t.allreduce + t.step + t.copy)
                    * update_share(options.schedule, m, t.replicas)) / t.replicas
                   for t in terms) * m
    return max(interface, work)


@dataclass(frozen=True)
class PlanTerms:
    """A plan's inputs to the closed form (cost.pipeline_time), built one way for every caller:
    per-stage costs per microbatch, the bytes crossing between stages, ranks, in-flight counts."""

    costs: StageCosts
    terms: list[StageTerms]
    ranks: list[tuple[int, ...]]
    in_flight: list[int]
    recompute: list[bool]

    def activations(self, stage: int, in_flight: int) -> float:
        """The most activation bytes a worker of the stage holds with `in_flight`
        microbatches in flight (pdcompile.cost.recompute for a recomputing stage)."""
        costs = self.costs
        footprint = recompute_costs(fwd=costs.fwd[stage], bwd=costs.bwd[stage],
                                    activations=costs.activations[stage],
                                    inputs=costs.received(stage), in_flight=max(1, in_flight))
        return footprint[self.recompute[stage]].activations


def plan_costs(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]], *,
               options: ModelOptions) -> StageCosts:
    """The stages' costs per microbatch (what depends on the nodes alone: `plan_terms`'
    `costs`). Raises PlanError where a node is in no stage, an edge goes back or an input is
    not in the first stage."""
    stage_of = _checked_stage_of(graph, stages)
    inputs = input_nodes(graph)
    misplaced = [n for n in inputs if stage_of[n] != 0]
    if misplaced:
        raise PlanError(f"inputs {misplaced[:3]} must be in the first stage")
    return StageCosts.from_assignment(graph, stage_of, len(stages),
                                      microbatches=options.per_minibatch, inputs=inputs)


def plan_terms(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
               cluster: Cluster, *, options: ModelOptions,
               in_flight: Sequence[int] | None = None,
               recompute: Sequence[bool] | None = None,
               shares: Sequence[Sequence[int]] | None = None,
               costs: StageCosts | None = None) -> PlanTerms:
    """The closed form's inputs for a plan given as (nodes, ranks) per stage (`in_flight`:
    microbatches in flight per replica; 0 or None: the schedule's default; `recompute`: the
    stages that recompute their activations, which run their forward again in the backward).
    `costs`: the stages' costs from an earlier call on the same stages and options (what
    depends on the nodes alone: the planner prices one cut with many in-flight counts and
    recomputation flags, and summing 2,000 nodes' costs each time was a tenth of its time)."""
    count = len(stages)
    ranks = [tuple(r) for _, r in stages]
    if costs is None:
        costs = plan_costs(graph, stages, options=options)
    after = [sum(len(r) for r in ranks[i:]) for i in range(count)]
    flight = [int(in_flight[i]) if in_flight is not None and in_flight[i] > 0
              else default_in_flight(len(ranks[i]), after[i], options) for i in range(count)]
    row = kind(options.schedule)
    again = [bool(x) for x in recompute] if recompute is not None else [False] * count
    backward = [b + (f if a else 0.0) for f, b, a in zip(costs.fwd, costs.bwd, again,
                                                         strict=True)]
    terms = stage_terms(fwd=costs.fwd, bwd=backward, params=costs.params,
                        edges=dict(costs.edges), stage_ranks=ranks, cluster=cluster,
                        schedule=options.schedule, in_flight=flight,
                        copying=[row.copies_weights and n > 1 for n in flight], shares=shares,
                        wgrad=costs.wgrad, ties=costs.ties)
    return PlanTerms(costs, terms, ranks, flight, again)


def _evaluate_native(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                     cluster: Cluster, options: ModelOptions, in_flight: Sequence[int] | None,
                     recompute: Sequence[bool] | None = None,
                     shares: Sequence[Sequence[int]] | None = None, *,
                     costs: StageCosts | None = None, orders: FlushOrders | None = None,
                     ) -> tuple[tuple[Stage, ...], float, PipelineTime]:
    built = plan_terms(graph, stages, cluster, options=options, in_flight=in_flight,
                       recompute=recompute, shares=shares, costs=costs)
    terms, ranks, flight = built.terms, built.ranks, built.in_flight
    edges, params = dict(built.costs.edges), built.costs.params
    m = options.per_minibatch
    row = kind(options.schedule)
    copying = [row.copies_weights and n > 1 for n in flight]
    timed = pipeline_time(terms, edges, ranks, cluster, schedule=options.schedule,
                          microbatches=m, params=params, ties=built.costs.ties, orders=orders)
    transfers: list[list[float]] = [[] for _ in terms]  # per stage, its edges' in their order
    for (a, c), size in edges.items():
        seconds = transfer_seconds(size, slowest_link(cluster, ranks[a], ranks[c]))
        for i in {a, c}:
            transfers[i].append(seconds)
    priced = []
    for i, term in enumerate(terms):
        r = term.replicas
        comm = sum(transfers[i])
        versions = weight_versions(options.schedule, flight[i], copies=copying[i])
        mem = worker_memory(params[i], activations=built.activations(i, flight[i]),
                            in_flight=flight[i], versions=versions,
                            optimizer_state=options.optimizer_state).total
        if row.flush:  # one all-reduce and step per minibatch
            sync = term.allreduce
            work = term.busiest(m) * (term.compute + term.cpu_copies) + term.allreduce \
                + term.step
        else:
            sync = term.allreduce * update_share(options.schedule, m, r) * m / r
            work = timed.work[i]
        priced.append(Stage(nodes=tuple(stages[i][0]), replicas=r, ranks=ranks[i],
                            compute=term.compute * m / r, sync=sync, comm=comm * m / r,
                            memory=mem, time=work, copies=term.cpu_copies * m / r,
                            in_flight=flight[i], recompute=built.recompute[i],
                            shares=tuple(shares[i]) if shares and len(shares[i]) > 1
                            and len(set(shares[i])) > 1 else ()))
    total = max(timed.time_per_minibatch, shared_core_time(priced, cluster))
    return tuple(priced), total, timed


def _evaluate_pipedream(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
                        stage_of: dict[str, int], cluster: Cluster,
                        ) -> tuple[tuple[Stage, ...], float]:
    """The original optimizer's pricing (module docstring)."""
    view, _ = pipedream_view(graph)
    count = len(stages)
    ranks = [tuple(r) for _, r in stages]
    workers_after = [sum(len(ranks[j]) for j in range(i + 1, count)) for i in range(count)]
    compute = [0.0] * count
    params = [0.0] * count
    act = [0.0] * count
    for node, data in view.nodes(data=True):
        i = stage_of[node]
        compute[i] += float(data["fwd"]) + float(data["bwd"])
        params[i] += float(data["params"])
        act[i] += float(data["act"])
    comm = [0.0] * count
    frontiers = AugmentedFrontiers(view)
    node_act = np.array([float(view.nodes[n]["act"]) for n in frontiers.order])
    prefix = np.zeros(len(frontiers.order), dtype=bool)
    for i in range(count - 1):
        prefix[[frontiers.index[n] for n in stages[i][0] if n in frontiers.index]] = True
        cut = float(node_act[frontiers.frontier(prefix)].sum())
        level = cluster.slowest_level_of(list(ranks[i]) + list(ranks[i + 1]))
        bw = cluster.levels[level].bandwidth
        if i > 0:  # the original never charges the first stage's output (its base case)
            comm[i] = max(comm[i], 2.0 * cut / (bw * len(ranks[i])))
        comm[i + 1] = max(comm[i + 1], 2.0 * cut / (bw * len(ranks[i + 1])))
    priced = []
    for i in range(count):
        r = len(ranks[i])
        lv = cluster.levels[cluster.slowest_level_of(ranks[i])]
        sync = pipedream_sync(params[i], r, lv.bandwidth)
        work = compute[i] / r + sync
        priced.append(Stage(nodes=tuple(stages[i][0]), replicas=r, ranks=ranks[i],
                            compute=compute[i] / r, sync=sync, comm=comm[i],
                            memory=pipedream_memory(params[i], act[i], r, workers_after[i]),
                            time=max(work, comm[i])))
    return tuple(priced), max(s.time for s in priced)


def shared_core_time(stages: Sequence[Stage], cluster: Cluster) -> float:
    """Seconds per minibatch the busiest host needs when its workers outnumber its cores: the
    CPU work of its ranks per minibatch (each stage's work per minibatch, `Stage.time`: compute,
    sync, steps, weight copies and the loopback copies it sends; and the copies it receives, the
    same bytes again, `Stage.copies`) over its cores; 0 when every worker has a core of its own."""
    sharing = cluster.shared_cores()
    if sharing is None:
        return 0.0
    size, cores = sharing
    hosts: dict[int, float] = {}
    for stage in stages:
        for rank in stage.ranks:
            work = stage.time + stage.copies
            hosts[rank // size] = hosts.get(rank // size, 0.0) + work
    return max(hosts.values(), default=0.0) / cores


def data_parallel_time(graph: nx.DiGraph, cluster: Cluster, *, options: ModelOptions) -> float:
    """Time per minibatch of plain data parallelism over every worker of the cluster: under the
    native model the one-stage plan priced like any other (a flush schedule then cuts the
    minibatch into at least one microbatch per worker)."""
    if options.cost_model == "pipedream":
        view = pipedream_view(graph)[0]
        total = sum(float(d["fwd"]) + float(d["bwd"]) for _, d in view.nodes(data=True))
        params = sum(float(d["params"]) for _, d in view.nodes(data=True))
        # The original's recursion: each level all-reduces, divided by the workers inside.
        time, inside = total, 1
        for level in cluster.levels:
            n = level.workers
            time = (time + 4.0 * (n - 1) * params / (level.bandwidth * n) / inside) / n
            inside = n
        return time
    return evaluate(graph, [data_parallel_stage(graph, cluster)], cluster,
                    options=data_parallel_options(options, cluster))[1]


def data_parallel_stage(graph: nx.DiGraph, cluster: Cluster,
                        workers: int | None = None) -> tuple[list[str], tuple[int, ...]]:
    """Plain data parallelism as (nodes, ranks): everything on every worker (or the first
    `workers`)."""
    from pdcompile.cost.costgraph import topological_order

    return topological_order(graph), tuple(range(workers or cluster.workers))


def data_parallel_options(options: ModelOptions, cluster: Cluster,
                          workers: int | None = None) -> ModelOptions:
    """The options data parallelism is priced with: the same schedule, with at least one
    microbatch per worker (round up to a multiple of the workers) where it cuts minibatches."""
    from dataclasses import replace

    if not kind(options.schedule).microbatched:
        return options
    n = workers or cluster.workers
    return replace(options, microbatches=math.ceil(options.microbatches / n) * n)
