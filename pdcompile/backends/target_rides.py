"""Targets that ride in an activation message from stage 0's rank to the last stage's rank.

Where the last stage reads no data, stage 0's rank sends it each microbatch's target. Where
stage 0's rank also sends the last stage's rank activations of that microbatch, the target's
tensors travel at the end of the first such message (the lowest edge between them: stage 0's
to the last stage on 2 stages, stage 0's to stage 1 when an interleaved rank holds stages 1
and 3 of 4), packed with the activations into one buffer (backends/packed_message.py): one
message a microbatch fewer. On its own the target was also a receive the last stage's rank
posted late (right before its forward of the last stage), after stage 0's rank had sent it:
gloo then makes the sender's I/O thread write it (docs/runtime-profile.md, fifth round).
Elsewhere (middle stages on other ranks between them) the target stays a message of its own:
riding through the middle stages would make each of them receive, keep and resend it, for one
message saved out of 2p - 1 a microbatch (docs/runtime-profile.md, fourth round).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pdcompile.backends.distributed_announce import TargetLayout
from pdcompile.errors import DistributedError
from pdcompile.runtime.message_specs import MessageTable
from pdcompile.runtime.transport import Tag, TensorSpec


class TargetRides:
    """One run's riding targets, for the sender (stage 0's rank: `read` gives a microbatch's
    target) or for a receiver (a last-stage rank that reads no data: `read` is None).

    `edges_of(m)` / `layout_of(m)`: microbatch m's message table and target layout (None: no
    target); `rank_of(stage, m)`: the rank that runs `stage` for microbatch m; `routed`: the
    last stage's ranks that get their targets from stage 0's.
    """

    def __init__(self, *, last: int, edges_of: Callable[[int], MessageTable],
                 layout_of: Callable[[int], TargetLayout | None],
                 rank_of: Callable[[int, int], int], routed: Collection[int],
                 read: Callable[[int], Any] | None) -> None:
        self.last = last
        self.edges_of = edges_of
        self.layout_of = layout_of
        self.rank_of = rank_of
        self.routed = routed
        self.read = read
        self.arrived: dict[int, list[torch.Tensor]] = {}
        self._carriers: dict[int, tuple[int, int] | None] = {}

    def carrier(self, microbatch: int) -> tuple[int, int] | None:
        """The activation edge (src, dst) whose message carries microbatch's target: the
        lowest from a stage on stage 0's rank to one on the last stage's rank; None where
        there is none or no target (then the target is a message of its own)."""
        if microbatch not in self._carriers:
            found = None
            if self.last > 0 and self.layout_of(microbatch) is not None:
                reader = self.rank_of(0, microbatch)
                receiver = self.rank_of(self.last, microbatch)
                edges = sorted((tag.src_stage, tag.dst_stage)
                               for tag in self.edges_of(microbatch) if tag.kind == "act")
                found = next(((src, dst) for src, dst in edges
                              if self.rank_of(src, microbatch) == reader
                              and self.rank_of(dst, microbatch) == receiver), None)
            self._carriers[microbatch] = found
        return self._carriers[microbatch]

    def rides(self, microbatch: int) -> bool:
        """Whether microbatch's target rides in an activation message (else it is a message
        of its own)."""
        return self.carrier(microbatch) is not None

    def _carries(self, tag: Tag) -> bool:
        return tag.kind == "act" \
            and self.carrier(tag.microbatch) == (tag.src_stage, tag.dst_stage)

    def outgoing(self, tag: Tag, dst_rank: int) -> list[torch.Tensor]:
        """The target tensors to append to the message `tag` sent to `dst_rank` (sender)."""
        if self.read is None or dst_rank not in self.routed or not self._carries(tag):
            return []
        return list(pytree.tree_leaves(self.read(tag.microbatch)))

    def incoming(self, tag: Tag) -> list[TensorSpec]:
        """The target tensors' specs that arrive at the end of the message `tag` (receiver)."""
        if self.read is not None or not self._carries(tag):
            return []
        layout = self.layout_of(tag.microbatch)
        return list(layout[1]) if layout is not None else []

    def deliver(self, tag: Tag, tensors: list[torch.Tensor]) -> None:
        """The target tensors that arrived with `tag` (called once its receive completed)."""
        self.arrived[tag.microbatch] = tensors

    def take(self, microbatch: int) -> list[torch.Tensor]:
        """The target tensors of `microbatch` that arrived with its activations (receiver)."""
        try:
            return self.arrived.pop(microbatch)
        except KeyError:
            raise DistributedError(
                f"the last stage needs the target of microbatch {microbatch} before the "
                "activations it rides with arrived; the schedule's order is broken (validate "
                "it)") from None


__all__ = ["TargetRides"]
