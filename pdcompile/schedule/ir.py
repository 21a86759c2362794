"""The schedule IR: `Action(stage, kind, microbatch)` and `Schedule` (rank -> actions).

Actions print as in torch.distributed.pipelining: "1F3" (stage 1, forward of microbatch 3),
"1B3", "0SEND_F3->1" (stage 0 sends microbatch 3's activations to stage 1), "1RECV_F3<-0",
"1SEND_B3->0", "0RECV_B3<-1", "2ALLREDUCE3", "2STEP3". `parse_action(str(a)) == a`.
For asynchronous schedules `microbatch` is the minibatch's index in the stream; for flush
schedules it is the microbatch's index inside the minibatch; for 2bw it is the global microbatch
index (minibatch k holds microbatches k*M .. k*M+M-1). For ALLREDUCE and STEP the number is the
index of the weight update (0, 1, 2, ... on every replica of the stage): "2STEP3" makes stage 2's
weight version 4; the k-th ALLREDUCE of every replica of a stage is one collective.
The compute-only schedule comes from a generator (schedule/generators), the communication is
added by lowering; the generated code, the simulator and the backends all read the same `Schedule`.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcompile.errors import ScheduleError


class Kind(enum.Enum):
    """What an action does."""

    F = "F"                  # forward of one microbatch through the stage
    B = "B"                  # backward (input and weight gradients) of one microbatch
    W = "W"                  # weight-gradient part of a split backward (zero-bubble schedules,
    #                          where B computes the input gradients only)
    SEND_F = "SEND_F"        # send activations to `peer` stage
    RECV_F = "RECV_F"        # receive activations from `peer` stage
    SEND_B = "SEND_B"        # send input gradients back to `peer` stage
    RECV_B = "RECV_B"        # receive output gradients from `peer` stage
    ALLREDUCE = "ALLREDUCE"  # sum gradients among the stage's replicas
    STEP = "STEP"            # optimizer step (a new weight version)

    # members are singletons: identity hashing is valid and much faster than Enum's name hash
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        """F, B and W are compute; the rest is communication or bookkeeping."""
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset((Kind.F, Kind.B, Kind.W))  # for hot loops: `kind in COMPUTE_KINDS`
_KIND_TEXT = {kind: kind.value for kind in Kind}  # Enum.value is slow in hot loops
_COMM_ARROW = {Kind.SEND_F: "->", Kind.SEND_B: "->", Kind.RECV_F: "<-", Kind.RECV_B: "<-"}
_ACTION_RE = re.compile(
    r"^(\d+)(SEND_F|SEND_B|RECV_F|RECV_B|ALLREDUCE|STEP|F|B|W)(\d+)(?:(->|<-)(\d+))?$"
)


@dataclass(frozen=True)
class Action:
    """One thing one stage does for one microbatch; `peer` is the other stage of a transfer."""

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.stage}{_KIND_TEXT[self.kind]}{self.microbatch}"
        if self.peer is not None:
            text += f"{_COMM_ARROW.get(self.kind, '->')}{self.peer}"
        return text

    def __repr__(self) -> str:
        return f"Action({self})"

    def __lt__(self, other: object) -> bool:  # Kind is not orderable; order by text instead
        if not isinstance(other, Action):
            return NotImplemented
        return (self.stage, self.kind.value, self.microbatch, self.peer or -1) < (
            other.stage, other.kind.value, other.microbatch, other.peer or -1)


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ScheduleError(f"cannot read action {text!r}; actions look like '1F3', '0SEND_F3->1', "
                            "'1RECV_B3<-2', '2STEP3'")
    stage, kind, microbatch, arrow, peer = match.groups()
    action = Action(int(stage), Kind(kind), int(microbatch), int(peer) if peer else None)
    if arrow and _COMM_ARROW.get(action.kind) != arrow:
        raise ScheduleError(f"action {text!r}: {kind} is written with "
                            f"{_COMM_ARROW.get(action.kind)}")
    return action


@dataclass(frozen=True)
class Schedule:
    """For every rank, its actions in order, plus the shape of the pipeline they run on.

    `stage_ranks[s]` lists the ranks that run stage s (its replicas). Microbatch m of stage s runs
    on replica `m % replicas` (round robin, 1F1B-RR), or, where `options["shares"][s]` gives each
    replica a count per round (proportional shares: a faster replica takes more), on the replica
    `replica_pattern(shares)[m % sum(shares)]`. In an interleaved pipeline a rank holds
    several stages (chunks): stage c on rank c mod p, each unreplicated; in a V (ZB-V,
    DualPipeV) two, stage c on rank c for c < p and on rank 2p - 1 - c after.
    """

    name: str
    microbatches: int
    stage_ranks: tuple[tuple[int, ...], ...]
    actions: dict[int, tuple[Action, ...]]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stage_ranks)

    @property
    def ranks(self) -> list[int]:
        """All ranks, sorted."""
        return sorted({r for ranks in self.stage_ranks for r in ranks})

    def stage_of_rank(self, rank: int) -> int:
        """The stage a rank runs (the first one where it holds several chunks: see
        `stages_of_rank`)."""
        return self.stages_of_rank(rank)[0]

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages a rank runs, ascending: one, or its chunks in an interleaved pipeline."""
        found = tuple(stage for stage, ranks in enumerate(self.stage_ranks) if rank in ranks)
        if not found:
            raise ScheduleError(f"rank {rank} runs no stage of this schedule")
        return found

    @functools.cached_property
    def shares(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the microbatches each replica takes per round (all ones: round robin).
        Worked out once per schedule: the lowering, the validation and the simulator ask
        for it (`round_size`) for every action they place."""
        given = self.options.get("shares")
        if given is None:
            return tuple((1,) * len(ranks) for ranks in self.stage_ranks)
        return tuple(tuple(int(c) for c in counts) for counts in given)

    def round_size(self, stage: int) -> int:
        """Microbatches of one round of `stage`'s replicas (the sum of its shares)."""
        return sum(self.shares[stage])

    @functools.cached_property
    def _replica_cycles(self) -> tuple[tuple[int, ...], ...] | None:
        """Per stage, the replica indices one round's microbatches go to, in order (None:
        round robin). Worked out once: lowering, validation and the simulator ask `rank_of`
        for every transfer they place or check."""
        if "shares" not in self.options:
            return None
        return tuple(replica_pattern(counts) for counts in self.shares)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank (replica) of `stage` that handles `microbatch` (round robin, or by the
        stage's shares)."""
        ranks = self.stage_ranks[stage]
        cycles = self._replica_cycles
        if cycles is None:
            return ranks[microbatch % len(ranks)]
        pattern = cycles[stage]
        return ranks[pattern[microbatch % len(pattern)]]

    def __str__(self) -> str:
        width = len(str(max(self.ranks))) if self.actions else 1
        return "\n".join(
            f"rank {rank:>{width}}: " + " ".join(str(a) for a in self.actions.get(rank, ()))
            for rank in self.ranks
        )

    def to_text(self) -> str:
        """A header line and one line per rank; `Schedule.from_text` reads it back.

        Options (when there are any) follow the header as ` options=<json>`.
        """
        shape = ";".join(",".join(str(r) for r in ranks) for ranks in self.stage_ranks)
        extra = f" options={json.dumps(self.options, sort_keys=True)}" if self.options else ""
        return (f"# schedule {self.name} microbatches={self.microbatches} stages={shape}{extra}\n"
                f"{self}\n")

    def grid(self, *, mark: dict[int, int] | None = None, window: int | None = 12) -> str:
        """The rank x step grid (see `format_grid`)."""
        return format_grid(self, mark=mark, window=window)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Inverse of `to_text`."""
        lines = [line for line in text.strip().splitlines() if line.strip()]
        head = (re.match(r"# schedule (\S+) microbatches=(\d+) stages=(\S+)", lines[0])
                if lines else None)
        if head is None:
            raise ScheduleError("a schedule file starts with '# schedule NAME microbatches=M "
                                "stages=0;1,2;3'")
        stage_ranks = tuple(tuple(int(r) for r in part.split(","))
                            for part in head.group(3).split(";"))
        options: dict[str, Any] = {}
        rest_of_head = lines[0][head.end():].strip()
        if rest_of_head.startswith("options="):
            try:
                options = json.loads(rest_of_head[len("options="):])
            except ValueError as err:
                raise ScheduleError(f"schedule header options are not JSON ({err}): "
                                    f"{rest_of_head!r}") from None
        actions: dict[int, tuple[Action, ...]] = {}
        for line in lines[1:]:
            label, _, rest = line.partition(":")
            try:
                rank = int(label.replace("rank", "").strip())
            except ValueError:
                raise ScheduleError(f"schedule line {line!r} does not start with 'rank N:'"
                                    ) from None
            actions[rank] = tuple(parse_action(tok) for tok in rest.split())
        return cls(head.group(1), int(head.group(2)), stage_ranks, actions, options)


@functools.lru_cache(maxsize=256)
def replica_pattern(shares: tuple[int, ...]) -> tuple[int, ...]:
    """The replicas of one round in the order they take its microbatches: replica i appears
    `shares[i]` times, spread out (each next microbatch goes to the replica furthest behind its
    share, ties to the lower index), so that the replicas start together and stay in step.
    Equal shares give plain round robin: (0, 1, ..., r-1) repeated."""
    total = sum(shares)
    taken = [0] * len(shares)
    order: list[int] = []
    for k in range(total):
        # behind: share of the round so far it should have had, minus what it took
        replica = max(range(len(shares)),
                      key=lambda i: ((k + 1) * shares[i] - total * taken[i], -i))
        taken[replica] += 1
        order.append(replica)
    return tuple(order)


def replica_of(shares: Sequence[int], microbatch: int) -> int:
    """The replica (index into the stage's ranks) that takes `microbatch` under `shares`."""
    pattern = replica_pattern(tuple(map(int, shares)))
    return pattern[microbatch % len(pattern)]


def format_grid(schedule: Schedule, *, mark: dict[int, int] | None = None,
                window: int | None = 12) -> str:
    """The rank x step grid: one row per rank, one column per position in its action list.

    `mark` maps rank -> step to highlight (written `>1F3<`, others ` 1F3 `; `>~<` marks a step past
    the end of the rank's list, where something is missing); with `window`, only
    the columns from `window` steps before the first marked step are shown, at most 4*window
    of them (the first 2*window when nothing is marked).
    """
    mark = mark or {}
    length = max((len(a) for a in schedule.actions.values()), default=0)
    if window is None or length <= 2 * window + 1:
        lo, hi = 0, length
    elif mark:
        centre = min(mark.values())
        lo = max(0, centre - window)
        hi = min(length, max(mark.values()) + window + 1, lo + 4 * window)
    else:
        lo, hi = 0, 2 * window
    cells: dict[int, list[str]] = {}
    for rank in schedule.ranks:
        row = list(schedule.actions.get(rank, ()))
        cells[rank] = [
            (f">{row[i]}<" if mark.get(rank) == i else f" {row[i]} ") if i < len(row)
            else (">~<" if mark.get(rank) == i else "")
            for i in range(lo, hi)
        ]
    width = max([len(c) for row in cells.values() for c in row] + [len(str(hi)) + 2])
    label = max(len(f"rank {r}") for r in schedule.ranks) if schedule.ranks else 6
    head = " " * label + " |" + "".join(f"{i:^{width}}" for i in range(lo, hi))
    lines = [head + (" ..." if hi < length else "")]
    if lo > 0:
        lines[0] = head.replace("|", "| ...", 1)
    for rank in schedule.ranks:
        prefix = f"{'rank ' + str(rank):<{label}} |" + (" ..." if lo > 0 else "")
        lines.append(prefix + "".join(f"{c:^{width}}" for c in cells[rank]))
    return "\n".join(lines)
