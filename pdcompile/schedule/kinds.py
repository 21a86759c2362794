"""One table of what each schedule kind means, read instead of comparing schedule names.

Every place that must know how a schedule behaves (the generators, lowering and validation, the
planner's cost model, the simulator, the runtime, the reports) asks `kind(name)` for these
facts; the table's keys are the one list of schedule names. A new schedule is a new row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdcompile.errors import ScheduleError

# the share of a backward that computes weight gradients, where a schedule splits it into B and W
# (a Linear layer's dX and dW are each a matrix product the size of its forward)
WGRAD_SHARE = 0.5


@dataclass(frozen=True)
class ScheduleKind:
    """The facts of one schedule that costs and reports depend on.

    flush: one run trains one minibatch cut into `microbatches` and ends with every update
        (time per minibatch = the run's makespan); otherwise minibatches stream through and the
        time per minibatch is the steady state's.
    microbatched: a minibatch is cut into microbatches (the CostGraph prices whole minibatches).
    update: "round": every replica updates after each of its own minibatches (PipeDream's 1F1B,
        replicas all-reducing once per round of r minibatches); "minibatch": one update per
        minibatch, after all its microbatches.
    stashed_versions: "in-flight": a weight version per minibatch in flight (weight stashing);
        an integer: that many versions at all times.
    copies_weights: a new weight version is a copy of the weights (1f1b stashing, 2bw).
    split_backward: the backward runs as B (input gradients) and W (weight gradients), W later.
    interleaved: a rank holds several non-adjacent stages (chunks), chunk c on rank c mod p
        (or in a V, where `v_shape`).
    v_shape: the chunks sit in a V (`schedule.placement`): 2 per rank, chunk c on rank c for
        c < p and on rank 2p - 1 - c after (ZB-V, DualPipeV).
    chosen_warmup: a 1F1B order whose warm-up depth (microbatches in flight) may be chosen per
        stage; the other orders fix their own.
    forwards_first: every forward of a minibatch before its first backward (GPipe), so all its
        microbatches' activations are held at once.
    vertical_sync: may run with vertical sync (every stage uses stage 0's weight version).
    microbatches_per_rank: the fewest microbatches per minibatch per rank the order runs with
        (DualPipeV's main phase needs 2 per rank); 0 where any number runs.
    """

    name: str
    flush: bool
    microbatched: bool
    update: str
    stashed_versions: str | int
    copies_weights: bool
    split_backward: bool = False
    interleaved: bool = False
    v_shape: bool = False
    chosen_warmup: bool = True
    forwards_first: bool = False
    vertical_sync: bool = False
    microbatches_per_rank: int = 0

    @property
    def asynchronous(self) -> bool:
        """Minibatches stream through without a flush, updates landing between them."""
        return not self.flush

    @property
    def chunked(self) -> bool:
        """Ordered by chunk (interleaved or B/W split) rather than per stage by 1F1B or GPipe."""
        return self.interleaved or self.split_backward

    @property
    def double_buffered(self) -> bool:
        """Two weight versions by design (2BW): minibatch t runs on the weights of update t-1."""
        return self.stashed_versions == 2

    @property
    def updates_at(self) -> str:
        """Where lowering puts a stage's updates: "end" (one at the end of the run), "backward"
        (after every backward, numbered by round) or "minibatch" (after the last backward of
        each minibatch)."""
        if self.flush:
            return "end"
        return "backward" if self.update == "round" else "minibatch"

    @property
    def averages_replicas(self) -> bool:
        """Replicas' gradients are averaged, not summed: each replica's minibatch is a whole one
        whose loss is not scaled (updates after every round), where the others scale each
        microbatch's loss by 1/M and sum."""
        return self.update == "round"

    def per_minibatch(self, microbatches: int) -> int:
        """Microbatches per minibatch (the unit of one update): 1 where a minibatch is not cut."""
        return microbatches if self.microbatched else 1

    def loss_scale(self, per_minibatch: int) -> float:
        """The factor on each microbatch's loss: the mean over a minibatch's microbatches."""
        return 1.0 / per_minibatch if self.microbatched else 1.0

    @property
    def microbatched_stream(self) -> bool:
        """A stream of minibatches each cut into microbatches (2BW)."""
        return self.microbatched and not self.flush

    def run_length(self, replicas: Sequence[int], *, microbatches: int,
                   minibatches: int) -> int:
        """Microbatches a run of `minibatches` generates (the stream length rule): a flush
        schedule, one minibatch of `microbatches`; a microbatched stream (2BW), `minibatches` of
        `microbatches` each; a stream of whole minibatches (1F1B), `minibatches` rounded up to
        whole rounds of every replica count (`stream_length`)."""
        if self.flush:
            return microbatches
        if self.microbatched:
            return microbatches * minibatches
        return stream_length(replicas, minibatches)


KINDS: dict[str, ScheduleKind] = {
    "1f1b": ScheduleKind("1f1b", flush=False, microbatched=False, update="round",
                         stashed_versions="in-flight", copies_weights=True, vertical_sync=True),
    "1f1b-flush": ScheduleKind("1f1b-flush", flush=True, microbatched=True, update="minibatch",
                               stashed_versions=1, copies_weights=False),
    "gpipe": ScheduleKind("gpipe", flush=True, microbatched=True, update="minibatch",
                          stashed_versions=1, copies_weights=False, chosen_warmup=False,
                          forwards_first=True),
    "2bw": ScheduleKind("2bw", flush=False, microbatched=True, update="minibatch",
                        stashed_versions=2, copies_weights=True),
    "interleaved-1f1b": ScheduleKind("interleaved-1f1b", flush=True, microbatched=True,
                                     update="minibatch", stashed_versions=1,
                                     copies_weights=False, interleaved=True,
                                     chosen_warmup=False),
    "zb-h1": ScheduleKind("zb-h1", flush=True, microbatched=True, update="minibatch",
                          stashed_versions=1, copies_weights=False, split_backward=True,
                          chosen_warmup=False),
    "interleaved-zb": ScheduleKind("interleaved-zb", flush=True, microbatched=True,
                                   update="minibatch", stashed_versions=1, copies_weights=False,
                                   split_backward=True, interleaved=True,
                                   chosen_warmup=False),
    "zb-v": ScheduleKind("zb-v", flush=True, microbatched=True, update="minibatch",
                         stashed_versions=1, copies_weights=False, split_backward=True,
                         interleaved=True, v_shape=True, chosen_warmup=False),
    "dualpipev": ScheduleKind("dualpipev", flush=True, microbatched=True, update="minibatch",
                              stashed_versions=1, copies_weights=False, split_backward=True,
                              interleaved=True, v_shape=True, chosen_warmup=False,
                              microbatches_per_rank=2),
}


def replicas_refused(name: str, stage_ranks: Sequence[Sequence[int]]) -> str | None:
    """Why schedule `name` cannot run stages on these ranks for their replicas (the chunked
    schedules run every stage on one worker: their orders have no replicas' rounds), or None.
    The closed forms price any shape, so the planner asks this before pricing."""
    replicated = [s for s, ranks in enumerate(stage_ranks) if len(ranks) != 1]
    if not kind(name).chunked or not replicated:
        return None
    return (f"stages {replicated} have several replicas; {name!r} runs every stage on one "
            f"worker (schedules that replicate stages: "
            f"{', '.join(n for n, row in KINDS.items() if not row.chunked)})")


def stream_length(replicas: Sequence[int], minibatches: int) -> int:
    """`minibatches` rounded up to a multiple of every replica count (each replica of a stage
    takes one minibatch per round)."""
    step = math.lcm(*replicas)
    return max(step, math.ceil(minibatches / step) * step)


def names(where: str) -> tuple[str, ...]:
    """The schedules whose row has the flag `where` set (e.g. "interleaved"), for messages."""
    return tuple(name for name, row in KINDS.items() if getattr(row, where))


def kind(name: str) -> ScheduleKind:
    """The row of schedule `name`; a clear error naming the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise ScheduleError(unknown(name)) from None


def unknown(name: str, *, auto: bool = False) -> str:
    """The message for a schedule name that is not one: the closest one and all of them."""
    from pdcompile.util.suggest import did_you_mean

    names = [*KINDS, "auto"] if auto else list(KINDS)
    return f"unknown schedule {name!r}{did_you_mean(str(name), names)}; choose one of " \
        + ", ".join(names)


def weight_versions(name: str, in_flight: int, *, copies: bool = True) -> int:
    """Weight versions a worker holds: one per minibatch in flight under weight stashing (only
    where the stage copies at all: a stage whose updates never fall inside a minibatch's forward
    and backward keeps the live version only), else the kind's fixed count."""
    row = kind(name)
    if row.stashed_versions == "in-flight":
        return max(1, in_flight) if copies else 1
    return int(row.stashed_versions)


__all__ = ["KINDS", "WGRAD_SHARE", "ScheduleKind", "kind", "names", "stream_length", "unknown",
           "weight_versions"]
