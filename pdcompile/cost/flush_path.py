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
    """The flush orders one search has made, by shape, the most recent `keep` of them, and the
    walks through them (`FlushWalk`), by shape and stage edges. Why: a planner's walk prices
    thousands of cuts that differ in which nodes a stage holds, not in ranks, microbatches or
    warm-up depths, so in the orders; generating each again was a sixth of planning densenet121
    on cluster A (6,675 orders, 136 different), and following each order's dependencies again
    for every price nearly a fifth (8.5 of 37.8 CPU seconds; 2.3 with the walks kept)."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._made: OrderedDict[_Shape, Schedule | None] = OrderedDict()
        self._walks: OrderedDict[tuple[_Shape, tuple[tuple[int, int], ...]], FlushWalk] = \
            OrderedDict()

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

    def walk(self, shape: _Shape, order: Schedule,
             edges: tuple[tuple[int, int], ...]) -> FlushWalk:
        """The walk through `order` (that of `shape`) over the stage edges `edges` (sorted),
        made here if not among the kept."""
        key = (shape, edges)
        found = self._walks.get(key)
        if found is not None:
            self._walks.move_to_end(key)
            return found
        made = FlushWalk(order, shape[1], edges, split=kind(shape[0]).split_backward)
        self._walks[key] = made
        if len(self._walks) > self._keep:
            self._walks.popitem(last=False)
        return made


_W, _F, _B, _OTHER = 0, 1, 2, 3  # what a step of a walk does (`FlushWalk`)


class FlushWalk:
    """The pass of `flush_makespan` through one order and set of stage edges, its seconds left
    out: which action waits for which transfers, which link each send takes. Why: which rank
    runs next, which transfer an action waits for and which have arrived depend on the order and
    the edges alone, never on a stage's seconds, so the pass can be worked out once and then
    replayed for every cut of the same shape, its additions and maxima the same, in the same
    order (the price is the same to the bit).

    `segments`: (rank's place, its steps) in the order the pass runs them; a step is (what, the
    rank and stage's place in `pairs`, the transfers it waits for, its sends as (link, send
    slot, transfer)); `slots`: per send slot (rank, destination, stage edge), one per rank pair
    and lower stage as the pass prices them; `deadlocked`: some rank waits for what nobody
    sends."""

    def __init__(self, order: Schedule, stage_ranks: Sequence[Sequence[int]],
                 edges: tuple[tuple[int, int], ...], *, split: bool) -> None:
        self.split = split
        stages = len(stage_ranks)
        producers: list[list[int]] = [[] for _ in range(stages)]
        consumers: list[list[int]] = [[] for _ in range(stages)]
        for a, c in edges:
            consumers[a].append(c)
            producers[c].append(a)
        place: dict[tuple[int, int], int] = {}
        for s, ranks in enumerate(stage_ranks):
            for rank in ranks:
                place.setdefault((rank, s), len(place))
        # per place: (stage, replica index) of its pace (the last, as a dict keeps it)
        pairs: dict[int, tuple[int, int]] = {}
        for s, ranks in enumerate(stage_ranks):
            for i, rank in enumerate(ranks):
                pairs[place[rank, s]] = (s, i)
        self.pairs = [pairs[p] for p in range(len(place))]
        actions = order.actions
        self.ranks = list(actions)
        rank_place = {rank: i for i, rank in enumerate(self.ranks)}
        transfers: dict[tuple[Kind, int, int, int], int] = {}
        links: dict[tuple[int, int], int] = {}
        slots: dict[tuple[int, int, int], int] = {}
        self.slots: list[tuple[int, int, tuple[int, int]]] = []
        waiting: dict[tuple[Kind, int, int, int], list[int]] = {}
        position = {rank: 0 for rank in actions}
        self.segments: list[tuple[int, list[tuple[int, int, tuple[int, ...],
                                                  tuple[tuple[int, int, int], ...]]]]] = []
        ready = list(actions)
        while ready:
            rank = ready.pop()
            own = actions[rank]
            at = position[rank]
            steps: list[tuple[int, int, tuple[int, ...], tuple[tuple[int, int, int], ...]]] = []
            while at < len(own):
                action = own[at]
                s, m, what = action.stage, action.microbatch, action.kind
                here = place[rank, s]
                if what is Kind.W:
                    steps.append((_W, here, (), ()))
                    at += 1
                    continue
                peers = producers[s] if what is Kind.F else consumers[s]
                waits: list[int] = []
                blocked = None
                for peer in peers:
                    key = (what, peer, s, m)
                    got = transfers.get(key)
                    if got is None:
                        blocked = key
                        break
                    waits.append(got)
                if blocked is not None:
                    waiting.setdefault(blocked, []).append(rank)
                    break
                targets = consumers[s] if what is Kind.F else producers[s]
                sends: list[tuple[int, int, int]] = []
                for peer in targets:
                    dst = order.rank_of(peer, m)
                    slot_key = (rank, dst, s if s < peer else peer)
                    if slot_key not in slots:
                        slots[slot_key] = len(self.slots)
                        self.slots.append((rank, dst, (s, peer) if s < peer else (peer, s)))
                    link = links.setdefault((rank, dst), len(links))
                    key = (what, s, peer, m)
                    sent = transfers.setdefault(key, len(transfers))
                    sends.append((link, slots[slot_key], sent))
                    ready.extend(waiting.pop(key, ()))
                code = _F if what is Kind.F else _B if what is Kind.B else _OTHER
                steps.append((code, here, tuple(waits), tuple(sends)))
                at += 1
            position[rank] = at
            if steps:
                self.segments.append((rank_place[rank], steps))
        self.deadlocked = any(position[rank] < len(own) for rank, own in actions.items())
        self.links, self.transfers = len(links), len(transfers)

    def makespan_before_updates(self, terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                                cluster: Cluster) -> dict[int, float]:
        """Per rank, when its last action ends (`flush_makespan`'s pass with these seconds)."""
        split = self.split
        forward: list[float] = []
        backward: list[float] = []
        wgrad: list[float] = []
        deferred: list[float | None] = []
        for s, i in self.pairs:
            t = terms[s]
            pace = t.paces[i] if t.paces else 1.0
            forward.append(t.fwd * pace)
            backward.append((t.bwd - t.wgrad - t.deferred) * pace)
            wgrad.append(t.wgrad * pace)
            deferred.append(t.deferred * pace if not split and t.deferred > 0.0 else None)
        slots: list[tuple[float, float, bool]] = []
        for rank, dst, edge in self.slots:
            size = edges[edge]
            if dst == rank or not size:
                slots.append((0.0, 0.0, False))
            else:
                level = cluster.levels[cluster.link_level(rank, dst)]
                slots.append((link_busy_seconds(size, level), level.latency, level.cpu_copies))
        arrived = [0.0] * self.transfers
        link_free = [0.0] * self.links
        free = [0.0] * len(self.ranks)
        for at, steps in self.segments:
            now = free[at]
            for code, here, waits, sends in steps:
                if code == _W:
                    now += wgrad[here]
                    continue
                for w in waits:
                    got = arrived[w]
                    if got > now:
                        now = got
                now += forward[here] if code == _F else backward[here]
                for link, slot, sent in sends:
                    busy, latency, copies = slots[slot]
                    start = link_free[link]
                    if not start > now:  # max(now, the link's free time), as max keeps now
                        start = now
                    end = start + busy
                    link_free[link] = end
                    arrived[sent] = end + latency
                    if copies:
                        now = end
                if code == _B:
                    more = deferred[here]
                    if more is not None:
                        now += more
            free[at] = now
        return dict(zip(self.ranks, free, strict=True))


def flush_makespan(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                   stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                   microbatches: int, ties: Sequence[SharedWeights] = (),
                   order: Schedule | None = None,
                   orders: FlushOrders | None = None) -> float | None:
    """Seconds from the first forward to the last step of one minibatch of the flush schedule
    `schedule` (module docstring); `edges`: bytes per microbatch from stage a to stage c.
    `order`: `flush_order` of these arguments, made before (None: made here, or taken from
    `orders`, with the walk through it). None where the order cannot be generated or would
    deadlock (the simulator refuses it too)."""
    keys = tuple(sorted(edges))
    if order is None and orders is not None:
        shape = _order_shape(schedule, stage_ranks, terms, microbatches)
        order = orders.order(shape)
        if order is None:
            return None
        walk = orders.walk(shape, order, keys)
    else:
        order = order if order is not None else flush_order(schedule, stage_ranks, terms,
                                                             microbatches)
        if order is None:
            return None
        walk = FlushWalk(order, stage_ranks, keys, split=kind(schedule).split_backward)
    if walk.deadlocked:
        return None  # some rank waits for what nobody sends
    free = walk.makespan_before_updates(terms, edges, cluster)
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


__all__ = ["FlushOrders", "FlushWalk", "flush_makespan", "flush_order"]
