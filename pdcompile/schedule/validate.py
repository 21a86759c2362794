"""validate(schedule): reject a schedule that misses or duplicates work or cannot make progress.

Checks, in order, each failure raising ScheduleError with the rank x step grid, the culprit marked:
1. every action on a rank belongs to a stage of that rank (one, or its chunks when interleaved);
2. every microbatch has exactly one F and one B on the right replica of every stage, F first;
   schedules that split the backward ("zb-h1", "interleaved-zb", "zb-v", "dualpipev") also
   exactly one W, after the B; the others none;
3. (lowered schedules) every send has exactly one matching receive and the other way round; for
   every stage edge the four transfers of each microbatch are where lowering puts them; weight
   updates on each rank are numbered 0, 1, 2, ... (none twice);
4. no deadlock: the ranks are run against `pdcompile.schedule.deps.dependencies` until all finish;
5. (lowered schedules) each rank has exactly the weight updates lowering gives it, none missing,
   duplicated or extra (per stage of the rank; a rank holding several chunks updates each):
   flush schedules one STEP 0 after the stage's last compute on the rank; "2bw" one
   STEP k per minibatch k the rank takes part in, after its last backward of k; "1f1b" STEP k
   after the backward of microbatch m with k = m // replicas; a STEP comes before the rank's
   next F/B. On a replicated stage ALLREDUCE k comes right before each STEP k; a stage without
   replicas has no ALLREDUCE. (Checked after the deadlock run, which explains an all-reduce
   out of order better.)
"""

from __future__ import annotations

from collections import Counter

from pdcompile.errors import ScheduleError
from pdcompile.schedule.deps import dependency_lists, execution_order, is_lowered, stage_edges
from pdcompile.schedule.ir import COMPUTE_KINDS, Action, Kind, Schedule
from pdcompile.schedule.kinds import KINDS, names
from pdcompile.schedule.lower import last_backward_of_minibatch, round_updates, updates_of


def _fail(schedule: Schedule, message: str, mark: dict[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"schedule {schedule.name!r}: {message}\n{schedule.grid(mark=mark)}")


def _positions(schedule: Schedule) -> dict[tuple[int, int, Kind, int, int | None], int]:
    """(rank, stage, kind, microbatch, peer) -> the first index of that action on that rank
    (plain tuples: they hash far faster than Actions)."""
    found: dict[tuple[int, int, Kind, int, int | None], int] = {}
    for rank, actions in schedule.actions.items():
        for index, a in enumerate(actions):
            found.setdefault((rank, a.stage, a.kind, a.microbatch, a.peer), index)
    return found


def validate(schedule: Schedule, *, progress: bool = True) -> None:
    """Raise ScheduleError if `schedule` is wrong (see module docstring); return None if sound.
    `progress=False` leaves out check 4, the deadlock run, for a caller that works out an
    execution order of the schedule next, which raises the same ScheduleError on a deadlock
    (`backends.simulate.prepare`: the planner's search cache builds and prepares each schedule
    once, and the run here was a tenth of its planning time on a 16-rank mixed cluster)."""
    unknown = sorted(set(schedule.actions) - set(schedule.ranks))
    if unknown:
        raise _fail(schedule, f"ranks {unknown} have actions but run no stage "
                    f"(stage_ranks={[list(r) for r in schedule.stage_ranks]})")
    _check_stages(schedule)
    _check_work(schedule)
    lowered = is_lowered(schedule)
    if lowered:
        _check_transfers(schedule)
        _check_updates(schedule)
    if progress:
        execution_order(schedule, dependency_lists(schedule))
    if lowered:
        _check_expected_updates(schedule)


def _check_stages(schedule: Schedule) -> None:
    for rank, actions in schedule.actions.items():
        stages = schedule.stages_of_rank(rank)
        for index, action in enumerate(actions):
            if action.stage not in stages:
                held = f"stage {stages[0]}" if len(stages) == 1 else \
                    f"stages {', '.join(map(str, stages))}"
                raise _fail(schedule, f"rank {rank} runs {held} but step {index} is "
                            f"{action} (stage {action.stage})", {rank: index})
            if not 0 <= action.microbatch or (action.kind in COMPUTE_KINDS
                                             and action.microbatch >= schedule.microbatches):
                raise _fail(schedule, f"rank {rank} step {index}: {action} is outside microbatches "
                            f"0..{schedule.microbatches - 1}", {rank: index})


def _check_work(schedule: Schedule) -> None:
    row = KINDS.get(schedule.name)
    split = row is not None and row.split_backward
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    positions: dict[tuple[int, Kind, int], list[tuple[int, int]]] = {}
    for rank, actions in schedule.actions.items():
        for index, action in enumerate(actions):
            if action.kind == Kind.W and not split:
                raise _fail(schedule, f"rank {rank} step {index}: {action} is a weight-gradient "
                            f"action, but schedule {schedule.name!r} does not split the "
                            f"backward (only {', '.join(names('split_backward'))} do)",
                            {rank: index})
            if action.kind in kinds:
                positions.setdefault((action.stage, action.kind, action.microbatch), []).append(
                    (rank, index))
    for stage in range(schedule.stages):
        how = ("round robin" if "shares" not in schedule.options
               else f"shares {list(schedule.shares[stage])} per round")
        for m in range(schedule.microbatches):
            rank = schedule.rank_of(stage, m)
            for kind in kinds:
                where = positions.get((stage, kind, m), [])
                if len(where) == 1 and where[0][0] == rank:
                    continue  # sound: once, on its replica
                name = f"{stage}{kind.value}{m}"
                if not where:
                    last = len(schedule.actions.get(rank, ()))
                    raise _fail(schedule, f"{name} is missing: stage {stage} must run {kind.value} "
                                f"of microbatch {m} on rank {rank}", {rank: last})
                if len(where) > 1:
                    raise _fail(schedule, f"{name} runs {len(where)} times (at rank, step "
                                f"{where}); each microbatch runs once per stage", dict(where[1:2]))
                if where[0][0] != rank:
                    raise _fail(schedule, f"{name} runs on rank {where[0][0]}, but microbatch {m} "
                                f"of stage {stage} belongs to rank {rank} ({how} over "
                                f"{list(schedule.stage_ranks[stage])})", dict(where))
            (_, f_at), = positions[stage, Kind.F, m]
            (_, b_at), = positions[stage, Kind.B, m]
            if b_at < f_at:
                raise _fail(schedule, f"{stage}B{m} comes before {stage}F{m} on rank {rank}",
                            {rank: b_at})
            if split:
                (_, w_at), = positions[stage, Kind.W, m]
                if w_at < b_at:
                    raise _fail(schedule, f"{stage}W{m} comes before {stage}B{m} on rank {rank}; "
                                "the weight gradients need the backward's output gradients",
                                {rank: w_at})


_SENDS = frozenset((Kind.SEND_F, Kind.SEND_B))
_TRANSFERS = frozenset((Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B))


def _check_transfers(schedule: Schedule) -> None:
    sends: Counter[tuple[Kind, int, int, int, int, int]] = Counter()
    recvs: Counter[tuple[Kind, int, int, int, int, int]] = Counter()
    where: dict[tuple[Kind, int, int, int, int, int], tuple[int, int]] = {}
    stages = schedule.stages
    for rank, actions in schedule.actions.items():
        for index, a in enumerate(actions):
            if a.kind not in _TRANSFERS:
                continue
            if a.peer is None or not 0 <= a.peer < stages or a.peer == a.stage:
                raise _fail(schedule, f"rank {rank} step {index}: {a} has no valid peer stage",
                            {rank: index})
            if a.kind in _SENDS:
                kind = Kind.F if a.kind == Kind.SEND_F else Kind.B
                key = (kind, a.stage, a.peer, a.microbatch, rank,
                       schedule.rank_of(a.peer, a.microbatch))
                sends[key] += 1
                where.setdefault(key, (rank, index))
            else:  # RECV_F, RECV_B
                kind = Kind.F if a.kind == Kind.RECV_F else Kind.B
                key = (kind, a.peer, a.stage, a.microbatch,
                       schedule.rank_of(a.peer, a.microbatch), rank)
                recvs[key] += 1
                where.setdefault(key, (rank, index))
    if sends != recvs:  # counts are positive: equal tables leave nothing to report
        for key in sorted(set(sends) | set(recvs), key=lambda k: (k[0].value,) + k[1:]):
            if sends[key] != recvs[key]:
                kind, src, dst, m, src_rank, dst_rank = key
                raise _fail(schedule, f"{kind.value}-transfer of microbatch {m} from stage {src} "
                            f"(rank {src_rank}) to stage {dst} (rank {dst_rank}): {sends[key]} "
                            f"send(s) but {recvs[key]} receive(s); each send needs exactly one "
                            "receive", dict([where[key]]))
    if "stage_edges" not in schedule.options:
        return
    position = _positions(schedule)
    for src, dst in stage_edges(schedule):
        for m in range(schedule.microbatches):
            prod, cons = schedule.rank_of(src, m), schedule.rank_of(dst, m)
            needed = [  # (rank, stage, transfer, peer, compute, side)
                (prod, src, Kind.SEND_F, dst, Kind.F, "after"),
                (cons, dst, Kind.RECV_F, src, Kind.F, "before"),
                (cons, dst, Kind.SEND_B, src, Kind.B, "after"),
                (prod, src, Kind.RECV_B, dst, Kind.B, "before"),
            ]
            for rank, stage, t_kind, peer, c_kind, side in needed:
                t_at = position.get((rank, stage, t_kind, m, peer))
                c_at = position.get((rank, stage, c_kind, m, None))
                assert c_at is not None  # _check_work ran first
                if t_at is not None and (t_at > c_at) == (side == "after"):
                    continue
                transfer, compute = Action(stage, t_kind, m, peer), Action(stage, c_kind, m)
                if t_at is None:
                    raise _fail(schedule, f"stage edge ({src}, {dst}) needs {transfer} {side} "
                                f"{compute} on rank {rank}", {rank: c_at})
                if (t_at > c_at) != (side == "after"):
                    raise _fail(schedule, f"{transfer} must come {side} {compute} on rank {rank}",
                                {rank: t_at})


def _check_updates(schedule: Schedule) -> None:
    for rank, actions in schedule.actions.items():
        expecting: dict[int, int] = {}  # per stage of the rank: the next update's number
        for index, a in enumerate(actions):
            if a.kind == Kind.STEP:
                expected = expecting.get(a.stage, 0)
                if 0 <= a.microbatch < expected:
                    raise _fail(schedule, f"rank {rank}: weight update {a} runs twice; each "
                                f"update runs once per rank (the next should be number "
                                f"{expected})", {rank: index})
                if a.microbatch != expected:
                    raise _fail(schedule, f"rank {rank}: weight update {a} should be number "
                                f"{expected} (updates count 0, 1, 2, ...)", {rank: index})
                expecting[a.stage] = expected + 1


def _update_anchors(schedule: Schedule, rank: int,
                    stage: int) -> list[tuple[int, int | None]] | None:
    """The weight updates lowering gives `stage` on `rank`, in order: (update index k, the
    index of the backward it follows; None: the rank's end). None when the schedule's name is
    not known."""
    actions = schedule.actions.get(rank, ())
    backwards = [(i, a.microbatch) for i, a in enumerate(actions)
                 if a.kind == Kind.B and a.stage == stage]
    updates_at = updates_of(schedule)
    if updates_at == "end":
        return [(0, None)]
    if updates_at == "backward":
        last = round_updates(schedule, actions)  # as lowering places them
        return [(last[m], i) for i, m in backwards if m in last]
    if updates_at == "minibatch":
        per_minibatch = int(schedule.options.get("microbatches_per_minibatch", 1))
        last = last_backward_of_minibatch(actions, per_minibatch)  # as lowering places them
        return sorted((last[m], i) for i, m in backwards if m in last)
    return None


def _update_rule(schedule: Schedule, replicas: int) -> str:
    backward = (f"STEP m // {replicas} after each backward B m" if "shares" not in
                schedule.options else "STEP k after the replica's last backward of round k")
    return {"end": "one STEP 0 at the end",
            "backward": backward,
            "minibatch": "one STEP k after the last backward of each minibatch k",
            }[str(updates_of(schedule))]


def _check_expected_updates(schedule: Schedule) -> None:
    for rank in schedule.ranks:
        actions = schedule.actions.get(rank, ())
        all_steps = [(i, a) for i, a in enumerate(actions) if a.kind == Kind.STEP]
        for stage in schedule.stages_of_rank(rank):
            steps = [(i, a) for i, a in all_steps if a.stage == stage]
            _check_stage_updates(schedule, rank, stage, steps)
            _check_allreduces(schedule, rank, stage, steps)


def _check_stage_updates(schedule: Schedule, rank: int, stage: int,
                         steps: list[tuple[int, Action]]) -> None:
    actions = schedule.actions.get(rank, ())
    anchors = _update_anchors(schedule, rank, stage)
    if anchors is None:
        return
    rule = _update_rule(schedule, len(schedule.stage_ranks[stage]))
    if len(steps) > len(anchors):
        at, step = steps[len(anchors)]
        raise _fail(schedule, f"rank {rank}: extra weight update {step} (schedule "
                    f"{schedule.name!r}: {rule}, {len(anchors)} on this rank)", {rank: at})
    last_compute = max((i for i, a in enumerate(actions) if a.kind in COMPUTE_KINDS),
                       default=-1)
    for n, (k, after) in enumerate(anchors):
        want = Action(stage, Kind.STEP, k)
        if n >= len(steps):
            where = len(actions) - 1 if after is None else after
            place = (f"after {actions[where]}" if where >= 0
                     else "on this rank, which has no actions")
            raise _fail(schedule, f"rank {rank}: weight update {want} is missing {place} "
                        f"(schedule {schedule.name!r}: {rule}; the rank has "
                        f"{len(steps)} of {len(anchors)})", {rank: max(where, 0)})
        at, step = steps[n]
        if step != want:
            raise _fail(schedule, f"rank {rank}: weight update {step} should be {want} "
                        f"({rule})", {rank: at})
        if after is None:
            trailing = [a for a in actions[at + 1:] if a.kind not in (Kind.STEP, Kind.ALLREDUCE)]
            if at < last_compute or trailing:
                raise _fail(schedule, f"rank {rank}: {step} must be the rank's last action (or "
                            f"among its last updates, one per stage it holds; {rule})",
                            {rank: at})
        else:
            between = [a for a in actions[after + 1:at] if a.kind in COMPUTE_KINDS]
            if at < after or between:
                raise _fail(schedule, f"rank {rank}: {step} must follow "
                            f"{actions[after]} before any other compute ({rule})",
                            {rank: at})


def _check_allreduces(schedule: Schedule, rank: int, stage: int,
                      steps: list[tuple[int, Action]]) -> None:
    actions = schedule.actions.get(rank, ())
    replicas = schedule.stage_ranks[stage]
    reduces = [(i, a) for i, a in enumerate(actions)
               if a.kind == Kind.ALLREDUCE and a.stage == stage]
    if len(replicas) == 1:
        if reduces:
            at, a = reduces[0]
            raise _fail(schedule, f"rank {rank}: {a} on a stage without replicas (only rank "
                        f"{rank}); ALLREDUCE belongs to replicated stages", {rank: at})
        return
    paired = set()
    for at, step in steps:
        want = Action(step.stage, Kind.ALLREDUCE, step.microbatch)
        if at == 0 or actions[at - 1] != want:
            raise _fail(schedule, f"rank {rank}: {step} on a replicated stage (ranks "
                        f"{list(replicas)}) needs {want} right before it, to sum the replicas' "
                        "gradients", {rank: at})
        paired.add(at - 1)
    for at, a in reduces:
        if at not in paired:
            raise _fail(schedule, f"rank {rank}: {a} is not followed by its STEP "
                        f"{a.microbatch}; each ALLREDUCE k comes right before STEP k", {rank: at})

