"""A tied parameter held by several chunks of one rank: its gradients summed once per rank.

A V-shaped schedule (ZB-V, DualPipeV) puts stages 0 and 2p - 1 on rank 0, so a language model's
tied embedding (read by the first stage, and by the last as its output head) has two holders on
one rank; an interleaved cut can do the same. In one process the tie is one parameter whose
gradient is the sum of every use's. Here each chunk keeps its own copy, as a chunk on another
rank would: at the update, the copies' gradients on the rank are summed, that sum is
all-reduced once over the ranks holding the tie (none where this rank holds it alone), and
every copy is given the total before its chunk's optimizer steps. The copies start equal,
receive the same gradient and are updated by optimizers of the same options and state, which
compute elementwise, so they stay bit-for-bit equal, update after update.

Why copies rather than one Parameter object shared by the chunks' modules: each chunk's
optimizer steps the parameters it was given, so a shared one would be stepped twice per update
(or left out of one chunk's optimizer, whose state, param groups, checkpoints and exported
optimizer recipe are then no longer that stage's own); each chunk's weight versions and stash
(runtime/stash.py) snapshot its own module's parameters; and a checkpoint, an export or a
distributed run on more ranks keeps every stage's module whole. Copies keep all of that per
stage as it is for a tie across ranks, at the cost of one more copy of the tied weight and its
optimizer state on the rank (which the memory model counts: it counts every stage's weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdcompile.runtime.transport import Pending


class _EveryCopy(Pending):
    """The all-reduce of a rank's sums of tied gradients; once done, each copy gets them."""

    def __init__(self, reduce: Pending, sums: list[torch.Tensor],
                 copies: list[list[torch.Tensor]]) -> None:
        self._reduce = reduce
        self._sums = sums
        self._copies = copies  # [tie][holder]: the parameter each chunk holds
        self._done = False

    def ready(self) -> bool:
        return self._done or self._reduce.ready()

    def wait(self) -> list[torch.Tensor]:
        if not self._done:
            self._reduce.wait()
            with torch.no_grad():
                for total, tied in zip(self._sums, self._copies, strict=True):
                    for p in tied:
                        p.grad.copy_(total)  # type: ignore[union-attr]
            self._done = True
        return []


def tie_within_rank(held: Sequence[tuple[Any, Any]]) -> Pending:
    """Start reducing one tie group held by several chunks of this rank: `held` is each
    holder's (StageRuntime, TieGroup), the groups naming the same ties in the same order. Each
    copy's gradient counts as its replica's share (as in `StageRuntime.reduce_tie`), the
    shares are summed on the rank, all-reduced once over `group.ranks` (this rank and the
    others holding the tie) and copied into every copy when the returned Pending is waited
    for."""
    runtime, group = held[0]
    copies = [[rt.params[g.names[i]] for rt, g in held] for i in range(len(group.names))]
    sums: list[torch.Tensor] = []
    with torch.no_grad():
        for tied in copies:
            total = torch.zeros_like(tied[0])
            for p, (rt, _) in zip(tied, held, strict=True):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                total.add_(p.grad if rt.replicas == 1 else p.grad / rt.replicas)
            sums.append(total)
    return _EveryCopy(runtime.transport.all_reduce(sums, group.ranks), sums, copies)


__all__ = ["tie_within_rank"]
