"""A flush schedule's minibatch priced as the longest path through its actions.

Why: one minibatch of a flush schedule is a finite graph of actions. Each rank runs its own in
the order the generator gives it (`schedule.generators.generate`, the order the simulator and
the runtime run), an action starts when its rank is free and its inputs have arrived, and every
duration is fixed by the stage costs. So the minibatch's makespan is the longest path through
that graph, which one pass in dependency order finds exactly: no closed form to fit, whatever
the stages, links and microbatches (the closed form of `pipeline_time._flush` charged 1F1B-flush
the downstream round trip in full where the busiest stage hides it, +17% at 4 microbatches, and
missed the forwards GPipe queues, -17%).

The pass follows backends/simulate.py's rules, action by action, without building the lowered
schedule: F and B wait for the transfers of their producer (F) and consumer (B) stages; a send
starts when its rank pair's link has carried the one before it (one transfer at a time per
directed pair, in send order) and arrives latency + bytes / bandwidth later, the sender busy
until its bytes are on the link where its CPU copies (loopback); a stage that sends input
gradients upstream computes its deferred weight gradients after that send; W (split backwards)
after its turn; at the end each replicated stage all-reduces once all its replicas get there,
then steps, a rank's first step also all-reducing the tied parameters it shares, once every
rank sharing them has reached its own.

What it cannot see, and the callers keep: the servers' network interfaces, which several flows
share (the simulator bounds the time by them too: `pipeline_time.server_interface_seconds`),
and ranks that outnumber their host's processors (`Level.cores`). Replicas of different speeds
each run at their own pace (`StageTerms.paces`); steps are scaled to the stage's slowest memory,
as the closed form scales them (`stage_terms`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from pdcompile.cost.links import link_busy_seconds
from pdcompile.cost.ties import SharedWeights, rank_tie_seconds, tie_partners
from pdcompile.errors import ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.kinds import kind


class Terms(Protocol):
    """What a stage's `pipeline_time.StageTerms` gives the pass (seconds; see there)."""

    @property
    def fwd(self) -> float: ...
    @property
    def bwd(self) -> float: ...
    @property
    def allreduce(self) -> float: ...
    @property
    def step(self) -> float: ...
    @property
    def replicas(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def deferred(self) -> float: ...
    @property
    def wgrad(self) -> float: ...
    @property
    def tie(self) -> float: ...
    @property
    def paces(self) -> tuple[float, ...]: ...
    @property
    def shares(self) -> tuple[int, ...]: ...


def flush_order(schedule: str, stage_ranks: Sequence[Sequence[int]], terms: Sequence[Terms],
                microbatches: int, *, orders: FlushOrders | None = None) -> Schedule | None:
    """The compute order of one minibatch (the generator's, with the stages' warm-up depths,
    in flight - 1, where the kind lets them be chosen, and their shares), or None where the
    generator refuses the shape. `orders`: orders made before, to take it from."""
    shape = _order_shape(schedule, stage_ranks, terms, microbatches)
    return orders.order(shape) if orders is not None else _generated(shape)


_Shape = tuple[str, tuple[tuple[int, ...], ...], int, tuple[int, ...] | None,
               tuple[tuple[int, ...], ...] | None]


def _order_shape(schedule: str, stage_ranks: Sequence[Sequence[int]], terms: Sequence[Terms],
                 microbatches: int) -> _Shape:
    """What the order depends on: the schedule, ranks, microbatches, and the warm-up depths or
    the replicas' shares (not the stages' seconds)."""
    row = kind(schedule)
    shared = any(t.shares for t in terms)
    return (schedule, tuple(tuple(r) for r in stage_ranks), microbatches,
            tuple(max(0, t.in_flight - 1) for t in terms)
            if row.chosen_warmup and not shared else None,
            tuple(t.shares or (1,) * t.replicas for t in terms) if shared else None)


def _generated(shape: _Shape) -> Schedule | None:
    schedule, stage_ranks, microbatches, warmup, shares = shape
    try:
        return generate(schedule, stage_ranks, microbatches, warmup=warmup, shares=shares)
    except ScheduleError:
        return None


class FlushOrders:
    """The flush orders one search has made, by shape, the most recent `keep` of them. Why:
    a planner's walk prices thousands of cuts that differ in which nodes a stage holds, not in
    ranks, microbatches or warm-up depths, so in the orders; generating each again was a sixth
    of planning densenet121 on cluster A (6,675 orders, 136 different)."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._made: OrderedDict[_Shape, Schedule | None] = OrderedDict()

    def order(self, shape: _Shape) -> Schedule | None:
        """The order of `shape` (`flush_order`'s), made here if not among the kept."""
        if shape in self._made:
            self._made.move_to_end(shape)
            return self._made[shape]
        made = _generated(shape)
        self._made[shape] = made
        if len(self._made) > self._keep:
            self._made.popitem(last=False)
        return made


def flush_makespan(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                   stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                   microbatches: int, ties: Sequence[SharedWeights] = (),
                   order: Schedule | None = None,
                   orders: FlushOrders | None = None) -> float | None:
    """Seconds from the first forward to the last step of one minibatch of the flush schedule
    `schedule` (module docstring); `edges`: bytes per microbatch from stage a to stage c.
    `order`: `flush_order` of these arguments, made before (None: made here, or taken from
    `orders`). None where the order cannot be generated or would deadlock (the simulator
    refuses it too)."""
    order = order if order is not None else flush_order(schedule, stage_ranks, terms,
                                                         microbatches, orders=orders)
    if order is None:
        return None
    split = kind(schedule).split_backward
    producers: list[list[int]] = [[] for _ in terms]
    consumers: list[list[int]] = [[] for _ in terms]
    for a, c in sorted(edges):
        consumers[a].append(c)
        producers[c].append(a)
    # per rank and stage its seconds per F, B before its sends, and W (deferred or split)
    pace: dict[tuple[int, int], float] = {}
    for s, (t, ranks) in enumerate(zip(terms, stage_ranks, strict=True)):
        for i, rank in enumerate(ranks):
            pace[rank, s] = t.paces[i] if t.paces else 1.0
    sends: dict[tuple[int, int, int], tuple[float, float, bool]] = {}

    def send(rank: int, dst: int, a: int, c: int) -> tuple[float, float, bool]:
        """(seconds on the link, latency, whether the sender copies) of stage edge (a, c)."""
        key = (rank, dst, a if a < c else c)
        found = sends.get(key)
        if found is None:
            size = edges[(a, c) if a < c else (c, a)]
            if dst == rank or not size:
                found = (0.0, 0.0, False)
            else:
                level = cluster.levels[cluster.link_level(rank, dst)]
                found = (link_busy_seconds(size, level), level.latency, level.cpu_copies)
            sends[key] = found
        return found

    arrived: dict[tuple[Kind, int, int, int], float] = {}  # (kind, from, to, microbatch)
    waiting: dict[tuple[Kind, int, int, int], list[int]] = {}
    link_free: dict[tuple[int, int], float] = {}
    actions = order.actions
    position = {rank: 0 for rank in actions}
    free = {rank: 0.0 for rank in actions}
    ready = list(actions)
    while ready:
        rank = ready.pop()
        own = actions[rank]
        at, now = position[rank], free[rank]
        while at < len(own):
            action = own[at]
            s, m, what = action.stage, action.microbatch, action.kind
            t = terms[s]
            if what is Kind.W:
                now += t.wgrad * pace[rank, s]
                at += 1
                continue
            peers = producers[s] if what is Kind.F else consumers[s]
            blocked = None
            for peer in peers:
                key = (what, peer, s, m)
                got = arrived.get(key)
                if got is None:
                    blocked = key
                    break
                if got > now:
                    now = got
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            if what is Kind.F:
                now += t.fwd * pace[rank, s]
                targets = consumers[s]
            else:
                now += (t.bwd - t.wgrad - t.deferred) * pace[rank, s]
                targets = producers[s]
            for peer in targets:
                dst = order.rank_of(peer, m)
                busy, latency, copies = send(rank, dst, s, peer)
                start = max(now, link_free.get((rank, dst), 0.0))
                link_free[rank, dst] = start + busy
                key = (what, s, peer, m)
                arrived[key] = start + busy + latency
                if copies:
                    now = start + busy
                ready.extend(waiting.pop(key, ()))
            if what is Kind.B and not split and t.deferred > 0.0:
                now += t.deferred * pace[rank, s]
            at += 1
        position[rank], free[rank] = at, now
    if any(position[rank] < len(own) for rank, own in actions.items()):
        return None  # a deadlock: some rank waits for what nobody sends
    return _updates(terms, stage_ranks, cluster, free, ties)


def _updates(terms: Sequence[Terms], stage_ranks: Sequence[Sequence[int]], cluster: Cluster,
             free: dict[int, float], ties: Sequence[SharedWeights]) -> float:
    """The end of the minibatch: per rank, each of its stages (ascending) all-reduces its
    replicas' gradients once all of them are there, then steps; a rank's first step also
    all-reduces its ties once every rank sharing them has reached its own step."""
    stages_of: dict[int, list[int]] = {}
    for s, ranks in enumerate(stage_ranks):
        for rank in ranks:
            stages_of.setdefault(rank, []).append(s)
    # a rank that holds several stages holds them on one replica each (chunks), so the
    # replicated stages are those of one-stage ranks: their all-reduce, then the steps
    before_step = dict(free)
    for t, ranks in zip(terms, stage_ranks, strict=True):
        if len(ranks) > 1:
            start = max(free[r] for r in ranks)
            for r in ranks:
                before_step[r] = start + t.allreduce - t.tie
    tied = rank_tie_seconds(ties, stage_ranks, cluster)
    partners = tie_partners(ties, stage_ranks)
    end = 0.0
    for rank, stages in stages_of.items():
        now = before_step[rank]
        if rank in tied:
            now = max([now] + [before_step[p] for p in partners.get(rank, ())]) + tied[rank]
        for s in stages:
            now += terms[s].step
        end = max(end, now)
    return end


__all__ = ["FlushOrders", "flush_makespan", "flush_order"]
