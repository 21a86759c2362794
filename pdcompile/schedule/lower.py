"""Lowering: add sends, receives, replica all-reduces and optimizer steps to a compute schedule.

Where transfers go is read from the one dependency function,
`pdcompile.schedule.deps.dependency_lists`, applied to the compute-only schedule with
`options["stage_edges"]` set to the checked edges (`F m` of a stage waits for `F m` of every
producer stage, `B m` for `B m` of every consumer stage; an edge (src, dst) with src < dst may jump
stages, a skip connection):

- before an `F m`/`B m`: a `RECV_F m <- p`/`RECV_B m <- p` for each action it waits on (p: that
  action's stage), in stage order;
- after an `F m`/`B m` that others wait on: a `SEND_F m -> s`/`SEND_B m -> s` to each waiting
  stage s (its replica for m), in stage order.

So on a straight chain: `SEND_F m -> s+1` after `F m`, `RECV_F m <- s-1` before it, `SEND_B m ->
s-1` after `B m`, `RECV_B m <- s+1` before it. Sends are non-blocking; a receive blocks at its
position. A W (weight gradients) has no transfers: nobody waits for it. Weight updates (STEP k,
preceded by ALLREDUCE k on replicated stages) come after:

- "1f1b": every backward (k = m // replicas: one update per round of backwards across replicas);
  where the replicas take unequal shares (`options["shares"]`), the backward of a replica's last
  microbatch of each round (k = m // the round's size), after which it has all its share;
- flush schedules ("1f1b-flush", "gpipe", "interleaved-1f1b", "zb-h1", "interleaved-zb",
  "zb-v", "dualpipev"): the end of the rank's list (k = 0), one per stage the rank holds
  (chunks: in stage order);
- "2bw": the backward of the replica's last microbatch of each minibatch (k = minibatch index).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from pdcompile.errors import ScheduleError
from pdcompile.schedule.deps import dependency_lists
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import KINDS

_RECV = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}
_SEND = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}


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
                            "compute-only schedule from schedule.generators.generate")
    for rank, own in schedule.actions.items():
        for action in own:
            if not action.kind.is_compute:
                raise ScheduleError(f"rank {rank}: lower() takes a compute-only schedule, found "
                                    f"{action}")
    edges = check_edges(schedule, chain_edges(schedule.stages) if stage_edges is None
                        else stage_edges)
    edge_lists = [list(e) for e in edges]
    compute = Schedule(schedule.name, schedule.microbatches, schedule.stage_ranks,
                       schedule.actions, {**schedule.options, "stage_edges": edge_lists})
    waits = dependency_lists(compute)
    # waited_by[rank, index]: the stages whose actions wait for that action
    waited_by: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, per_rank in waits.items():
        for index, refs in enumerate(per_rank):
            for ref in refs:
                waited_by[ref].append(compute.actions[rank][index].stage)
    per_minibatch = int(schedule.options.get("microbatches_per_minibatch", 1))
    updates_at = updates_of(schedule)

    actions: dict[int, tuple[Action, ...]] = {}
    for rank in schedule.ranks:
        own = schedule.actions.get(rank, ())
        last_of_minibatch = (last_backward_of_minibatch(own, per_minibatch)
                             if updates_at == "minibatch" else {})
        last_of_round = (round_updates(schedule, own) if updates_at == "backward" else {})
        out: list[Action] = []
        for index, action in enumerate(own):
            m = action.microbatch
            stage = action.stage
            replicas = len(schedule.stage_ranks[stage])
            if action.kind in _RECV:
                peers = sorted(compute.actions[r][i].stage for r, i in waits[rank][index])
                out.extend(Action(stage, _RECV[action.kind], m, p) for p in peers)
            out.append(action)
            if action.kind in _SEND:
                out.extend(Action(stage, _SEND[action.kind], m, p)
                           for p in sorted(waited_by.get((rank, index), ())))
            if action.kind == Kind.B:
                if updates_at == "backward":
                    if m in last_of_round:
                        out.extend(_update(stage, last_of_round[m], replicas))
                elif m in last_of_minibatch:
                    out.extend(_update(stage, last_of_minibatch[m], replicas))
        if updates_at == "end":
            for stage in schedule.stages_of_rank(rank):
                out.extend(_update(stage, 0, len(schedule.stage_ranks[stage])))
        actions[rank] = tuple(out)
    options = dict(schedule.options)
    options["lowered"] = True
    options["stage_edges"] = edge_lists
    return Schedule(schedule.name, schedule.microbatches, schedule.stage_ranks, actions, options)


def _update(stage: int, index: int, replicas: int) -> list[Action]:
    """ALLREDUCE (replicated stages only) then STEP, both numbered by the update index."""
    step = [Action(stage, Kind.STEP, index)]
    return ([Action(stage, Kind.ALLREDUCE, index)] if replicas > 1 else []) + step


def updates_of(schedule: Schedule) -> str | None:
    """Where the updates of `schedule` go (`ScheduleKind.updates_at`); None for a schedule of
    a name the table does not know (written by hand: it gets no updates)."""
    row = KINDS.get(schedule.name)
    return row.updates_at if row is not None else None


def round_updates(schedule: Schedule, own: Sequence[Action]) -> dict[int, int]:
    """For '1f1b': microbatch -> round index, for this rank's last backward of each round of its
    stage's replicas (where its update goes; one per backward under round robin)."""
    last: dict[tuple[int, int], int] = {}
    for action in own:
        if action.kind == Kind.B:
            rounds = schedule.round_size(action.stage)
            last[action.stage, action.microbatch // rounds] = action.microbatch
    return {m: k for (_, k), m in last.items()}


def last_backward_of_minibatch(own: Sequence[Action], per_minibatch: int) -> dict[int, int]:
    """For 2bw: microbatch -> minibatch index, for this rank's last backward of each minibatch
    (where its update goes; validate checks lowered schedules against the same rule)."""
    last: dict[int, int] = {}
    for action in own:
        if action.kind == Kind.B:
            last[action.microbatch // per_minibatch] = action.microbatch
    return {m: k for k, m in last.items()}
