"""The runtime of a rank that holds several chunks of an interleaved pipeline.

An interleaved schedule places stage c on rank c mod p (a V-shaped one, ZB-V or DualPipeV,
stages c and 2p - 1 - c on rank c), so one rank runs several stages, each with its own module,
optimizer, weight versions and stash. Each gets its own `StageRuntime`; the rank's generated
loop names the chunk of every call (`yield from rt.chunk(2).forward(3)`, passes/codegen.py), and
backends see one object per rank, as for any other rank: `completed` (progress, for the local
driver), `losses` and `finish()`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import torch

from pdcompile.errors import ScheduleError
from pdcompile.runtime.grad_clip import clip_factor
from pdcompile.runtime.rank_ties import tie_within_rank


class ChunkRuntimes:
    """One rank's stage runtimes, by stage (all share the rank's transport and data)."""

    def __init__(self, rank: int, chunks: Mapping[int, Any]) -> None:
        if len(chunks) < 2:
            raise ScheduleError(f"rank {rank}: ChunkRuntimes holds several chunks (got stages "
                                f"{sorted(chunks)}); a rank with one stage uses its "
                                "StageRuntime directly")
        self.rank = rank
        self.chunks = dict(sorted(chunks.items()))
        self._reduced: set[int] = set()  # updates whose ties were reduced
        self._clipped: set[int] = set()  # updates whose gradients were clipped
        for rt in self.chunks.values():
            rt.rank_chunks = self

    def reduce_ties(self, index: int) -> list[Any]:
        """At the first chunk's update `index`: start the tie all-reduces of every chunk of the
        rank, in the order of the stages sharing each tie (the same on every rank); nothing at
        the others. Each chunk reducing its own at its own update made the ranks' orders differ
        (rank 0 a tie of stages (0, 3) then one of (1, 2), rank 1 the other way), so a rank
        summed one tie's gradients with another's. Every chunk's backwards end before any
        update of a flush schedule, which all chunked schedules are, and the chunks step in
        the rank's loop one after another, so the first chunk's step waits for every tie of
        the rank before any chunk's optimizer reads a gradient.

        A tie whose stages include several chunks of this rank (a V's first and last stage,
        both on rank 0, holding a tied embedding) is reduced once for the rank:
        `tie_within_rank` sums its copies here, all-reduces that sum over the other ranks
        holding it (if any) and gives every copy the total."""
        if index in self._reduced:
            return []
        self._reduced.add(index)
        holders: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}  # stages -> (runtime, group)
        for rt in self.chunks.values():
            rt.settle_gradients()
            for group in rt.ties:
                holders.setdefault(group.stages, []).append((rt, group))
        # the stages sharing a tie group are its key, and the same on every rank holding it
        return [held[0][0].reduce_tie(held[0][1]) if len(held) == 1 else tie_within_rank(held)
                for _, held in sorted(holders.items())]

    def clip_gradients(self, index: int, max_norm: float) -> Generator[Any, None, None]:
        """At the first chunk's update `index` (its ties already reduced): scale every chunk's
        gradients by the factor of the global gradient norm, with one all-reduce of the rank's
        sum of squares over every rank, as a rank holding one stage does (runtime/grad_clip.py);
        nothing at the others. Each chunk joining its own all-reduce paired one rank's chunk
        with another rank's and clipped each by a part of the norm."""
        if index in self._clipped:
            return
        self._clipped.add(index)
        first = next(iter(self.chunks.values()))
        total = sum((rt.gradient_squares() for rt in self.chunks.values()),
                    torch.zeros(1, dtype=torch.float64))
        pending = first.transport.all_reduce([total], first.everyone())
        while not pending.ready():
            yield pending
        pending.wait()
        factor = clip_factor(total, max_norm)
        for rt in self.chunks.values():
            rt.scale_gradients(factor)

    def chunk(self, stage: int) -> Any:
        """The runtime of the rank's chunk `stage`."""
        try:
            return self.chunks[stage]
        except KeyError:
            raise ScheduleError(f"rank {self.rank} holds stages {sorted(self.chunks)}, not stage "
                                f"{stage}; the generated code and the placement disagree "
                                "(regenerate the rank code from this plan)") from None

    @property
    def stage(self) -> int:
        """The rank's first chunk (the one that reads data on rank 0)."""
        return next(iter(self.chunks))

    @property
    def completed(self) -> int:
        """Actions finished by all chunks (the local driver watches it for progress)."""
        return sum(rt.completed for rt in self.chunks.values())

    @property
    def losses(self) -> dict[int, torch.Tensor]:
        """Microbatch losses (the chunk holding the last stage computes them)."""
        out: dict[int, torch.Tensor] = {}
        for rt in self.chunks.values():
            out.update(rt.losses)
        return out

    def finish(self) -> None:
        """End of the run, for every chunk."""
        for rt in self.chunks.values():
            rt.finish()


__all__ = ["ChunkRuntimes"]
