"""Schedule generators: the compute order (F and B actions) of every rank, as pure functions.

Implements the orders of PipeDream's 1F1B with round-robin replicas (Narayanan et al., "PipeDream:
Generalized Pipeline Parallelism for DNN Training", SOSP 2019, section 3.3), PipeDream-Flush and
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021) and
GPipe (Huang et al., NeurIPS 2019). Only the order is decided here; `passes/lower.py` adds the
communication, replica all-reduces and optimizer steps.

Warm-up depth. Stage s with r_s replicas and W_s workers in stages s..S-1 keeps
NOAM_s = ceil(W_s / r_s) minibatches in flight on each replica (PipeDream's "number of optimal
active minibatches"). A replica runs `NOAM_s - 1` forwards of its own minibatches (warm-up), then
alternates one forward and one backward (steady state), then runs the remaining backwards (drain).
In flight on one replica: never more than warm-up + 1 = NOAM_s. A straight pipeline of 4 stages
and 8 microbatches (`1f1b-flush`, `1f1b` alike; F of microbatch m written Fm)::

    stage 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    stage 1:     F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
    stage 2:        F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
    stage 3:           F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

Microbatch m of stage s runs on replica `m % r_s` (1F1B-RR); each replica applies the same order
to its own microbatches. `warmup=` overrides the depth per stage, e.g. with
`latency_aware_warmup`, which also counts the time transfers take (NOAM assumes they are free;
on slow links a stage then waits for gradients with nothing to do).

GPipe runs all forwards, then all backwards in reverse microbatch order (the last microbatch's
backward first, as autograd would), like figure 2(c) of the GPipe paper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdcompile.errors import ScheduleError
from pdcompile.ir import Action, Kind, Schedule

SCHEDULES = ("1f1b", "1f1b-flush", "gpipe", "2bw")
ASYNC_SCHEDULES = ("1f1b", "2bw")


def normalise_stage_ranks(stage_ranks: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """`stage_ranks` as a tuple of tuples, checked: every stage has a rank, no rank twice."""
    shape = tuple(tuple(int(r) for r in ranks) for ranks in stage_ranks)
    if not shape:
        raise ScheduleError("a schedule needs at least one stage; pass stage_ranks like "
                            "[[0], [1]] (stage 0 on rank 0, stage 1 on rank 1)")
    seen: set[int] = set()
    for stage, ranks in enumerate(shape):
        if not ranks:
            raise ScheduleError(f"stage {stage} has no ranks; every stage needs at least one "
                                "worker, e.g. stage_ranks=[[0, 1], [2]]")
        for rank in ranks:
            if rank in seen:
                raise ScheduleError(f"rank {rank} appears in two stages of "
                                    f"{list(map(list, shape))}; a worker runs one stage")
            seen.add(rank)
    return shape


def in_flight_limit(stage_ranks: Sequence[Sequence[int]], stage: int) -> int:
    """NOAM_s = ceil(workers in stages s..S-1 / replicas of s): in flight per replica."""
    later = sum(len(ranks) for ranks in stage_ranks[stage:])
    return math.ceil(later / len(stage_ranks[stage]))


def copies_weights(schedule: str, stage_ranks: Sequence[Sequence[int]], stage: int, *,
                   vertical_sync: bool = False) -> bool:
    """Whether weight stashing must copy `stage`'s weights (one snapshot per new version).

    Only when an update can fall between a minibatch's forward and its backward on one replica:
    asynchronous '1f1b' stages with more than one minibatch in flight (NOAM_s > 1), every stage
    under vertical sync (they use stage 0's version, older than their own), and '2bw' (two
    versions by design). A stage that runs each forward right before its backward (the last
    stage of a 1F1B pipeline) updates only after the backward, so the live weights are the
    version its minibatch needs and no copy is made. `updates_in_flight` states the same rule
    on a schedule's actions (the simulator uses it; the two agree on generated schedules).
    """
    if schedule == "2bw":
        return True
    if schedule != "1f1b":
        return False
    return vertical_sync or in_flight_limit(stage_ranks, stage) > 1


def updates_in_flight(actions: Sequence[Action]) -> bool:
    """Whether a weight update (STEP) of one rank falls while a microbatch it forwarded still
    awaits its backward: then weight stashing must snapshot the weights (`copies_weights`)."""
    in_flight: set[int] = set()
    for action in actions:
        if action.kind == Kind.F:
            in_flight.add(action.microbatch)
        elif action.kind == Kind.B:
            in_flight.discard(action.microbatch)
        elif action.kind == Kind.STEP and in_flight:
            return True
    return False


def warmup_depth(stage_ranks: Sequence[Sequence[int]], stage: int) -> int:
    """Forwards a replica of `stage` runs before its first backward (NOAM_s - 1)."""
    return in_flight_limit(stage_ranks, stage) - 1


def latency_aware_warmup(stage_ranks: Sequence[Sequence[int]], round_trip: Sequence[float],
                         period: float) -> list[int]:
    """Warm-up depth per stage that keeps the pipeline full when transfers take time.

    A replica of stage s must hold as many minibatches as arrive at it during one round trip of
    a minibatch from s to the end and back (`round_trip[s]` seconds, compute and transfers),
    one arriving every `replicas * period` seconds (`period`: the pipeline's time per
    minibatch). Depths never fall below NOAM, and a stage keeps at least `replicas - 1` more
    minibatches in flight than the next one: its replicas all-reduce after each round, so a round
    can only finish once the next stage has run the backward of the round's last minibatch,
    which that stage runs after the forwards of as many later minibatches as it keeps in flight.
    """
    shape = normalise_stage_ranks(stage_ranks)
    if len(round_trip) != len(shape) or not period > 0:
        raise ScheduleError(f"latency_aware_warmup needs one round trip per stage "
                            f"({len(shape)}, got {len(round_trip)}) and a period > 0 "
                            f"(got {period})")
    depths = [0] * len(shape)
    after = 0  # minibatches in flight at the next stage, all replicas
    for stage in reversed(range(len(shape))):
        replicas = len(shape[stage])
        needed = math.ceil(round_trip[stage] / (replicas * period) - 1e-9)
        in_flight = max(needed, in_flight_limit(shape, stage),
                        math.ceil((after + replicas - 1) / replicas))
        depths[stage] = in_flight - 1
        after = in_flight * replicas
    return depths


def one_f_one_b(microbatches: Sequence[int], warmup: int) -> list[tuple[Kind, int]]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    warmup = min(warmup, len(microbatches))
    order: list[tuple[Kind, int]] = [(Kind.F, m) for m in microbatches[:warmup]]
    backward = 0
    for m in microbatches[warmup:]:
        order.append((Kind.F, m))
        order.append((Kind.B, microbatches[backward]))
        backward += 1
    order.extend((Kind.B, m) for m in microbatches[backward:])
    return order


def _gpipe_order(microbatches: Sequence[int]) -> list[tuple[Kind, int]]:
    return [(Kind.F, m) for m in microbatches] + [(Kind.B, m) for m in reversed(microbatches)]


def generate(
    name: str,
    stage_ranks: Sequence[Sequence[int]],
    microbatches: int,
    *,
    vertical_sync: bool = False,
    microbatches_per_minibatch: int | None = None,
    warmup: Sequence[int] | None = None,
) -> Schedule:
    """The compute-only schedule `name` for a pipeline whose stage s runs on `stage_ranks[s]`.

    - "1f1b": PipeDream's asynchronous 1F1B over a stream of `microbatches` minibatches
      (1F1B-RR over replicas; one weight update per backward, per round of replicas). With
      replicated stages, `microbatches` must be a multiple of every stage's replica count.
    - "1f1b-flush" (PipeDream-Flush) and "gpipe": `microbatches` microbatches of one minibatch.
    - "2bw" (PipeDream-2BW): a stream of `microbatches` microbatches (global index), each
      minibatch being `microbatches_per_minibatch` consecutive ones, in 1F1B order without flush.
    `vertical_sync` is carried in `options` for the runtime (1f1b only). `warmup[s]` replaces
    the warm-up depth of stage s (forwards before the first backward, per replica; default
    NOAM_s - 1; not for gpipe).
    """
    shape = normalise_stage_ranks(stage_ranks)
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be a positive integer (got {microbatches!r})")
    if vertical_sync and name != "1f1b":
        raise ScheduleError(f"vertical_sync applies to the asynchronous '1f1b' schedule, "
                            f"not {name!r}")
    per_minibatch = _per_minibatch(name, shape, microbatches, microbatches_per_minibatch)
    depths = [warmup_depth(shape, s) for s in range(len(shape))]
    if warmup is not None:
        if name == "gpipe" or len(warmup) != len(shape) or any(int(w) < 0 for w in warmup):
            raise ScheduleError(f"warmup must give one depth >= 0 per stage ({len(shape)}) for a "
                                f"1F1B-ordered schedule; got {list(warmup)} for {name!r}")
        depths = [int(w) for w in warmup]

    actions: dict[int, tuple[Action, ...]] = {}
    for stage, ranks in enumerate(shape):
        replicas = len(ranks)
        for replica, rank in enumerate(ranks):
            own = list(range(replica, microbatches, replicas))
            if name == "gpipe":
                order = _gpipe_order(own)
            else:
                order = one_f_one_b(own, depths[stage])
            actions[rank] = tuple(Action(stage, kind, m) for kind, m in order)
    options: dict[str, object] = {"microbatches_per_minibatch": per_minibatch}
    if name == "1f1b":
        options["vertical_sync"] = vertical_sync
    if warmup is not None:
        options["warmup"] = depths
    return Schedule(name, microbatches, shape, actions, options)


def _per_minibatch(name: str, shape: tuple[tuple[int, ...], ...], microbatches: int,
                   given: int | None) -> int:
    """Microbatches per minibatch (the unit of one weight update), checked against replicas."""
    replicas = [len(r) for r in shape]
    if name == "1f1b":
        if given not in (None, 1):
            raise ScheduleError("'1f1b' updates after every minibatch; for several microbatches "
                                "per minibatch use schedule '2bw' or '1f1b-flush'")
        bad = [r for r in replicas if microbatches % r]
        if bad:
            need = math.lcm(*replicas)
            fixed = max(need, microbatches // need * need)
            raise ScheduleError(
                f"'1f1b' with replicas {replicas} needs a number of minibatches that is a multiple "
                f"of every replica count ({need}); got {microbatches}, use {fixed}")
        return 1
    if name in ("1f1b-flush", "gpipe"):
        if given not in (None, microbatches):
            raise ScheduleError(f"{name!r} runs one minibatch of `microbatches` microbatches; "
                                f"drop microbatches_per_minibatch={given}")
        return microbatches
    # 2bw
    if given is None or given < 1:
        raise ScheduleError("'2bw' needs microbatches_per_minibatch (a positive integer): the "
                            "microbatches of one minibatch, e.g. generate('2bw', ranks, 8, "
                            "microbatches_per_minibatch=4) for 2 minibatches of 4")
    if microbatches % given:
        raise ScheduleError(f"'2bw': {microbatches} microbatches is not a whole number of "
                            f"minibatches of {given}; use {max(1, microbatches // given) * given}")
    bad = [r for r in replicas if given % r]
    if bad:
        need = math.lcm(*replicas)
        raise ScheduleError(f"'2bw' with replicas {replicas} needs microbatches_per_minibatch "
                            f"to be a multiple of every replica count ({need}); got {given}")
    return given
