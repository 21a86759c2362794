"""A plan's time per minibatch under a schedule, in closed form (what the planner predicts).

The simulator (backends/simulate.py) runs the lowered schedule action by action; this module
gives the same figure from the per-stage costs without building that schedule, so that the
planner can price thousands of candidates. Both read one set of rules (cost/links.py for the wires,
cost/memory.py for memory, schedule/kinds.py for what a schedule does); a test holds the two
within 10% of each other on random plans, and benchmarks/RESULTS.md tabulates the shipped
profiles.

Per stage s (per microbatch; a whole minibatch for '1f1b'): t_s = forward + backward on one
replica, A_s its replicas' ring all-reduce, U_s its optimizer step, C_s a weight-version copy
(stashing stages only), X_s the CPU's share of its loopback sends. A_s includes the all-reduce
of the tied parameters the stage shares with other ranks (cost/ties.py), which the runtime runs
in the update; under '1f1b' it also couples the updates of the stages sharing them (below).
r_s replicas, N_s microbatches in flight per replica (warm-up depth + 1).

* Streaming schedules ('1f1b', '2bw'): the steady state's time per minibatch is the largest of
  - a stage's work per minibatch over its replicas: 1f1b, where each replica updates after its
    own minibatch, (t_s + X_s + A_s + U_s + C_s) / r_s; 2bw, where every replica updates once
    per minibatch of m microbatches, m (t_s + X_s) / r_s + A_s + U_s + C_s (`update_share`);
  - a link's occupancy: bytes / bandwidth over the lcm(r_a, r_c) rank pairs that share it;
  - the round trip (Little's law): a replica keeps N_s microbatches in flight, each for the
    round trip RT_s from its forward to its backward (its own work, every later stage's
    compute (a later stage with fewer replicas takes the round's r_s microbatches one after
    another), each transfer there and back on the rank pair that microbatch uses: pairs on one
    server are faster than pairs across servers, so the circuits follow the microbatches they
    chain and the slowest chain binds; replicas that all-reduce every round wait for the
    round's slowest, and a later stage's next round waits for its all-reduce, `_circuit_ratio`),
    so RT_s / (N_s r_s) per microbatch.
  Under '1f1b' every circuit of the steady state, these and those through several rounds of
  replicated stages of different sizes side by side (2-3-1), is one cycle of its event graph
  over lcm(r_0, ..., r_{S-1}) microbatches (cost/steady_cycle.py), and its largest cycle ratio
  replaces the circuits: the simulator's steady state, less the servers' interfaces (below);
  the circuits above remain for '2bw' and where that period exceeds `PAIRS_CAP`. Its cycles
  include those through a tie's all-reduce, which waits for the update of every stage sharing
  the tie: a last stage sharing an embedding with the first waits each minibatch for the
  backward to reach the first.
* Flush schedules (all of them: '1f1b-flush', 'gpipe', interleaved, zero bubble, V): one
  minibatch of M microbatches is a finite graph of actions, priced as its longest path
  (cost/flush_path.py): the simulator's makespan exactly, to rounding, on any stages, links,
  replicas and microbatch count (tests/planner/test_flush_longest_path.py), then bounded by
  the servers' interfaces as the simulator bounds it. The closed forms below remain for ranks
  that outnumber their host's processors, whose slowdown the longest path does not follow
  (the simulator shares the processors there), and for orders the generator refuses.
  The closed form ('1f1b-flush', 'gpipe'): the first
  microbatch's forward and the last one's backward cross every stage (sum of t_s and of the
  transfers there and back), and the busiest stage adds its other microbatches,
  (ceil(M / r_s) - 1) x its period (t_s, or RT_s / N_s, without the queueing of a round at
  a stage with fewer replicas, when too few are in flight to hide
  the round trip, the circuits chained through the replica's own turns); then every stage
  all-reduces and steps (what of that outlasts the backwards still to run before stage 0's
  last; GPipe's backward phase also hides it behind a busier stage or link before it).
  Replicas of different speeds count what the deal gives each at its own pace instead of
  ceil(M / r_s) (`StageTerms.busiest`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdcompile.cost.bubble import v_fill
from pdcompile.cost.cycle_ratio import Solved, largest_cycle_ratio
from pdcompile.cost.flush_path import FlushOrders, flush_makespan
from pdcompile.cost.links import (
    exposed_allreduce_seconds,
    link_busy_seconds,
    nic_busy_seconds,
    pair_levels,
    slowest_link,
    stage_allreduce_seconds,
    transfer_seconds,
)
from pdcompile.cost.shares import shared_speed
from pdcompile.cost.steady_cycle import steady_cycle, steady_solved
from pdcompile.cost.ties import SharedWeights, stage_tie_seconds
from pdcompile.cost.updates import copy_seconds, step_seconds, update_scale
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.ir import replica_pattern
from pdcompile.schedule.kinds import WGRAD_SHARE, kind


@dataclass(frozen=True)
class StageTerms:
    """Per-stage inputs of the closed form (seconds per microbatch unless said otherwise)."""

    fwd: float  # forward of one microbatch on one replica
    bwd: float  # backward of one microbatch on one replica
    # one all-reduce of the stage's gradients among its replicas (what of it the backward does
    # not hide), then of the tied parameters it shares with stages on other ranks (`tie`)
    allreduce: float
    step: float  # one optimizer step
    copy: float  # one copy of the weights (a new stashed version), 0 where none is made
    cpu_copies: float  # the CPU's share of the stage's loopback sends per microbatch
    replicas: int
    in_flight: int  # microbatches in flight per replica
    # of `bwd`, the weight gradients a stage that sends input gradients upstream computes after
    # that send where the schedule does not split the backward (runtime/stage_runtime.py): the
    # stages before it wait for the send, not for them
    deferred: float = 0.0
    # of `bwd`, the weight gradients a split backward computes in W (zero-bubble schedules)
    wgrad: float = 0.0
    # of `allreduce`, the all-reduces of tied parameters (cost/ties.py), which wait for every
    # stage of `tie_group` (the stages sharing them, this one included) to reach its update
    tie: float = 0.0
    tie_group: tuple[int, ...] = ()
    # per replica, its seconds per microbatch over `fwd` + `bwd` (replicas of two speeds: the
    # faster ones below 1); empty where the replicas compute alike
    paces: tuple[float, ...] = ()
    shares: tuple[int, ...] = ()  # per replica, its microbatches of each round; empty: one each

    @property
    def compute(self) -> float:
        """Forward and backward of one microbatch."""
        return self.fwd + self.bwd

    def busiest(self, microbatches: int) -> float:
        """The microbatches of a minibatch of `microbatches` that the stage's busiest replica
        computes, each counted at its pace (`paces`): ceil(m / r) where the replicas are
        alike; on a mixed cluster, max_i c_i x pace_i over the counts c_i the round robin (or
        the shares, `schedule.ir.replica_pattern`) deals out, so that a fast replica taking
        the extra microbatch of an uneven deal does not count as a slow one."""
        if not self.paces:
            return float(math.ceil(microbatches / self.replicas))
        pattern = replica_pattern(self.shares or (1,) * self.replicas)
        rounds, rest = divmod(microbatches, len(pattern))
        counts = [rounds * self.shares[i] if self.shares else rounds
                  for i in range(self.replicas)]
        for replica in pattern[:rest]:
            counts[replica] += 1
        return max(c * pace for c, pace in zip(counts, self.paces, strict=True))


@dataclass(frozen=True)
class PipelineTime:
    """The predicted time per minibatch and what bounds it."""

    time_per_minibatch: float
    bound: str  # e.g. "stage 1 work", "round trip of stage 0", "link 0->1", "fill and drain"
    work: tuple[float, ...]  # per stage, seconds per minibatch of work over its replicas
    # per stage, RT_s (seconds); () where a flush schedule is priced by its longest path
    round_trip: tuple[float, ...]
    # where a streaming pipeline's round trip bounds it, the stages on the binding circuit
    # (the microbatches they keep in flight, and what limits those, set its time); () where a
    # stage's work, a link, a server's interface or a flush's fill and drain does
    binding: tuple[int, ...] = ()


def update_share(schedule: str, microbatches: int, replicas: Any) -> Any:
    """The part of one update (all-reduce, step, weight copy) each microbatch a replica runs
    carries: all of it where every replica updates after each of its own minibatches (1f1b),
    replicas / microbatches where every replica updates once per minibatch (the replica runs
    microbatches / replicas of them). `replicas` may be a numpy array (the planner's grid)."""
    row = kind(schedule)
    if row.update == "round" or not row.microbatched:
        return 1.0
    return replicas / microbatches


def _streaming_work(terms: Sequence[StageTerms], schedule: str, m: int) -> list[float]:
    """Per stage, one replica's seconds per microbatch in a streaming schedule: compute, the
    CPU's share of its sends and its share of an update (`update_share`)."""
    return [t.compute + t.cpu_copies + (t.allreduce + t.step + t.copy)
            * update_share(schedule, m, t.replicas) for t in terms]


def _circuit_rules(schedule: str) -> tuple[bool, bool]:
    """(lockstep, queueing) for `_circuits`: replicas that all-reduce after every round wait for
    its slowest; a later stage with fewer replicas queues the round (streaming schedules)."""
    row = kind(schedule)
    return row.update == "round" and not row.flush, not row.flush


def stage_terms(*, fwd: Sequence[float], bwd: Sequence[float], params: Sequence[float],
                edges: dict[tuple[int, int], float], stage_ranks: Sequence[Sequence[int]],
                cluster: Cluster, schedule: str, in_flight: Sequence[int],
                copying: Sequence[bool], step: Sequence[float] | None = None,
                copy: Sequence[float] | None = None,
                shares: Sequence[Sequence[int]] | None = None,
                wgrad: Sequence[float] | None = None,
                ties: Sequence[SharedWeights] = ()) -> list[StageTerms]:
    """The closed form's inputs from per-stage costs (seconds per microbatch, bytes), the ranks
    of each stage and the cluster. `step` / `copy`: measured optimizer-step and weight-copy
    seconds per stage (default: cost/updates.py's estimates from the device's memory bandwidth);
    `copying[s]`: whether stage s makes weight-version copies at all. `wgrad`: seconds of each
    stage's backward that are weight gradients the runtime can defer (`StageCosts.wgrad`;
    default `WGRAD_SHARE` of it). `ties`: the tied parameters stages share (`StageCosts.ties`),
    whose all-reduce over their ranks each update of those stages waits for, after the
    replicas' (cost/ties.py). On a mixed cluster the
    costs are the reference device's: compute is divided by the slowest replica's speed and
    updates scaled to its memory (`Cluster.speed_of`, `cost.updates.update_scale`); where
    `shares[s]` gives the replicas unequal shares of each round, by their `shared_speed`."""
    row = kind(schedule)
    tied = stage_tie_seconds(ties, stage_ranks, cluster)
    partners: list[set[int]] = [set() for _ in stage_ranks]
    for tie in ties:
        if tie.seconds(stage_ranks, cluster) > 0.0:
            for s in tie.stages:
                partners[s].update(tie.stages)
    # per stage, the seconds its CPU copies the activations forward from a and their
    # gradients back from c, on every edge (a, c) it takes part in (edges in their order)
    copying_cpu = [0.0] * len(stage_ranks)
    if any(level.cpu_copies for level in cluster.levels):
        for (a, c), size in edges.items():
            level = slowest_link(cluster, stage_ranks[a], stage_ranks[c])
            if level.cpu_copies:
                busy = link_busy_seconds(size, level)
                for s in {a, c}:
                    copying_cpu[s] += busy
    receivers = {c for _, c in edges}
    out = []
    for s, ranks in enumerate(stage_ranks):
        sends_back = not row.split_backward and s in receivers
        cpu = copying_cpu[s]
        made = copying[s] and row.copies_weights
        weights = WGRAD_SHARE * bwd[s] if wgrad is None else min(wgrad[s], bwd[s])
        # on a mixed cluster the stage runs at its slowest replica's pace where they take turns,
        # at their shared speed where they take shares (cost/shares.py)
        speeds = [cluster.speed_of(r) for r in ranks]
        shared = shares is not None and len(shares[s]) > 1
        speed = shared_speed(speeds, shares[s]) if shares is not None and shared \
            else min(speeds)
        slowness, updates = 1.0 / speed, update_scale(cluster, ranks)
        alike = max(speeds) <= min(speeds) * (1.0 + 1e-12)
        out.append(StageTerms(
            fwd=fwd[s] * slowness, bwd=bwd[s] * slowness,
            allreduce=exposed_allreduce_seconds(
                stage_allreduce_seconds(params[s], ranks, cluster), backward=bwd[s] * slowness,
                params=params[s], bucket=cluster.allreduce_bucket) + tied[s],
            tie=tied[s], tie_group=tuple(sorted(partners[s])),
            step=updates * (step[s] if step is not None
                            else step_seconds(params[s], cluster.device)),
            copy=0.0 if not made else updates * (copy[s] if copy is not None
                                                 else copy_seconds(params[s], cluster.device)),
            cpu_copies=cpu, replicas=len(ranks), in_flight=max(1, int(in_flight[s])),
            deferred=weights * slowness if sends_back else 0.0,
            wgrad=weights * slowness if row.split_backward else 0.0,
            paces=() if alike else tuple(speed / v for v in speeds),
            shares=tuple(int(c) for c in shares[s]) if shares is not None and shared else ()))
    return out


def pipeline_time(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
                  stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                  microbatches: int, params: Sequence[float] | None = None,
                  ties: Sequence[SharedWeights] = (),
                  orders: FlushOrders | None = None) -> PipelineTime:
    """Time per minibatch of a pipeline (see the module docstring). `edges`: bytes per
    microbatch from stage a to stage c, (a, c) with a < c. `params`: the stages' parameter
    bytes, for the servers' network interfaces (`server_interface_seconds`, with the
    all-reduces of `ties`); None: not bounded by them. `orders`: flush orders made before
    (`flush_path.FlushOrders`), for a caller pricing many plans."""
    row = kind(schedule)
    m = microbatches if row.microbatched else 1
    shared = 0.0 if params is None else server_interface_seconds(
        edges, stage_ranks, params, cluster, schedule=schedule, microbatches=m, ties=ties)
    timed = _flush_path(terms, edges, stage_ranks, cluster, schedule=schedule, m=m,
                        ties=ties, orders=orders) if row.flush else None
    if timed is None:
        timed = _pipeline_time(terms, edges, stage_ranks, cluster, schedule=schedule, m=m)
    if shared * m > timed.time_per_minibatch:
        return replace(timed, time_per_minibatch=shared * m, bound="server interface",
                       binding=())
    return timed


def server_interface_seconds(edges: dict[tuple[int, int], float],
                             stage_ranks: Sequence[Sequence[int]], params: Sequence[float],
                             cluster: Cluster, *, schedule: str, microbatches: int,
                             ties: Sequence[SharedWeights] = ()) -> float:
    """Seconds per microbatch the busiest server's network interface needs
    (`links.nic_busy_seconds`), with each stage's ring all-reduces per microbatch as the
    schedule runs them (`update_share` of an update per microbatch a replica runs, over the
    replicas that all-reduce together) and the all-reduce of each tie (`ties`, cost/ties.py)
    over the ranks sharing it once per update of its stages: a bound on throughput that the
    closed form and the simulator both apply."""
    rings = [update_share(schedule, microbatches, len(r)) / len(r) for r in stage_ranks]
    tied = [(tie.ranks(stage_ranks), tie.nbytes, max(rings[s] for s in tie.stages))
            for tie in ties]
    return nic_busy_seconds(stage_ranks, edges, params, cluster, allreduces=rings, rings=tied)


def _flush_path(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
                stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                m: int, ties: Sequence[SharedWeights],
                orders: FlushOrders | None = None) -> PipelineTime | None:
    """A flush schedule's minibatch as the longest path through its actions
    (cost/flush_path.py: what the simulator runs, exactly), named by its busiest stage or link
    where that is busy for at least half of it, else by the fill and drain; None where it
    cannot say (ranks sharing processors, whose slowdown the pass does not follow, or an order
    the generator refuses): the closed form then."""
    if cluster.oversubscribed({r for group in stage_ranks for r in group}):
        return None
    seconds = flush_makespan(terms, edges, stage_ranks, cluster, schedule=schedule,
                             microbatches=m, ties=ties, orders=orders)
    if seconds is None:
        return None
    work = tuple(t.busiest(m) * t.compute for t in terms)
    busiest = [(w, f"stage {s} work") for s, w in enumerate(work)]
    busiest += [(m / math.lcm(len(stage_ranks[a]), len(stage_ranks[c]))
                 * link_busy_seconds(size, slowest_link(cluster, stage_ranks[a], stage_ranks[c])),
                 f"link {a}->{c}") for (a, c), size in edges.items()]
    most, bound = max(busiest, key=lambda b: b[0])
    return PipelineTime(seconds, bound if most >= seconds / 2 else "fill and drain", work, ())


def _pipeline_time(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
                   stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                   m: int) -> PipelineTime:
    """`pipeline_time` but for the servers' network interfaces."""
    row = kind(schedule)
    # seconds a transfer takes end to end, and the time it occupies its link
    pairs = _pair_transfers(edges, stage_ranks, cluster)
    transfer = {e: sum(sec) / len(sec) for e, sec in pairs.items()}
    busy = {e: link_busy_seconds(size, slowest_link(cluster, stage_ranks[e[0]],
                                                    stage_ranks[e[1]]))
            for e, size in edges.items()}
    own = [t.compute + t.cpu_copies for t in terms] if row.flush \
        else _streaming_work(terms, schedule, m)
    lockstep, queueing = _circuit_rules(schedule)
    if row.flush:
        circuits = _circuits(terms, own, pairs, lockstep=lockstep, queueing=queueing)
        timed = _flush(terms, transfer, busy, circuits, stage_ranks, m,
                       gpipe=row.forwards_first)
        if row.interleaved or row.split_backward:
            timed = _chunked(timed, terms, transfer, stage_ranks, m, interleaved=row.interleaved,
                             v_shape=schedule if row.v_shape else None)
        return timed
    work = [own[s] / t.replicas for s, t in enumerate(terms)]
    bounds: list[tuple[float, str, tuple[int, ...]]] = [
        (w, f"stage {s} work", ()) for s, w in enumerate(work)]
    bounds += [(seconds / math.lcm(len(stage_ranks[a]), len(stage_ranks[c])), f"link {a}->{c}",
                ()) for (a, c), seconds in busy.items()]
    # 1f1b's rounds: the steady state's event graph over one period of the replicas' rounds
    # (cost/steady_cycle.py), exact where its period is short enough to follow
    cycle = steady_cycle(terms, edges, stage_ranks, cluster, cap=PAIRS_CAP) if lockstep \
        else None
    if cycle is None:
        circuits = _circuits(terms, own, pairs, lockstep=lockstep, queueing=queueing)
        bounds += [(period, f"round trip of stage {s}", (s,))
                   for s, (period, _) in enumerate(circuits)]
        trips = [rt for _, rt in circuits]
    else:
        ratio, stages = cycle
        if ratio > max(b[0] for b in bounds) * (1.0 + 1e-9):  # not a stage's work or a link
            bounds.append((ratio, f"round trip of stage {stages[0]}", tuple(stages)))
        trips = [sum(p[-1]) / len(p[-1])
                 for p in _circuit_profiles(terms, own, pairs, queueing=False)]
    period, bound, binding = max(bounds, key=lambda b: b[0])
    return PipelineTime(period * m, bound, tuple(w * m for w in work), tuple(trips), binding)


Transfers = dict[tuple[int, int], list[float]]  # per stage edge, seconds per microbatch residue

PAIRS_CAP = 720  # microbatch residues a circuit is followed over; beyond, its slowest residue


def _pair_transfers(edges: dict[tuple[int, int], float], stage_ranks: Sequence[Sequence[int]],
                    cluster: Cluster) -> Transfers:
    """Per stage edge (a, c), the transfer's seconds for microbatch m, m < lcm(r_a, r_c): the
    round robin sends m from a[m % r_a] to c[m % r_c], and pairs on one server are faster than
    pairs across servers."""
    return {(a, c): [transfer_seconds(size, level)
                     for level in pair_levels(cluster, stage_ranks[a], stage_ranks[c])]
            for (a, c), size in edges.items()}


def _circuit_profiles(terms: Sequence[StageTerms], own: Sequence[float],
                      transfer: Transfers, *, queueing: bool) -> list[list[list[float]]]:
    """profiles[s][k - s][m]: seconds of the circuit from a forward of stage s through stage k
    and back to the backward of s (`_circuits`) for microbatch residue m: the work of s, then
    the longest path of stages and transfers (there and back, each on the rank pair microbatch
    m uses) from s to k; with `queueing` (streaming schedules), a later stage with fewer
    replicas takes the round's r_s microbatches one after another (a flush schedule's circuits
    bind only while the pipeline fills, and there the charge overestimates: 19% on a random
    plan); [own work] where k is not reached."""
    count = len(terms)
    incoming: list[list[tuple[int, list[float]]]] = [[] for _ in range(count)]
    for (a, c), seconds in transfer.items():
        incoming[c].append((a, seconds))
    out = []
    for s in range(count):
        period = 1
        for (a, _), seconds in transfer.items():
            if a >= s:
                period = math.lcm(period, len(seconds))
        slowest = period > PAIRS_CAP  # too many residues to follow: the slowest pair each
        residues = np.arange(1 if slowest else period)
        # longest path from s, without s's own work, per microbatch residue (None: not
        # reached); the same sums as one residue at a time, so the same floats
        reach: list[np.ndarray | None] = [None] * count
        reach[s] = np.zeros(len(residues))
        for k in range(s + 1, count):
            best = None
            for a, sec in incoming[k]:
                came = reach[a]
                if a < s or came is None:
                    continue
                hop = np.full(len(residues), max(sec)) if slowest \
                    else np.asarray(sec)[residues % len(sec)]
                path = came + 2.0 * hop
                best = path if best is None else np.maximum(best, path)
            if best is not None:  # a later stage with fewer replicas queues the round
                queued = terms[s].replicas / terms[k].replicas if queueing else 1.0
                reach[k] = best + terms[k].compute * max(1.0, queued) - terms[k].deferred
        out.append([(own[s] + np.maximum(0.0, there)).tolist() if there is not None
                    else [own[s] + 0.0] * len(residues) for there in reach[s:]])
    return out


def _orbit_length(lengths: Sequence[float], tokens: int) -> float:
    """The circuit's seconds averaged along the microbatches it chains: microbatch m leads to
    m + tokens, so residues fall in gcd(tokens, len) classes; the slowest class binds."""
    classes = math.gcd(tokens, len(lengths))
    return max(sum(lengths[c::classes]) / (len(lengths) // classes) for c in range(classes))


def _lockstep(lengths: list[float], replicas: int) -> list[float]:
    """Circuit lengths where a stage's replicas all-reduce after every round of `replicas`
    microbatches: the round waits for its slowest replica, so each residue of a round takes the
    round's longest circuit."""
    if replicas == 1 or len(lengths) % replicas:
        return lengths
    rounds = [max(lengths[i:i + replicas]) for i in range(0, len(lengths), replicas)]
    return [longest for longest in rounds for _ in range(replicas)]


# `_circuit_ratio`'s (r_k, own_k, serial, shift); serial: (replicas, seconds) per stage the
# round queues at, the j-th microbatch of a round waiting (j - 1) // replicas x seconds there
Queue = tuple[tuple[int, float], ...]
Waiting = tuple[int, float, Queue, int]


def _queued(serial: Queue, step: int) -> float:
    """What the `step`-th microbatch of a round waits behind the ones before it: at a stage of
    r replicas taking c seconds each, (step - 1) // r of them (round robin spreads a round over
    the replicas); the slowest such stage."""
    return max(((step - 1) // r * c for r, c in serial), default=0.0)


def _circuit_ratio(lengths: Sequence[float], tokens: int,
                   waits: Sequence[Waiting | None] = (None,),
                   turns: tuple[int, float] | None = None) -> float:
    """The largest time per microbatch that circuits of `lengths` (per microbatch residue, each
    advancing `tokens` microbatches: `_orbit_length`) impose; with `waiting` = (r_k, own_k,
    serial), a
    later stage k of r_k replicas that all-reduce in lockstep after every round: the round's
    all-reduce waits for the backward of its last microbatch m (m = r_k - 1 mod r_k), and each
    microbatch m + j of the next round (j = 1..r_k) waits for the all-reduce and step before
    its forward at k. So F_s(m) -> ... -> B_k -> all-reduce -> step -> F_k(m + j) -> ... ->
    B_s -> F_s(m + j + tokens) is a circuit too, j microbatches longer, from a round's last
    microbatch only: the plain circuit's path (of m there and of m + j back: their mean), k's
    own work once more (`own_k`: all-reduce, step, weight copy, compute), and the queue the
    round makes on its way back: its r_k microbatches leave k together, and the stages from s
    to k take them one after another, so m + j waits for j - 1 of them at the slowest of
    those stages (`serial`: its work per microbatch over its replicas). Circuits chain
    microbatch residues, and the slowest cycle of them binds (Howard's policy iteration for
    the largest cycle ratio, `cycle_ratio.largest_cycle_ratio`); the simulator runs exactly
    these orders (its ALLREDUCE waits for every replica's backward).

    Where k sits before the circuit's far stage K (a replicated stage in the middle), the
    round's wait lies on the circuit through K too: F_s(m) -> ... -> F_K -> B_K -> ... ->
    B_k(m') -> all-reduce -> step -> F_k(m' + j) -> ... -> F_K -> B_K -> ... -> B_s: the
    circuit's path, and k's own work with the round trip from k through K once more (`own_k`
    is then that round trip: the microbatches of the next round cross K again before they
    return), and the round's backward m' and the next forwards are apart by what k and K
    hold in flight: `shift` = (N_k - 1) r_k - (N_K - 1) r_K more microbatches on the way
    (0 where K is k).

    `turns` = (r_s, own_s), flush schedules: a replica of the circuit's head stage s runs
    its microbatches one after another, m then m + r_s, own_s apart (1F1B runs a backward
    between two forwards). A chain of circuits may step through them: where the circuits
    of alternate microbatches differ (a replica of a later stage on another server), the
    slow ones chain each other through the fast ones' turns (F(m) -> B(m) -> F(m + N) ->
    B(m + 1) -> F(m + N + 1) -> ...), so the slow class binds rather than the mean along
    the circuits alone: `lengths[m]` over `tokens` and own_s over r_s, one event graph.
    Streaming schedules leave it None: their queueing and rounds stand for it."""
    if tokens <= 0:
        return math.inf
    rounds = [w for w in waits if w is not None and w[0] > 1]
    if not rounds and turns is not None:
        replicas, work = turns
        size = math.lcm(len(lengths), replicas)
        if size <= PAIRS_CAP:
            chained = [[((m + tokens) % size, lengths[m % len(lengths)], tokens),
                        ((m + replicas) % size, work, replicas)] for m in range(size)]
            return largest_cycle_ratio(chained)[0]
    if not rounds:
        return _orbit_length(lengths, tokens) / tokens
    size = math.lcm(len(lengths), *(w[0] for w in rounds))
    if size > PAIRS_CAP:  # too many residues: each circuit's slowest
        worst = max(lengths)
        return max([worst / tokens] + [(worst + w[1]) / max(1, tokens + w[3] + 1)
                                       for w in rounds])
    # per round, the steps that carry tokens and what each waits in the queue (not per m)
    waits_of = [(replicas, later_own, shift,
                 [(step, _queued(serial, step)) for step in range(1, replicas + 1)
                  if tokens + shift + step > 0])
                for replicas, later_own, serial, shift in rounds]
    count = len(lengths)
    edges: list[list[tuple[int, float, int]]] = []
    for m in range(size):
        out = [((m + tokens) % size, lengths[m % count], tokens)]
        for replicas, later_own, shift, steps in waits_of:  # every round's wait, one graph
            if m % replicas != replicas - 1:
                continue
            for step, queue in steps:  # to each microbatch of the next round
                path = (lengths[m % count] + lengths[(m + step) % count]) / 2.0
                out.append(((m + tokens + shift + step) % size,
                            path + later_own + queue, tokens + shift + step))
        edges.append(out)
    return largest_cycle_ratio(edges)[0]


def _waiting(terms: Sequence[StageTerms], own: Sequence[float],
             profiles: Sequence[Sequence[Sequence[float]]],
             trips: Sequence[Sequence[Sequence[float]]], head: int, later: int,
             lockstep: bool) -> list[Waiting | None]:
    """`_circuit_ratio`'s `waiting` for circuits from stage `head` through stage `later`, one
    per replicated stage k after `head`, up to `later`, whose replicas all-reduce in lockstep
    (the stages from `head` to k take a round's microbatches one after another where they
    have one replica, (j - 1) // r deep where r, `_queued`: the queue the derivation counts;
    a replicated `head` next to a replicated k too, as 3-2-1 and 1-2-3-1 run); its own work
    with the round trip from k through `later` (`trips[k]`: `_circuit_profiles` without queueing,
    as a round's microbatches leave k one by one after its all-reduce; the mean over
    microbatch residues), and the shift between the two stages' in-flight holds. [None]
    where there is no such stage."""
    out: list[Waiting | None] = []
    for k in range(head + 1, later + 1):
        if not lockstep or terms[k].replicas == 1:
            continue
        trip = trips[k][later - k]
        shift = (terms[k].in_flight - 1) * terms[k].replicas \
            - (terms[later].in_flight - 1) * terms[later].replicas
        serial = tuple((terms[i].replicas, own[i]) for i in range(head, k))
        out.append((terms[k].replicas, sum(trip) / len(trip), serial, shift))
    tokens = terms[head].in_flight * terms[head].replicas \
        - (terms[later].in_flight - 1) * terms[later].replicas
    if lockstep and terms[head].replicas > 1 and later > head:
        # `head`'s own round: B_head(m) (the round's last) -> all-reduce -> step -> the
        # next round's forwards at `head`, r_head microbatches sooner than its in-flight
        # count alone allows; the round trip through `later` once, without queueing (the
        # circuit's path is `profiles`', queued: the difference corrects it). Replicated
        # stages after `head` spread the round over their replicas (2-2-1: the round's two
        # microbatches cross stage 1 side by side), so it queues (j - 1) // r deep there
        trip, queued = trips[head][later - head], profiles[head][later - head]
        serial = tuple((terms[i].replicas, terms[i].compute)
                       for i in range(head + 1, later + 1))
        out.append((terms[head].replicas, sum(trip) / len(trip) - max(queued), serial,
                    -terms[head].replicas))
    for k in range(head):  # a replicated stage before `head` (the circuit's backward reaches it)
        if not lockstep or terms[k].replicas == 1 \
                or any(terms[i].replicas > 1 for i in range(k + 1, head + 1)):
            continue
        # B_head -> ... -> B_k (a round's last) -> all-reduce -> step -> F_k -> ... -> F_head:
        # k's own work and the way there and back, without head's own compute
        trip = trips[k][head - k]
        there = sum(trip) / len(trip) - (terms[head].compute - terms[head].deferred)
        shift = (terms[k].in_flight - 1) * terms[k].replicas \
            - (terms[later].in_flight - 1) * terms[later].replicas - tokens
        serial = ((1, max(own[i] / terms[i].replicas for i in range(k + 1, head + 1))),)
        out.append((terms[k].replicas, there, serial, shift))
    return out or [None]


def _circuits(terms: Sequence[StageTerms], own: Sequence[float],
              transfer: Transfers, *, lockstep: bool, queueing: bool,
              ) -> list[tuple[float, float]]:
    """Per stage s: the largest time per microbatch that its in-flight limit imposes, and the
    round trip RT_s from its forward to its backward with nothing queued (averaged over rank
    pairs).

    A replica of s runs F(m) after B(m - N_s r_s) and, at a later stage k, F(m) is followed by
    B(m - (N_k - 1) r_k). So F_s(m) -> ... -> F_k(m) -> B_k(m - (N_k - 1) r_k) -> ... -> B_s ->
    F_s(m + N_s r_s - (N_k - 1) r_k) is a circuit of the schedule: its compute and transfers must
    fit in N_s r_s - (N_k - 1) r_k microbatch periods. k = s gives the stage's own work over its
    replicas; the last stage (N = 1) gives the whole round trip over N_s r_s periods.
    `lockstep`: replicas all-reduce after every round (`_lockstep`); `queueing`: see
    `_circuit_profiles`.
    """
    out = []
    profiles = _circuit_profiles(terms, own, transfer, queueing=queueing)
    trips = _circuit_profiles(terms, own, transfer, queueing=False) if queueing else profiles
    for s, profile in enumerate(profiles):
        head = terms[s]
        worst = profile[0][0] / head.replicas
        for k in range(s + 1, len(terms)):
            tokens = head.in_flight * head.replicas - (terms[k].in_flight - 1) * terms[k].replicas
            lengths = _lockstep(profile[k - s], head.replicas) if lockstep else profile[k - s]
            worst = max(worst, _circuit_ratio(
                lengths, tokens, _waiting(terms, own, profiles, trips, s, k, lockstep),
                turns=None if queueing else (head.replicas, own[s])))
        out.append((worst, sum(profile[-1]) / len(profile[-1])))
    return out


def work_period(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
                stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                microbatches: int) -> float:
    """A streaming pipeline's time per minibatch with enough in flight to hide every round
    trip: the largest of its stages' work and its links' occupancy (`pipeline_time` without
    the circuits)."""
    row = kind(schedule)
    m = microbatches if row.microbatched else 1
    work = [own / t.replicas for own, t in zip(_streaming_work(terms, schedule, m), terms,
                                               strict=True)]
    links = [link_busy_seconds(size, slowest_link(cluster, stage_ranks[a], stage_ranks[c]))
             / math.lcm(len(stage_ranks[a]), len(stage_ranks[c])) for (a, c), size in edges.items()]
    return max(work + links) * m


def fewest_in_flight(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
                     stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                     microbatches: int, period: float, limits: Sequence[int],
                     ratios: dict[tuple, float] | None = None) -> list[int]:
    """The fewest microbatches in flight per stage (each at most `limits[s]`, what its memory
    holds) whose circuits (`_circuits`) fit in `period` per microbatch: so a streaming
    pipeline reaches the throughput of its work and links, hiding its transfers, with no more
    activations and weight versions than that needs. Back to front, since a stage's circuits
    count the in-flight minibatches of the stages after it; under 1f1b then deepened where its
    steady state's event graph (`steady_cycle`, what `pipeline_time` prices) still binds.
    `ratios`: circuits' ratios by their inputs, kept across calls on one cut (the planner's
    recomputation trials price the same circuits again: GPT-2 XL on 128 H100s, 1,576 of
    3,755)."""
    known: dict[tuple, float] = {} if ratios is None else ratios

    def ratio(lengths: list[float], tokens: int, waits: list[Waiting | None]) -> float:
        key = (tuple(lengths), tokens, tuple(waits))
        if key not in known:
            known[key] = _circuit_ratio(lengths, tokens, waits)
        return known[key]

    row = kind(schedule)
    m = microbatches if row.microbatched else 1
    lockstep, queueing = _circuit_rules(schedule)
    own = _streaming_work(terms, schedule, m)
    transfer = _pair_transfers(edges, stage_ranks, cluster)
    profiles = _circuit_profiles(terms, own, transfer, queueing=queueing)
    trips = _circuit_profiles(terms, own, transfer, queueing=False) if queueing else profiles
    count = len(terms)
    chosen = [1] * count
    per = period / m * (1.0 + 1e-9)  # seconds per microbatch
    for s in range(count - 1, -1, -1):
        r = terms[s].replicas
        need = 1
        for k in range(s + 1, count):
            held = (chosen[k] - 1) * terms[k].replicas
            lengths = _lockstep(profiles[s][k - s], r) if lockstep else profiles[s][k - s]
            # the mean circuit gives a first guess; the circuit's slowest orbit may need more
            guess = sum(lengths) / len(lengths) / per if per > 0 else math.inf
            n = max(need, math.ceil((held + guess * (1.0 - 1e-9)) / r) if guess < math.inf
                    else limits[s])
            waits = _waiting(terms, own, profiles, trips, s, k, lockstep)
            while n < limits[s] and ratio(lengths, n * r - held, waits) > per:
                n += 1
            need = max(need, n)
        chosen[s] = max(1, min(limits[s], need))
    chosen = runnable_in_flight(chosen, [t.replicas for t in terms])
    if lockstep:  # the circuits above miss some of 1f1b's rounds: the event graph's word
        chosen = _deepened(terms, edges, stage_ranks, cluster, chosen, limits, per)
    return chosen


def _deepened(terms: Sequence[StageTerms], edges: dict[tuple[int, int], float],
              stage_ranks: Sequence[Sequence[int]], cluster: Cluster, chosen: list[int],
              limits: Sequence[int], per: float) -> list[int]:
    """`chosen` in-flight counts deepened, one microbatch at a time, while 1f1b's steady state
    (`steady_cycle`) is slower than `per` per microbatch: the binding circuit gains a token
    where a stage on it, or a stage before it that keeps the schedule runnable, holds one
    more; the first such stage (those on it front to back, then the others before it) whose
    step shortens it.

    Most steps shorten nothing (GPT-2 XL on 128 flat H100s: 1 of 266, each an event graph of
    up to 18,707 events), so each trial's policy iteration starts from the binding one's policy
    and stops at the first cycle that is still too slow (`steady_solved`'s `stop`): that
    proves the trial fails. A trial that may succeed is priced again from a cold start, whose
    binding cycle (of several that tie, which one) picks the next step's order of stages."""
    replicas = [t.replicas for t in terms]

    def cycle(flight: list[int], start: Solved | None = None,
              stop: float = math.inf) -> tuple[Solved, tuple[int, ...]] | None:
        deeper = [replace(t, in_flight=n) for t, n in zip(terms, flight, strict=True)]
        return steady_solved(deeper, edges, stage_ranks, cluster, cap=PAIRS_CAP, start=start,
                             stop=stop)

    found = cycle(chosen)
    while found is not None and found[0].ratio > per:
        solved, stages = found
        bar = solved.ratio * (1.0 - 1e-9)  # what a step must beat
        better = None
        for s in [*stages, *(k for k in range(max(stages)) if k not in stages)]:
            if chosen[s] >= limits[s]:
                continue
            trial = runnable_in_flight(chosen[:s] + [chosen[s] + 1] + chosen[s + 1:], replicas)
            if trial == chosen:
                continue
            # a cycle at least `bar` (with room for rounding) proves the trial fails
            warm = cycle(trial, start=solved, stop=bar * (1.0 + 1e-12))
            if warm is None or (warm[0].stopped and math.isfinite(warm[0].ratio)):
                continue
            tried = cycle(trial)
            if tried is not None and tried[0].ratio < bar:
                better = trial, tried
                break
        if better is None:
            break
        chosen, found = better
    return chosen


def runnable_in_flight(in_flight: Sequence[int], replicas: Sequence[int]) -> list[int]:
    """`in_flight` lowered where a later stage would hold more than the stages before it can
    feed: stage k's warm-up runs N_k - 1 forwards before its first backward, so every earlier
    stage s must keep (N_k - 1) r_k minibatches in flight and a round of its own beyond them,
    N_s r_s >= (N_k - 1) r_k + r_s (else the schedule deadlocks: every circuit needs a token)."""
    out = [max(1, int(n)) for n in in_flight]
    for k in range(1, len(out)):
        room = min((out[s] - 1) * replicas[s] for s in range(k))
        out[k] = max(1, min(out[k], 1 + room // replicas[k]))
    return out


def _flush(terms: Sequence[StageTerms], transfer: dict[tuple[int, int], float],
           busy: dict[tuple[int, int], float], circuits: Sequence[tuple[float, float]],
           stage_ranks: Sequence[Sequence[int]], m: int, *, gpipe: bool = False,
           ) -> PipelineTime:
    """One minibatch of `m` microbatches with a flush at the end (module docstring): the first
    microbatch's forward and backward along the longest path of stages and transfers, the
    busiest stage's other microbatches (GPipe: the busiest forward stage's, then the busiest
    backward stage's), then the last all-reduces and steps."""
    count = len(terms)
    reach = [0.0] + [-math.inf] * (count - 1)  # longest path from stage 0, its work included
    reach[0] = terms[0].compute + terms[0].cpu_copies
    for k in range(1, count):
        best = max((reach[a] + 2.0 * sec for (a, c), sec in transfer.items()
                    if c == k and reach[a] > -math.inf), default=0.0)
        reach[k] = best + terms[k].compute + terms[k].cpu_copies - terms[k].deferred
    path = max(reach)
    extra = []
    for s, t in enumerate(terms):
        share = t.busiest(m)  # microbatches on the stage's busiest replica
        period = t.compute + t.cpu_copies
        if share > t.in_flight:  # too few in flight to cover the round trip: the circuits bind
            period = max(period, circuits[s][0] * t.replicas)
        extra.append(((share - 1) * period, f"stage {s} work"))
    links = [((math.ceil(m / math.lcm(len(stage_ranks[a]), len(stage_ranks[c]))) - 1) * sec,
              f"link {a}->{c}") for (a, c), sec in busy.items()]
    if gpipe:  # all forwards, then all backwards: each phase has its own busiest stage or link
        forward = max([((t.busiest(m) - 1) * t.fwd, f"stage {s}")
                       for s, t in enumerate(terms)] + links)
        backward = max([((t.busiest(m) - 1) * t.bwd, f"stage {s}")
                        for s, t in enumerate(terms)] + links)
        extra = [(forward[0] + backward[0], f"{forward[1]} forwards, {backward[1]} backwards")]
    added, bound = max(extra + links, key=lambda e: e[0])
    # the last backward of stage s ends before stage 0's by the backwards of stages before it;
    # in GPipe's backward phase, which runs at the pace of its busiest stage or link, also by
    # what a busier one before it adds (`ahead`: s's all-reduce hides behind it; a link
    # (a, c) counts from a)
    phase = [(float(s), (t.busiest(m) - 1) * t.bwd) for s, t in enumerate(terms)] \
        + [(a + 0.5, seconds) for (seconds, _), (a, _) in zip(links, busy, strict=True)]
    back = tail = 0.0
    for s, t in enumerate(terms):
        ahead = 0.0 if not gpipe else max(v for _, v in phase) \
            - max((v for at, v in phase if at >= s), default=0.0)
        tail = max(tail, t.allreduce + t.step - back - ahead)
        back += t.bwd + max((sec for (a, _), sec in transfer.items() if a == s), default=0.0)
    work = tuple(t.busiest(m) * t.compute for t in terms)
    return PipelineTime(path + added + tail, bound if added > 0 else "fill and drain", work,
                        tuple(rt for _, rt in circuits))


def _chunked(flush: PipelineTime, terms: Sequence[StageTerms],
             transfer: dict[tuple[int, int], float], stage_ranks: Sequence[Sequence[int]],
             m: int, *, interleaved: bool, v_shape: str | None = None) -> PipelineTime:
    """Interleaved and zero-bubble schedules (cost/bubble.py's closed forms, for stages that
    differ): a rank holding several chunks works through all of them per microbatch, m times,
    while the pipeline fills and drains in chunk-sized steps, p - 1 of them; a split backward
    fills each of those steps' bubble with weight gradients, W = each stage's `StageTerms.wgrad`,
    so a step shrinks by 2 W (cost/bubble.py: (p - 1)(f + b + w) becomes (p - 1)(f + b - w))."""
    ranks = sorted({r for group in stage_ranks for r in group})
    per_rank = {r: sum(t.compute + t.cpu_copies for t, group in zip(terms, stage_ranks,
                                                                     strict=True) if r in group)
                for r in ranks}
    step = max(t.compute + t.cpu_copies - 2.0 * t.wgrad for t in terms)
    # weight gradients computed after a send leave each step with it (cost/bubble.py), at
    # least the smallest of them (stage 0 sends no input gradients)
    step -= min((t.deferred for t in terms[1:]), default=0.0)
    if v_shape is not None:  # a V (`v_shape`: its schedule): cost/bubble.py's V fill per step
        step = max(v_fill(v_shape, t.fwd, t.compute + t.cpu_copies - t.fwd - t.wgrad,
                          t.wgrad) for t in terms)
    tail = max(t.allreduce + t.step for t in terms)
    if interleaved:
        wires = 2.0 * max(transfer.values(), default=0.0) * (len(ranks) - 1)
        total = m * max(per_rank.values()) + (len(ranks) - 1) * step + wires + tail
    else:  # one stage per rank: 1F1B-flush's fill and drain, each step W shorter twice
        total = flush.time_per_minibatch - 2.0 * max(t.wgrad for t in terms) \
            * (len(ranks) - 1)
    return PipelineTime(total, flush.bound, flush.work, flush.round_trip)


__all__ = ["PipelineTime", "StageTerms", "fewest_in_flight", "pipeline_time",
           "runnable_in_flight", "stage_terms", "update_share",
           "work_period"]
