"""Timing a schedule when ranks outnumber the processors they run on (processes of one host).

The operating system shares a host's cores among the processes that want to run: with k of
them computing on c cores, each advances at min(1, c / k) of its own speed (processor sharing,
the fluid limit of time slicing). A rank wants a core while it computes (F, B, W, STEP, a weight
snapshot) and, on links whose copies the CPU makes (`Level.cpu_copies`), while it sends; it
gives its core up while it waits for data, for a dependency or for an all-reduce on the network.
A loopback transfer is two copies at once, the sender's into the kernel and the receiver's (a
gloo thread) out of it, so while it lasts the receiving host has one more thing to run.

Unlike the loop that gives every rank a processor (`simulate._dedicated`), finish times depend on
what the other ranks of the host do at the same moment, so this is an event loop in time order:
at every event (an action finishing, data arriving) the rates of the computing ranks are
recomputed. With never more than c things to run per host (ranks computing, receiving copies)
it gives the same times as that loop.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from pdcompile.backends.action_costs import ActionCosts, Times
from pdcompile.schedule.ir import Kind, Schedule

Ref = tuple[int, int]  # (rank, action index)

# work below this many seconds is done: rounding of `remaining -= dt * rate` must not leave an
# action waiting for a femtosecond event
_DONE = 1e-12


def share_processors(schedule: Schedule, deps: dict[int, list[tuple[Ref, ...]]],
                     work: ActionCosts, *, group_size: int, cores: int) -> tuple[Times, Times]:
    """(start, end) of every action, ranks `g * group_size ...` sharing `cores` processors."""
    actions = schedule.actions
    host = {rank: rank // group_size for rank in actions}
    begin: Times = {rank: [math.nan] * len(a) for rank, a in actions.items()}
    end: Times = {rank: [math.nan] * len(a) for rank, a in actions.items()}
    arrival: Times = {rank: [math.nan] * len(a) for rank, a in actions.items()}
    cursor = {rank: 0 for rank in actions}  # the next action of each rank
    # per host: what computes (a rank; a negative key: the receiving side's copy of a loopback
    # transfer) and the seconds of work it has left at full speed
    running: dict[int, dict[int, float]] = {h: {} for h in set(host.values())}
    copying: dict[Ref, list[float]] = {}  # a send being copied -> [copies left, latency]
    receiving: dict[int, Ref] = {}  # the receiving side's copy -> its send
    copy_ids = itertools.count(1)
    waiting: dict[Ref, list[int]] = {}  # an action not finished yet -> ranks blocked on it
    hearing: dict[Ref, list[int]] = {}  # a send whose arrival is unknown -> its receiver
    timers: list[tuple[float, int, int]] = []  # (when, rank, index): a timed wait ends
    link_free: dict[tuple[int, int], float] = {}
    ready = deque(sorted(actions))
    now = 0.0

    def finish(rank: int, index: int) -> None:
        end[rank][index] = now
        cursor[rank] = index + 1
        ready.append(rank)
        ready.extend(waiting.pop((rank, index), ()))

    def arrive(rank: int, index: int, when: float) -> None:
        arrival[rank][index] = when
        for receiver in hearing.pop((rank, index), ()):
            heapq.heappush(timers, (max(when, now), receiver, cursor[receiver]))

    def start(rank: int) -> None:
        index = cursor[rank]
        if index >= len(actions[rank]) or not math.isnan(end[rank][index]):
            return
        if math.isnan(begin[rank][index]):
            begin[rank][index] = now
        action = actions[rank][index]
        kind = action.kind
        if kind in (Kind.RECV_F, Kind.RECV_B):  # no processor while it waits
            ((sender, at),) = deps[rank][index]
            if math.isnan(arrival[sender][at]):
                hearing.setdefault((sender, at), []).append(rank)
            else:
                heapq.heappush(timers, (max(arrival[sender][at], now), rank, index))
            return
        for ref in deps[rank][index]:
            if math.isnan(end[ref[0]][ref[1]]):
                waiting.setdefault(ref, []).append(rank)
                return
        begin[rank][index] = now  # its inputs are all there
        if kind.is_compute or kind == Kind.STEP:
            compute(rank, index, work.compute(rank, action))
        elif kind == Kind.ALLREDUCE:
            heapq.heappush(timers, (now + work.allreduce[action.stage], rank, index))
        else:  # SEND_F / SEND_B
            dst, busy, latency, cpu_copies = work.send(rank, action)
            if cpu_copies and busy > _DONE:
                # the sender's CPU copies into the kernel while a thread of the receiver copies
                # out of it: two copies at once, each on its host's cores; the data is there
                # when both are done (the link is the sender's alone: no queue)
                copying[rank, index] = [2, latency]
                key = -next(copy_ids)
                receiving[key] = (rank, index)
                running[host[dst]][key] = busy
                running[host[rank]][rank] = busy
            elif cpu_copies:
                arrive(rank, index, now + latency)
                finish(rank, index)
            else:
                transfer = max(now, link_free.get((rank, dst), 0.0))
                link_free[rank, dst] = transfer + busy
                arrive(rank, index, transfer + busy + latency)
                finish(rank, index)

    def compute(rank: int, index: int, seconds: float) -> None:
        if seconds > _DONE:
            running[host[rank]][rank] = seconds
        else:
            done_computing(rank, index)

    def done_computing(rank: int, index: int) -> None:
        if (rank, index) in copying:
            copied(rank, index)
        finish(rank, index)

    def copied(rank: int, index: int) -> None:
        left = copying[rank, index]
        left[0] -= 1
        if left[0] == 0:
            del copying[rank, index]
            arrive(rank, index, now + left[1])

    while True:
        while ready:
            start(ready.popleft())
        step = math.inf  # seconds to the next computation's end
        for jobs in running.values():
            if jobs:
                step = min(step, min(jobs.values()) / min(1.0, cores / len(jobs)))
        timer = timers[0][0] if timers else math.inf
        if step == timer == math.inf:
            break
        if now + step <= timer:
            now += step
        else:
            step, now = timer - now, timer
        # what a rounding of `now` may leave of an action that ends at this event
        done_below = max(_DONE, 1e-13 * now)
        for jobs in running.values():
            if not jobs:
                continue
            rate = min(1.0, cores / len(jobs))
            done = []
            for key in jobs:
                jobs[key] -= step * rate
                if jobs[key] <= done_below:
                    done.append(key)
            for key in done:
                del jobs[key]
                if key < 0:
                    copied(*receiving.pop(key))
                else:
                    done_computing(key, cursor[key])
        while timers and timers[0][0] <= now:
            _, rank, index = heapq.heappop(timers)
            finish(rank, index)

    unfinished = [(rank, cursor[rank]) for rank in actions if cursor[rank] < len(actions[rank])]
    if unfinished:  # execution_order() refused deadlocks before this loop ran
        raise AssertionError(f"processor sharing stopped with actions left: {unfinished}")
    return begin, end
