"""The one dependency function of the schedule IR, used by lowering, validation and simulation.

An action is named by its position `(rank, index)` in its rank's list. It may start when the
action before it on its rank has finished (program order) and when everything in
`dependencies(schedule)[(rank, index)]` has finished:

- lowered schedules: `RECV_F m <- p` on stage s waits for the matching `SEND_F m -> s` of stage p
  on the rank handling m (k-th receive matched with k-th send); `RECV_B` likewise with `SEND_B`.
  Sends wait for nothing else (they are non-blocking). `ALLREDUCE k` of a replicated stage is a
  collective: it waits until every other replica has finished the action before its own
  `ALLREDUCE k`, so all replicas start it together.
- compute-only schedules (no communication yet): `F m` of stage s waits for `F m` of every
  producer stage, `B m` for `B m` of every consumer stage (edges from `options["stage_edges"]`,
  else the straight chain). Lowering (`pdcompile.schedule.lower.lower`) reads these lists to
  place the communication: a receive before an action for each action it waits on, a send after
  an action to each stage waiting on it. So lowering, validation and simulation share one rule.

`execution_order` runs the ranks against these rules and reports a deadlock with the grid.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pdcompile.errors import ScheduleError
from pdcompile.schedule.ir import Action, Kind, Schedule

Ref = tuple[int, int]  # (rank, index in that rank's action list)

_COMM = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.ALLREDUCE)
_MATCH = {Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B}
_TARGETS_LOWERED = frozenset((Kind.SEND_F, Kind.SEND_B, Kind.ALLREDUCE))  # what others wait for
_TARGETS_COMPUTE = frozenset((Kind.F, Kind.B))
_WAITING = frozenset((Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE))  # what waits for others


def is_lowered(schedule: Schedule) -> bool:
    """Whether the schedule already carries its communication (it was lowered)."""
    if schedule.options.get("lowered"):
        return True
    return any(a.kind in _COMM for actions in schedule.actions.values() for a in actions)


def stage_edges(schedule: Schedule) -> list[tuple[int, int]]:
    """The schedule's stage edges: `options["stage_edges"]` or the straight chain."""
    given = schedule.options.get("stage_edges")
    if given is not None:
        return [(int(a), int(b)) for a, b in given]
    return [(s, s + 1) for s in range(schedule.stages - 1)]


def dependencies(schedule: Schedule) -> dict[Ref, tuple[Ref, ...]]:
    """For each action with cross-rank dependencies, the (rank, index) pairs it waits for.

    Program order (the previous action on the same rank) is implied and not listed. Raises
    ScheduleError (with the grid, the action marked) when an action has nothing to match.
    """
    return {(rank, index): waits for rank, per_rank in dependency_lists(schedule).items()
            for index, waits in enumerate(per_rank) if waits}


def dependency_lists(schedule: Schedule) -> dict[int, list[tuple[Ref, ...]]]:
    """The same as `dependencies`, as one list per rank (empty tuple: nothing to wait for)."""
    lowered = is_lowered(schedule)
    targets = _TARGETS_LOWERED if lowered else _TARGETS_COMPUTE
    # keyed by (rank, stage, kind, microbatch, peer): a plain tuple hashes far faster than an
    # Action, and these tables are built for every schedule a planner tries
    occurrences: dict[tuple[int, int, Kind, int, int | None], list[int]] = defaultdict(list)
    for rank, actions in schedule.actions.items():
        for index, action in enumerate(actions):
            if action.kind in targets:
                occurrences[rank, action.stage, action.kind, action.microbatch,
                            action.peer].append(index)
    if lowered:
        return _lowered(schedule, occurrences)
    return _compute_only(schedule, occurrences)


def _missing(schedule: Schedule, rank: int, index: int, what: str) -> ScheduleError:
    action = schedule.actions[rank][index]
    return ScheduleError(f"rank {rank} step {index} ({action}) {what}\n"
                         f"{schedule.grid(mark={rank: index})}")


def _lowered(schedule: Schedule,
             occurrences: dict[tuple[int, int, Kind, int, int | None], list[int]]
             ) -> dict[int, list[tuple[Ref, ...]]]:
    out: dict[int, list[tuple[Ref, ...]]] = {}
    seen: dict[tuple[int, int, Kind, int, int | None], int] = defaultdict(int)
    for rank, actions in schedule.actions.items():
        deps: list[tuple[Ref, ...]] = [()] * len(actions)
        out[rank] = deps
        for index, action in enumerate(actions):
            kind = action.kind
            if kind not in _WAITING:
                continue
            key = (rank, action.stage, kind, action.microbatch, action.peer)
            nth = seen[key]
            seen[key] = nth + 1
            if kind is not Kind.ALLREDUCE:  # a receive: matched with the nth send
                if action.peer is None:
                    raise _missing(schedule, rank, index, "has no peer stage")
                src = _peer_rank(schedule, action.peer, action.microbatch)
                found = (occurrences.get((src, action.peer, _MATCH[kind], action.microbatch,
                                          action.stage), []) if src is not None else [])
                if nth >= len(found):
                    want = Action(action.peer, _MATCH[kind], action.microbatch, action.stage)
                    raise _missing(schedule, rank, index,
                                   f"has no matching {want} on rank {src}")
                assert src is not None
                deps[index] = ((src, found[nth]),)
            else:
                waits: list[Ref] = []
                for other in schedule.stage_ranks[action.stage]:
                    if other == rank:
                        continue
                    found = occurrences.get((other,) + key[1:], [])
                    if nth >= len(found):
                        raise _missing(schedule, rank, index,
                                       f"has no partner {action} on replica rank {other}")
                    if found[nth] > 0:
                        waits.append((other, found[nth] - 1))
                deps[index] = tuple(waits)
    return out


def _compute_only(schedule: Schedule,
                  occurrences: dict[tuple[int, int, Kind, int, int | None], list[int]]
                  ) -> dict[int, list[tuple[Ref, ...]]]:
    edges = stage_edges(schedule)
    producers = {s: [a for a, b in edges if b == s] for s in range(schedule.stages)}
    consumers = {s: [b for a, b in edges if a == s] for s in range(schedule.stages)}
    out: dict[int, list[tuple[Ref, ...]]] = {}
    for rank, actions in schedule.actions.items():
        deps: list[tuple[Ref, ...]] = [()] * len(actions)
        out[rank] = deps
        for index, action in enumerate(actions):
            if action.kind == Kind.F:
                others = producers.get(action.stage, [])
            elif action.kind == Kind.B:
                others = consumers.get(action.stage, [])
            else:
                continue
            waits: list[Ref] = []
            for stage in others:
                peer = _peer_rank(schedule, stage, action.microbatch)
                found = (occurrences.get((peer, stage, action.kind, action.microbatch, None), [])
                         if peer is not None else [])
                if not found:
                    want = Action(stage, action.kind, action.microbatch)
                    raise _missing(schedule, rank, index,
                                   f"needs {want}, which rank {peer} never runs")
                assert peer is not None
                waits.append((peer, found[0]))
            deps[index] = tuple(waits)
    return out


def _peer_rank(schedule: Schedule, stage: int, microbatch: int) -> int | None:
    if not 0 <= stage < schedule.stages:
        return None
    return schedule.rank_of(stage, microbatch)


def execution_order(schedule: Schedule,
                    deps: dict[Ref, tuple[Ref, ...]] | dict[int, list[tuple[Ref, ...]]] | None
                    = None) -> list[Ref]:
    """Every action once, each after its rank predecessor and its dependencies.

    `deps` is what `dependencies` or `dependency_lists` returned (computed when None). Ranks
    advance as far as they can, lowest rank first; a rank blocked on an action resumes as soon
    as it finishes. Raises ScheduleError with the grid (blocked steps marked) on deadlock.
    """
    lists = _as_lists(schedule, deps)
    done_upto = {rank: -1 for rank in schedule.actions}  # last finished index per rank
    waiting_on: dict[int, dict[int, list[int]]] = {rank: {} for rank in schedule.actions}
    order: list[Ref] = []
    ready = deque(sorted(schedule.actions))
    queued = set(ready)
    while ready:
        rank = ready.popleft()
        queued.discard(rank)
        waits = lists[rank]
        watchers = waiting_on[rank]
        index = done_upto[rank] + 1
        while index < len(waits):
            blocked = False
            for other, at in waits[index]:
                if done_upto.get(other, -1) < at:
                    waiting_on[other].setdefault(at, []).append(rank)
                    blocked = True
                    break
            if blocked:
                break
            done_upto[rank] = index
            order.append((rank, index))
            if watchers:
                for waiting in watchers.pop(index, ()):
                    if waiting not in queued:
                        ready.append(waiting)
                        queued.add(waiting)
            index += 1
    total = sum(len(a) for a in schedule.actions.values())
    if len(order) < total:
        raise deadlock_error(schedule, _as_dict(lists), done_upto)
    return order


def _as_lists(schedule: Schedule,
              deps: dict[Ref, tuple[Ref, ...]] | dict[int, list[tuple[Ref, ...]]] | None
              ) -> dict[int, list[tuple[Ref, ...]]]:
    if deps is None:
        return dependency_lists(schedule)
    if deps and all(isinstance(v, list) for v in deps.values()):
        return deps  # type: ignore[return-value]
    lists: dict[int, list[tuple[Ref, ...]]] = {
        rank: [()] * len(actions) for rank, actions in schedule.actions.items()}
    for (rank, index), waits in deps.items():  # type: ignore[misc]
        lists[rank][index] = waits  # type: ignore[assignment]
    return lists


def _as_dict(lists: dict[int, list[tuple[Ref, ...]]]) -> dict[Ref, tuple[Ref, ...]]:
    return {(rank, index): waits for rank, per_rank in lists.items()
            for index, waits in enumerate(per_rank) if waits}


def deadlock_error(schedule: Schedule, deps: dict[Ref, tuple[Ref, ...]],
                   done_upto: dict[int, int]) -> ScheduleError:
    """The error for a schedule that cannot make progress: who waits for whom, and the grid."""
    blocked = {rank: done_upto[rank] + 1 for rank, actions in schedule.actions.items()
               if done_upto[rank] + 1 < len(actions)}
    lines = []
    for rank, index in sorted(blocked.items()):
        action = schedule.actions[rank][index]
        waits = [f"{schedule.actions[r][i]} (rank {r} step {i})"
                 for r, i in deps.get((rank, index), ()) if done_upto.get(r, -1) < i]
        lines.append(f"  rank {rank} step {index} {action} waits for " + ", ".join(waits))
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks: no rank can make progress\n" + "\n".join(lines)
        + "\n" + schedule.grid(mark=blocked))
