"""The schedule IR: `Action(stage, kind, microbatch)` and `Schedule` (rank -> actions).

Actions print as in torch.distributed.pipelining: "1F3" (stage 1, forward of microbatch 3),
"1B3", "0SEND_F3->1" (stage 0 sends microbatch 3's activations to stage 1), "1RECV_F3<-0",
"1SEND_B3->0", "0RECV_B3<-1", "2ALLREDUCE3", "2STEP3". `parse_action(str(a)) == a`.
For asynchronous schedules `microbatch` is the minibatch's index in the stream; for flush
schedules it is the microbatch's index inside the minibatch. The compute-only schedule comes
from a generator (passes/schedule), the communication is added by lowering; the generated code,
the simulator and the backends all read the same `Schedule`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from pdcompile.errors import ScheduleError


class Kind(enum.Enum):
    """What an action does."""

    F = "F"                  # forward of one microbatch through the stage
    B = "B"                  # backward (input and weight gradients) of one microbatch
    W = "W"                  # weight-gradient-only backward (zero-bubble schedules)
    SEND_F = "SEND_F"        # send activations to `peer` stage
    RECV_F = "RECV_F"        # receive activations from `peer` stage
    SEND_B = "SEND_B"        # send input gradients back to `peer` stage
    RECV_B = "RECV_B"        # receive output gradients from `peer` stage
    ALLREDUCE = "ALLREDUCE"  # sum gradients among the stage's replicas
    STEP = "STEP"            # optimizer step (a new weight version)

    @property
    def is_compute(self) -> bool:
        """F, B and W are compute; the rest is communication or bookkeeping."""
        return self in (Kind.F, Kind.B, Kind.W)


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
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
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
        raise ScheduleError(f"action {text!r}: {kind} is written with {_COMM_ARROW.get(action.kind)}")
    return action


@dataclass(frozen=True)
class Schedule:
    """For every rank, its actions in order, plus the shape of the pipeline they run on.

    `stage_ranks[s]` lists the ranks that run stage s (its replicas). Microbatch m of stage s runs
    on replica `m % replicas` (round robin, 1F1B-RR).
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
        return sorted(r for ranks in self.stage_ranks for r in ranks)

    def stage_of_rank(self, rank: int) -> int:
        """The stage a rank runs."""
        for stage, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return stage
        raise ScheduleError(f"rank {rank} runs no stage of this schedule")

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank (replica) of `stage` that handles `microbatch` (round robin)."""
        ranks = self.stage_ranks[stage]
        return ranks[microbatch % len(ranks)]

    def __str__(self) -> str:
        width = len(str(max(self.ranks))) if self.actions else 1
        return "\n".join(
            f"rank {rank:>{width}}: " + " ".join(str(a) for a in self.actions.get(rank, ()))
            for rank in self.ranks
        )

    def to_text(self) -> str:
        """A header line and one line per rank; `Schedule.from_text` reads it back."""
        shape = ";".join(",".join(str(r) for r in ranks) for ranks in self.stage_ranks)
        return f"# schedule {self.name} microbatches={self.microbatches} stages={shape}\n{self}\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Inverse of `to_text`."""
        lines = [line for line in text.strip().splitlines() if line.strip()]
        head = re.match(r"# schedule (\S+) microbatches=(\d+) stages=(\S+)", lines[0]) if lines else None
        if head is None:
            raise ScheduleError("a schedule file starts with '# schedule NAME microbatches=M "
                                "stages=0;1,2;3'")
        stage_ranks = tuple(tuple(int(r) for r in part.split(",")) for part in head.group(3).split(";"))
        actions: dict[int, tuple[Action, ...]] = {}
        for line in lines[1:]:
            label, _, rest = line.partition(":")
            rank = int(label.replace("rank", "").strip())
            actions[rank] = tuple(parse_action(tok) for tok in rest.split())
        return cls(head.group(1), int(head.group(2)), stage_ranks, actions)
