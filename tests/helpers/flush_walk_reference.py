"""The flush pass of cost/flush_path.py as it ran before `FlushWalk` kept its walks, action by
action through dicts on every call: the oracle that a kept walk prices every plan to the bit as
this did (tests/cost/test_flush_walks.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pdcompile.cost.flush_path as flush_path
from pdcompile.cost.flush_path import FlushOrders, Terms, flush_order
from pdcompile.cost.links import link_busy_seconds
from pdcompile.cost.ties import SharedWeights
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.kinds import kind


def reference_makespan(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                   stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, schedule: str,
                   microbatches: int, ties: Sequence[SharedWeights] = (),
                   order: Schedule | None = None,
                   orders: FlushOrders | None = None) -> float | None:
    """`flush_makespan` as the pass ran before its walks were kept: every dependency followed
    again, action by action, on every call."""
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
    return flush_path._updates(terms, stage_ranks, cluster, free, ties)
