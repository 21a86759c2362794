"""Lowering: add sends, receives, replica all-reduces and optimizer steps to a compute schedule.

For every stage edge (src, dst) with src < dst (a skip connection may jump stages):

- on the producer, after `F m`: `SEND_F m -> dst` (to the consumer's replica for m);
- on the consumer, before `F m`: `RECV_F m <- src`;
- on the consumer, after `B m`: `SEND_B m -> src`;
- on the producer, before `B m`: `RECV_B m <- dst`.

Sends are non-blocking; a receive blocks at its position. Weight updates (STEP k, preceded by
ALLREDUCE k on replicated stages) come after:

- "1f1b": every backward (k = m // replicas: one update per round of backwards across replicas);
- "1f1b-flush", "gpipe": the last action (k = 0);
- "2bw": the backward of the replica's last microbatch of each minibatch (k = minibatch index).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdcompile.errors import ScheduleError
from pdcompile.ir import Action, Kind, Schedule


def chain_edges(stages: int) -> list[tuple[int, int]]:
    """The edges of a straight chain of stages: (0, 1), (1, 2), ..."""
    return [(s, s + 1) for s in range(stages - 1)]


def check_edges(schedule: Schedule,
                stage_edges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated edges, each (src, dst) with 0 <= src < dst < stages."""
    edges = sorted({(int(a), int(b)) for a, b in stage_edges})
    for src, dst in edges:
        if not 0 <= src < dst < schedule.stages:
            raise ScheduleError(
                f"stage edge ({src}, {dst}) is not a forward edge of a {schedule.stages}-stage "
                f"pipeline; edges are (src, dst) with 0 <= src < dst < {schedule.stages}")
    return edges


def lower(schedule: Schedule, stage_edges: Iterable[tuple[int, int]] | None = None) -> Schedule:
    """The schedule with communication, ALLREDUCE and STEP actions added (see module docstring).

    `stage_edges` defaults to the straight chain. The result records its edges in
    `options["stage_edges"]` and `options["lowered"] = True`.
    """
    if schedule.options.get("lowered"):
        raise ScheduleError(f"schedule {schedule.name!r} is already lowered; lower the "
                            "compute-only schedule from passes.schedule.generate")
    edges = check_edges(schedule, chain_edges(schedule.stages) if stage_edges is None
                        else stage_edges)
    producers = {s: [a for a, b in edges if b == s] for s in range(schedule.stages)}
    consumers = {s: [b for a, b in edges if a == s] for s in range(schedule.stages)}
    per_minibatch = int(schedule.options.get("microbatches_per_minibatch", 1))

    actions: dict[int, tuple[Action, ...]] = {}
    for rank in schedule.ranks:
        stage = schedule.stage_of_rank(rank)
        replicas = len(schedule.stage_ranks[stage])
        own = schedule.actions.get(rank, ())
        last_of_minibatch = _last_of_minibatch(own, per_minibatch) if schedule.name == "2bw" else {}
        out: list[Action] = []
        for action in own:
            m = action.microbatch
            if action.kind == Kind.F:
                out.extend(Action(stage, Kind.RECV_F, m, src) for src in producers[stage])
                out.append(action)
                out.extend(Action(stage, Kind.SEND_F, m, dst) for dst in consumers[stage])
            elif action.kind in (Kind.B, Kind.W):
                if action.kind == Kind.B:
                    out.extend(Action(stage, Kind.RECV_B, m, dst) for dst in consumers[stage])
                out.append(action)
                if action.kind == Kind.B:
                    out.extend(Action(stage, Kind.SEND_B, m, src) for src in producers[stage])
                    if schedule.name == "1f1b":
                        out.extend(_update(stage, m // replicas, replicas))
                    elif m in last_of_minibatch:
                        out.extend(_update(stage, last_of_minibatch[m], replicas))
            else:
                raise ScheduleError(f"rank {rank}: lower() takes a compute-only schedule, found "
                                    f"{action}")
        if schedule.name in ("1f1b-flush", "gpipe"):
            out.extend(_update(stage, 0, replicas))
        actions[rank] = tuple(out)
    options = dict(schedule.options)
    options["lowered"] = True
    options["stage_edges"] = [list(e) for e in edges]
    return Schedule(schedule.name, schedule.microbatches, schedule.stage_ranks, actions, options)


def _update(stage: int, index: int, replicas: int) -> list[Action]:
    """ALLREDUCE (replicated stages only) then STEP, both numbered by the update index."""
    step = [Action(stage, Kind.STEP, index)]
    return ([Action(stage, Kind.ALLREDUCE, index)] if replicas > 1 else []) + step


def _last_of_minibatch(own: tuple[Action, ...], per_minibatch: int) -> dict[int, int]:
    """For 2bw: microbatch -> minibatch index, for this rank's last backward of each minibatch."""
    last: dict[int, int] = {}
    for action in own:
        if action.kind == Kind.B:
            last[action.microbatch // per_minibatch] = action.microbatch
    return {m: k for k, m in last.items()}
