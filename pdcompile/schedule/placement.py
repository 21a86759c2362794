"""Where the chunks of a pipeline go: interleaved (chunk c on rank c mod p) or in a V.

A rank may hold several non-adjacent stages (chunks) of one pipeline. Two placements are known:

- interleaved (Narayanan et al., SC 2021): K = p v chunks, chunk c on the rank of chunk c mod p,
  so a microbatch crosses all ranks v times in the same direction;
- V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; DeepSeek's DualPipeV):
  K = 2p chunks, chunk c on the rank of chunk c for c < p and of chunk 2p - 1 - c after, so a
  microbatch goes down the ranks and comes back up: rank 0 holds the first and the last chunk,
  and rank p - 1 the two middle ones, which hand over without a transfer between processes.

With 4 ranks, stages 0..7 sit on ranks 0 1 2 3 3 2 1 0. `schedule.kinds` says which placement a
schedule runs on (`ScheduleKind.v_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcompile.errors import ScheduleError


def v_position(chunk: int, ranks: int) -> int:
    """The position (0..p-1) of the rank holding `chunk` in a V of 2p chunks on p ranks."""
    return chunk if chunk < ranks else 2 * ranks - 1 - chunk


def v_chunks(position: int, ranks: int) -> tuple[int, int]:
    """The two chunks of the rank at `position` in a V: going down, then coming back up."""
    return position, 2 * ranks - 1 - position


def chunk_shape(stage_ranks: Sequence[Sequence[int]], *, v_shape: bool) -> tuple[int, int]:
    """(p, v): ranks and chunks per rank of an interleaved placement or a V, checked.

    Every stage runs on one rank; stages 0..p-1 on p distinct ranks; the others on the rank of
    stage c mod p (interleaved) or of stage 2p - 1 - c (`v_shape`, then exactly 2 chunks each).
    """
    shape = [tuple(int(r) for r in ranks) for ranks in stage_ranks]
    replicated = [s for s, ranks in enumerate(shape) if len(ranks) != 1]
    if not shape or replicated:
        raise ScheduleError(f"stages {replicated} have several replicas "
                            f"({[list(shape[s]) for s in replicated]}); interleaved, V-shaped "
                            "and zero-bubble schedules run every stage on one worker")
    owners = [ranks[0] for ranks in shape]
    p = len(set(owners))
    first = owners[:p]
    if v_shape:
        fits = len(shape) == 2 * p and len(set(first)) == p and all(
            owners[c] == owners[v_position(c, p)] for c in range(len(shape)))
        if not fits:
            ranks = max(1, len(shape) // 2)
            wanted = [[v_position(c, ranks)] for c in range(2 * ranks)]
            raise ScheduleError(f"stage ranks {[list(r) for r in shape]} are not a V of "
                                f"{len(shape)} stages on {p} ranks; a V holds 2 chunks per rank, "
                                f"chunk c on rank c for c < p and on rank 2p - 1 - c after, e.g. "
                                f"{wanted} (planner.interleave.fold_v turns a straight plan of "
                                "2p stages into one)")
        return p, 2
    if len(shape) % p or len(set(first)) != p or any(
            owners[c] != owners[c % p] for c in range(len(shape))):
        wanted = [[owners[c % p]] for c in range(len(shape))] if len(set(first)) == p \
            else [[c % p] for c in range(p * max(1, len(shape) // p))]
        raise ScheduleError(f"stage ranks {[list(r) for r in shape]} are not an interleaved "
                            f"placement of {len(shape)} stages on {p} ranks; chunk c goes to the "
                            f"rank of chunk c mod p, e.g. {wanted} (planner.interleave.interleave "
                            "turns a straight plan into one)")
    return p, len(shape) // p


def chunk_placement(stage_ranks: Sequence[Sequence[int]], *, v_shape: bool) -> dict[str, Any]:
    """What a plan's `extra` records of its chunks: "chunks_per_rank" where a rank holds
    several stages, and "placement": "v" for a V (ZB-V, DualPipeV); {} for one stage per rank.
    Every plan of chunks records it, made by planner.interleave or by the planner's search."""
    ranks = {rank for ranks in stage_ranks for rank in ranks}
    if not ranks or len(stage_ranks) <= len(ranks):
        return {}
    return {"chunks_per_rank": len(stage_ranks) // len(ranks),
            **({"placement": "v"} if v_shape else {})}


__all__ = ["chunk_placement", "chunk_shape", "v_chunks", "v_position"]
