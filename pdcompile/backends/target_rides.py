"""Targets that ride in stage 0's activation message to the last stage.

Where the last stage reads no data, stage 0 sends it each microbatch's target. Where stage 0
also sends the last stage activations of that microbatch (a 2-stage pipeline, or a skip
connection), the target's tensors travel at the end of that message, packed with the
activations into one buffer (backends/packed_message.py): one message a microbatch instead of
two. Elsewhere (middle stages between them) the target stays a message of its own: riding
through the middle stages would make each of them receive, keep and resend it, for one message
saved out of 2p - 1 a microbatch (docs/runtime-profile.md, fourth round).
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
    """One run's riding targets, for the sender (stage 0: `read` gives a microbatch's target)
    or for a receiver (a last-stage rank that reads no data: `read` is None).

    `edges_of(m)` / `layout_of(m)`: microbatch m's message table and target layout (None: no
    target); `routed`: the last stage's ranks that get their targets from stage 0.
    """

    def __init__(self, *, last: int, edges_of: Callable[[int], MessageTable],
                 layout_of: Callable[[int], TargetLayout | None], routed: Collection[int],
                 read: Callable[[int], Any] | None) -> None:
        self.last = last
        self.edges_of = edges_of
        self.layout_of = layout_of
        self.routed = routed
        self.read = read
        self.arrived: dict[int, list[torch.Tensor]] = {}

    def rides(self, microbatch: int) -> bool:
        """Whether microbatch's target rides in stage 0's activation message to the last stage
        (else it is a message of its own)."""
        return self.last > 0 and self.layout_of(microbatch) is not None \
            and Tag("act", 0, self.last, 0) in self.edges_of(microbatch)

    def _carries(self, tag: Tag) -> bool:
        return tag.kind == "act" and tag.src_stage == 0 and tag.dst_stage == self.last \
            and self.rides(tag.microbatch)

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
