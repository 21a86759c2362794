"""In-memory mailboxes: the `Transport` of the local backend (all ranks in one process).

A send puts a copy of its tensors in the mailbox of (source rank, destination rank, tag) and is
done at once; a receive is ready when its message is there. An all-reduce is ready when every
rank of the group has joined the same round (the k-th call of each); the sum is taken in rank
order, so results do not depend on the interleaving.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import torch

from pdcompile.errors import ScheduleError
from pdcompile.runtime.transport import Pending, Tag, TensorSpec, Transport


class Done(Pending):
    """An operation that finished when it started."""

    def __init__(self, tensors: list[torch.Tensor] | None = None) -> None:
        self._tensors = tensors or []

    def ready(self) -> bool:
        return True

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class _Round:
    """One all-reduce among a group: the tensors each rank contributed."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.joined: dict[int, list[torch.Tensor]] = {}
        self.summed = False

    def join(self, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        self.joined[rank] = list(tensors)
        if len(self.joined) == len(self.ranks):
            parts = [self.joined[r] for r in self.ranks]
            totals = [torch.stack([p[i].detach() for p in parts]).sum(0)
                      for i in range(len(parts[0]))]
            for part in parts:
                for tensor, total in zip(part, totals, strict=True):
                    tensor.detach().copy_(total)
            self.summed = True
            self.joined = {}  # summed in place: the contributions are the ranks' own tensors


class Mailboxes:
    """The shared state of all ranks' local transports."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, int, Tag], deque[list[torch.Tensor]]] = defaultdict(deque)
        self.rounds: dict[tuple[int, ...], list[_Round]] = defaultdict(list)
        self.calls: dict[tuple[tuple[int, ...], int], int] = defaultdict(int)

    def pending(self) -> list[str]:
        """Messages sent but never received (should be empty after a run)."""
        return [f"{src}->{dst} {tag}" for (src, dst, tag), q in self.messages.items() if q]


class _Recv(Pending):
    def __init__(self, boxes: Mailboxes, key: tuple[int, int, Tag]) -> None:
        self.boxes = boxes
        self.key = key
        self._got: list[torch.Tensor] | None = None

    def ready(self) -> bool:
        return self._got is not None or bool(self.boxes.messages.get(self.key))

    def wait(self) -> list[torch.Tensor]:
        if self._got is None:
            if not self.ready():
                raise ScheduleError(f"rank {self.key[1]} would wait forever for {self.key[2]} "
                                    f"from rank {self.key[0]} (nothing sent)")
            queue = self.boxes.messages[self.key]
            self._got = queue.popleft()
            if not queue:  # a run's mailboxes end empty, not one empty queue per tag
                del self.boxes.messages[self.key]
        return self._got


class _Reduce(Pending):
    def __init__(self, round_: _Round) -> None:
        self.round = round_

    def ready(self) -> bool:
        return self.round.summed

    def wait(self) -> list[torch.Tensor]:
        if not self.round.summed:
            missing = [r for r in self.round.ranks if r not in self.round.joined]
            raise ScheduleError(f"all-reduce over ranks {list(self.round.ranks)} still waits "
                                f"for ranks {missing}")
        return []


class LocalTransport(Transport):
    """One rank's view of the shared `Mailboxes`."""

    def __init__(self, rank: int, boxes: Mailboxes) -> None:
        self.rank = rank
        self.boxes = boxes

    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: Tag) -> Pending:
        copies = [t.detach().clone() for t in tensors]
        self.boxes.messages[(self.rank, dst_rank, tag)].append(copies)
        return Done()

    def recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> Pending:
        return _Recv(self.boxes, (src_rank, self.rank, tag))

    def all_reduce(self, tensors: Sequence[torch.Tensor], ranks: Sequence[int]) -> Pending:
        group = tuple(sorted(int(r) for r in ranks))
        if self.rank not in group:
            raise ScheduleError(f"rank {self.rank} joins an all-reduce over {list(group)}")
        if len(group) == 1:
            return Done()
        nth = self.boxes.calls[(group, self.rank)]
        self.boxes.calls[(group, self.rank)] += 1
        rounds = self.boxes.rounds[group]
        while len(rounds) <= nth:
            rounds.append(_Round(group))
        rounds[nth].join(self.rank, tensors)
        return _Reduce(rounds[nth])


__all__ = ["Done", "LocalTransport", "Mailboxes"]
