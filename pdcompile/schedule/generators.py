"""Schedule generators: the compute order (F and B actions) of every rank, as pure functions.

Implements the orders of PipeDream's 1F1B with round-robin replicas (Narayanan et al., "PipeDream:
Generalized Pipeline Parallelism for DNN Training", SOSP 2019, section 3.3), PipeDream-Flush and
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021) and
GPipe (Huang et al., NeurIPS 2019). Only the order is decided here; `schedule/lower.py` adds the
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

Microbatch m of stage s runs on replica `m % r_s` (1F1B-RR), or, where the replicas take unequal
shares of each round (`shares=`, a faster replica more), on the replica the round's pattern gives
it (`Schedule.shares`; each replica then its own depth, `shared_warmup_depths`); each replica
applies the same order to its own microbatches. `warmup=` overrides the depth per stage, e.g. with
`latency_aware_warmup`, which also counts the time transfers take (NOAM assumes they are free;
on slow links a stage then waits for gradients with nothing to do).

GPipe runs all forwards, then all backwards in reverse microbatch order (the last microbatch's
backward first, as autograd would), like figure 2(c) of the GPipe paper.

Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021, section 2.2.2): p ranks hold v non-adjacent chunks each,
stage (chunk) c on rank c mod p. Forwards go in rounds of p microbatches per chunk (chunk 0 of
microbatches 0..p-1, then chunk 1 of the same, ...), backwards the same way from the last chunk
down; rank r runs (v-1) p + 2 (p-1-r) forwards before its first backward, then alternates. Each
chunk is 1/v of a stage, so the fill and drain shrink v times: bubble (p-1)/(v m) of the ideal
time (`cost/bubble.py`). Two ranks, two chunks each, 4 microbatches (rank 0 holds stages 0
and 2, rank 1 stages 1 and 3)::

    rank 0:  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
    rank 1:  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward is split
into B (input gradients, which the previous stage waits for) and W (weight gradients, which
nobody waits for). ZB-H1 keeps 1F1B's warm-up (p-1-r forwards on rank r) and in-flight bound,
runs B where 1F1B runs the whole backward, and delays rank r's first r W's so that they fill the
drain: bubble (p-1)(f+b-w) per rank instead of 1F1B's (p-1)(f+b+w). A straight pipeline of 3
stages, 4 microbatches::

    stage 0:  0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
    stage 1:  1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
    stage 2:  2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3

`interleaved-zb` is the same split on an interleaved placement (ZB's ZB1P order over chunks, as
torch.distributed.pipelining's ScheduleInterleavedZeroBubble: warm-up (v-1) p + (p-1-r)).
All three are flush schedules: one minibatch of `microbatches` microbatches, one update at the
end, the result of ordinary training with gradient accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdcompile.errors import ScheduleError
from pdcompile.schedule.ir import Action, Kind, Schedule, replica_pattern
from pdcompile.schedule.kinds import kind, names
from pdcompile.schedule.placement import chunk_shape, v_chunks
from pdcompile.schedule.v_orders import V_ORDERS


def normalise_stage_ranks(stage_ranks: Sequence[Sequence[int]], *,
                          chunks: bool = False) -> tuple[tuple[int, ...], ...]:
    """`stage_ranks` as a tuple of tuples, checked: every stage has a rank, no rank twice (with
    `chunks`, a rank may hold several stages: see `interleaved_shape`)."""
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
            if rank in seen and not chunks:
                raise ScheduleError(f"rank {rank} appears in two stages of "
                                    f"{list(map(list, shape))}; a worker runs one stage (only "
                                    f"the interleaved schedules {names('interleaved')} place "
                                    "several chunks on one worker)")
            seen.add(rank)
    return shape


def interleaved_shape(stage_ranks: Sequence[Sequence[int]], *,
                      v_shape: bool = False) -> tuple[int, int]:
    """(p, v): ranks and chunks per rank of an interleaved placement (or a V), checked.

    K = p v stages, each on one rank; stages 0..p-1 on p distinct ranks, and stage c on the rank
    of stage c mod p (`planner.interleave.interleave` makes such a plan from a straight one), or
    with `v_shape` 2p stages in a V (`schedule.placement`, `planner.interleave.fold_v`).
    """
    normalise_stage_ranks(stage_ranks, chunks=True)
    return chunk_shape(stage_ranks, v_shape=v_shape)


def in_flight_limit(stage_ranks: Sequence[Sequence[int]], stage: int) -> int:
    """NOAM_s = ceil(workers in stages s..S-1 / replicas of s): in flight per replica."""
    later = sum(len(ranks) for ranks in stage_ranks[stage:])
    return math.ceil(later / len(stage_ranks[stage]))


def copies_weights(schedule: str, stage_ranks: Sequence[Sequence[int]], stage: int, *,
                   vertical_sync: bool = False,
                   shares: Sequence[Sequence[int]] | None = None) -> bool:
    """Whether weight stashing must copy `stage`'s weights (one snapshot per new version).

    Only when an update can fall between a minibatch's forward and its backward on one replica:
    asynchronous '1f1b' stages with more than one minibatch in flight (NOAM_s > 1), every stage
    under vertical sync (they use stage 0's version, older than their own), and '2bw' (two
    versions by design). A stage that runs each forward right before its backward (the last
    stage of a 1F1B pipeline) updates only after the backward, so the live weights are the
    version its minibatch needs and no copy is made. `updates_in_flight` states the same rule
    on a schedule's actions (the simulator uses it; the two agree on generated schedules).
    """
    row = kind(schedule)
    if not row.copies_weights:
        return False
    if row.stashed_versions != "in-flight":  # a fixed count of versions, each a copy
        return True
    if shares is not None:  # unequal shares: a replica with forwards ahead copies
        return vertical_sync or max(shared_warmup_depths(stage_ranks, shares)[stage]) > 0
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


def shared_warmup_depths(stage_ranks: Sequence[Sequence[int]],
                         shares: Sequence[Sequence[int]]) -> list[list[int]]:
    """Warm-up depth of every replica where the replicas of a stage take unequal shares.

    Measured in the stream, a replica of share c in a round of n that runs d forwards ahead
    runs the forward of a minibatch about d n / c minibatches later than the one whose
    backward comes next (its lookahead). Stage s must look ahead at least as far as any
    replica of stage s+1 does, plus that stage's round (its replicas all-reduce once the round
    is complete), or a replica of s+1 waits for a forward that s holds back until it gets a
    backward from s+1: L_s = max(lookahead of s+1's replicas) + n_{s+1}, L_last = 0, and the
    replica's depth is ceil(L_s c / n_s). Under round robin this is NOAM - 1 on a chain where
    replica counts do not grow downstream (`warmup_depth`); the last stage runs each forward
    right before its backward."""
    depths: list[list[int]] = [[] for _ in stage_ranks]
    reach = 0.0  # L_s of the stage being placed
    for stage in reversed(range(len(stage_ranks))):
        counts = list(shares[stage])
        n = sum(counts)
        depths[stage] = [math.ceil(reach * c / n - 1e-9) for c in counts]
        reach = max(d * n / c for d, c in zip(depths[stage], counts, strict=True)) + n
    return depths


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


def _updates_in_time(shape: tuple[tuple[int, ...], ...], actions: dict[int, tuple[Action, ...]],
                     per_minibatch: int, depths: Sequence[int]) -> None:
    """'2bw' runs minibatch t on the weights of the update after minibatch t - 2, so every
    replica's first forward of minibatch t must come after its own backwards of minibatch
    t - 2: with a warm-up of d forwards, at least d of its microbatches per minibatch. Refused
    here, naming the fewest microbatches per minibatch that suffice, rather than failing
    mid-run."""
    for stage, ranks in enumerate(shape):
        for rank in ranks:
            own: dict[int, int] = {}  # minibatch -> this replica's microbatches of it
            for action in actions[rank]:
                if action.kind is Kind.F:
                    t = action.microbatch // per_minibatch
                    own[t] = own.get(t, 0) + 1
            done: dict[int, int] = {}  # minibatch -> backwards run so far
            for action in actions[rank]:
                t = action.microbatch // per_minibatch
                if action.kind is Kind.B:
                    done[t] = done.get(t, 0) + 1
                elif t >= 2 and done.get(t - 2, 0) < own.get(t - 2, 0):
                    step = math.lcm(*(len(r) for r in shape))
                    least = max(len(r) * max(d, 1) for r, d in zip(shape, depths, strict=True))
                    least = math.ceil(least / step) * step
                    raise ScheduleError(
                        f"'2bw' runs minibatch t on the weights updated after minibatch t-2, "
                        f"but stage {stage} (rank {rank}, one of {len(ranks)} replicas) runs "
                        f"{depths[stage]} forwards ahead and takes only "
                        f"{per_minibatch // len(ranks)} of the {per_minibatch} microbatches of a "
                        f"minibatch: its forward of microbatch {action.microbatch} would come "
                        f"before its update of minibatch {t - 2}; use microbatches per "
                        f"minibatch >= {least} (or fewer stages or replicas)")


def _gpipe_order(microbatches: Sequence[int]) -> list[tuple[Kind, int]]:
    return [(Kind.F, m) for m in microbatches] + [(Kind.B, m) for m in reversed(microbatches)]


def rounds_of(microbatches: int, ranks: int) -> int:
    """Microbatches per round of an interleaved order: p, or all of them when there are fewer
    (`microbatches` must be a multiple of it; see `chunk_order`)."""
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ScheduleError(f"interleaved and zero-bubble orders take the microbatches in rounds "
                            f"of {ranks} (the ranks): {microbatches} microbatches make "
                            f"{rounds} rounds of unequal size; use a multiple of {ranks} "
                            f"(e.g. {rounds * ranks}) or fewer than {ranks}")
    return microbatches // rounds


def chunk_order(rank: int, ranks: int, chunks: int, microbatches: int, *,
                split: bool) -> list[tuple[Kind, int, int]]:
    """The compute order of position `rank` (0..p-1) as (kind, local chunk, microbatch).

    Forward number k runs local chunk (k // R) mod v and backward number k local chunk
    v-1 - (k // R) mod v, each on that chunk's next microbatch (R microbatches per round,
    `rounds_of`; with one chunk the rounds do not matter). Warm-up: (v-1) R forwards, plus
    2 (p-1-rank) (interleaved 1F1B) or p-1-rank (`split`: zero bubble); then one forward one
    backward; then the remaining backwards. With
    `split` each backward is B, and the W's follow in B order, one after every B once the rank
    has run `rank` B's (the first W's wait for the drain, where they fill the bubble).
    """
    per_round = rounds_of(microbatches, ranks) if chunks > 1 else microbatches
    total = chunks * microbatches
    depth = (chunks - 1) * per_round + (1 if split else 2) * (ranks - 1 - rank)
    warmup = min(depth, total)
    next_f, next_b = [0] * chunks, [0] * chunks
    order: list[tuple[Kind, int, int]] = []
    done_b: list[tuple[int, int]] = []  # (chunk, microbatch) of every B so far, for the W's
    weights = 0

    def forward(k: int) -> None:
        chunk = (k // per_round) % chunks
        order.append((Kind.F, chunk, next_f[chunk]))
        next_f[chunk] += 1

    def backward(k: int) -> None:
        nonlocal weights
        chunk = chunks - 1 - (k // per_round) % chunks
        order.append((Kind.B, chunk, next_b[chunk]))
        done_b.append((chunk, next_b[chunk]))
        next_b[chunk] += 1
        if split and k >= rank:
            order.append((Kind.W, *done_b[weights]))
            weights += 1

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    order.extend((Kind.W, *done_b[i]) for i in range(weights, len(done_b) if split else 0))
    return order


def generate(
    name: str,
    stage_ranks: Sequence[Sequence[int]],
    microbatches: int,
    *,
    vertical_sync: bool = False,
    microbatches_per_minibatch: int | None = None,
    warmup: Sequence[int] | None = None,
    recompute: Sequence[int] = (),
    shares: Sequence[Sequence[int]] | None = None,
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
    - "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipev": one minibatch of
      `microbatches` microbatches (module docstring); interleaved ones on a placement of
      chunks, V-shaped ones on a V (`interleaved_shape`; orders in `schedule.v_orders`).
    `recompute` lists the stages that drop their activations after the forward and recompute
    them in the backward (carried in `options["recompute"]` for the runtime and the simulator).
    `shares[s]`: how many microbatches of each round every replica of stage s takes (a faster
    replica more; `schedule.shares`); default one each (round robin). Unequal shares are carried
    in `options["shares"]`; '1f1b', '1f1b-flush' and 'gpipe' take them.
    """
    schedule = _generate(name, stage_ranks, microbatches, vertical_sync=vertical_sync,
                         microbatches_per_minibatch=microbatches_per_minibatch, warmup=warmup,
                         shares=checked_shares(name, stage_ranks, shares))
    if not recompute:
        return schedule
    stages = sorted({int(s) for s in recompute})
    if stages[0] < 0 or stages[-1] >= schedule.stages:
        raise ScheduleError(f"recompute names stages {stages}, but the pipeline has stages "
                            f"0..{schedule.stages - 1}")
    return Schedule(schedule.name, schedule.microbatches, schedule.stage_ranks,
                    schedule.actions, {**schedule.options, "recompute": stages})


def checked_shares(name: str, stage_ranks: Sequence[Sequence[int]],
                   shares: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    """`shares` as tuples, checked against the stages' replicas; None where every share is one
    (round robin: nothing to carry)."""
    if shares is None:
        return None
    given = tuple(tuple(int(c) for c in counts) for counts in shares)
    replicas = [len(ranks) for ranks in stage_ranks]
    if len(given) != len(replicas) or any(
            len(c) != r or min(c) < 1 for c, r in zip(given, replicas, strict=True)):
        raise ScheduleError(f"shares must give every replica of every stage a positive count of "
                            f"microbatches per round, one list per stage (replicas {replicas}); "
                            f"got {[list(c) for c in given]}")
    if all(c == 1 for counts in given for c in counts):
        return None
    row = kind(name)
    if row.chunked or row.microbatched_stream:
        raise ScheduleError(f"{name!r} does not take proportional shares {[list(c) for c in given]}"
                            "; use '1f1b', '1f1b-flush' or 'gpipe', or equal shares")
    return given


def _generate(name: str, stage_ranks: Sequence[Sequence[int]], microbatches: int, *,
              vertical_sync: bool, microbatches_per_minibatch: int | None,
              warmup: Sequence[int] | None,
              shares: tuple[tuple[int, ...], ...] | None = None) -> Schedule:
    row = kind(name)
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be a positive integer (got {microbatches!r})")
    if row.chunked:
        if warmup is not None:
            raise ScheduleError(f"warmup= applies to the 1F1B schedules, not {name!r}, whose "
                                "order fixes its own warm-up")
        return _chunked(name, stage_ranks, microbatches, vertical_sync=vertical_sync,
                        microbatches_per_minibatch=microbatches_per_minibatch)
    shape = normalise_stage_ranks(stage_ranks)
    if vertical_sync and not row.vertical_sync:
        raise ScheduleError(f"vertical_sync applies to the asynchronous '1f1b' schedule, "
                            f"not {name!r}")
    rounds = [sum(c) for c in shares] if shares is not None else [len(r) for r in shape]
    per_minibatch = _per_minibatch(name, shape, microbatches, microbatches_per_minibatch,
                                   rounds=rounds)
    depths = [warmup_depth(shape, s) for s in range(len(shape))]
    if warmup is not None:
        if not row.chosen_warmup or len(warmup) != len(shape) or any(int(w) < 0 for w in warmup):
            raise ScheduleError(f"warmup must give one depth >= 0 per stage ({len(shape)}) for a "
                                f"1F1B-ordered schedule; got {list(warmup)} for {name!r}")
        depths = [int(w) for w in warmup]
    # unequal shares: each replica its own depth (`shared_warmup_depths`; a depth given per
    # stage was chosen for round robin and does not carry over)
    per_replica = shared_warmup_depths(shape, shares) if shares is not None else None

    actions: dict[int, tuple[Action, ...]] = {}
    for stage, ranks in enumerate(shape):
        pattern = replica_pattern(shares[stage]) if shares is not None \
            else tuple(range(len(ranks)))
        for replica, rank in enumerate(ranks):
            own = [m for m in range(microbatches) if pattern[m % len(pattern)] == replica]
            if row.forwards_first:
                order = _gpipe_order(own)
            else:
                order = one_f_one_b(own, depths[stage] if per_replica is None
                                    else per_replica[stage][replica])
            actions[rank] = tuple(Action(stage, kind, m) for kind, m in order)
    if row.double_buffered:
        _updates_in_time(shape, actions, per_minibatch, depths)
    options: dict[str, object] = {"microbatches_per_minibatch": per_minibatch}
    if row.vertical_sync:
        options["vertical_sync"] = vertical_sync
    if warmup is not None and shares is None:
        options["warmup"] = depths
    if shares is not None:
        options["shares"] = [list(c) for c in shares]
    return Schedule(name, microbatches, shape, actions, options)


def _chunked(name: str, stage_ranks: Sequence[Sequence[int]], microbatches: int, *,
             vertical_sync: bool, microbatches_per_minibatch: int | None) -> Schedule:
    """interleaved-1f1b, zb-h1, interleaved-zb (`chunk_order` on every rank)."""
    row = kind(name)
    p, v = interleaved_shape(stage_ranks, v_shape=row.v_shape)
    shape = normalise_stage_ranks(stage_ranks, chunks=True)
    if vertical_sync:
        raise ScheduleError(f"vertical_sync applies to the asynchronous '1f1b' schedule, "
                            f"not {name!r}")
    if microbatches_per_minibatch not in (None, microbatches):
        raise ScheduleError(f"{name!r} runs one minibatch of `microbatches` microbatches; "
                            f"drop microbatches_per_minibatch={microbatches_per_minibatch}")
    if row.v_shape:
        return _v_shaped(name, shape, p, microbatches)
    if row.interleaved and v < 2:
        raise ScheduleError(f"{name!r} needs at least 2 chunks per rank; {len(shape)} stages on "
                            f"{p} ranks is one each: use 'zb-h1' or '1f1b-flush', or cut "
                            f"{2 * p} stages and interleave them (planner.interleave)")
    if not row.interleaved and v != 1:
        raise ScheduleError(f"{name!r} runs one stage per rank; for {v} chunks per rank use "
                            "'interleaved-zb'")
    if row.interleaved and p < 2:
        raise ScheduleError(f"{name!r} needs at least 2 ranks to interleave chunks over (got "
                            f"{p}); one rank runs its stages one after another ('1f1b-flush')")
    actions: dict[int, tuple[Action, ...]] = {}
    for position in range(p):
        rank = shape[position][0]
        order = chunk_order(position, p, v, microbatches,
                            split=row.split_backward)
        actions[rank] = tuple(Action(chunk * p + position, kind, m) for kind, chunk, m in order)
    return Schedule(name, microbatches, shape, actions,
                    {"microbatches_per_minibatch": microbatches})


def _v_shaped(name: str, shape: tuple[tuple[int, ...], ...], p: int,
              microbatches: int) -> Schedule:
    """zb-v and dualpipev (`schedule.v_orders`) on a V of 2p chunks."""
    if p < 2:
        raise ScheduleError(f"{name!r} needs at least 2 ranks to fold its V over (got {p}); "
                            "one rank runs its stages one after another ('1f1b-flush')")
    order_of = V_ORDERS[name]
    actions: dict[int, tuple[Action, ...]] = {}
    for position in range(p):
        chunks = v_chunks(position, p)
        actions[shape[position][0]] = tuple(
            Action(chunks[chunk], kind_, m) for kind_, chunk, m in order_of(position, p,
                                                                           microbatches))
    return Schedule(name, microbatches, shape, actions,
                    {"microbatches_per_minibatch": microbatches})


def _per_minibatch(name: str, shape: tuple[tuple[int, ...], ...], microbatches: int,
                   given: int | None, *, rounds: Sequence[int]) -> int:
    """Microbatches per minibatch (the unit of one weight update), checked against the rounds
    of the replicas (`rounds[s]`: microbatches per round of stage s; its replica count under
    round robin)."""
    replicas = list(rounds)
    row = kind(name)
    if not row.microbatched:
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
    if row.flush:
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
