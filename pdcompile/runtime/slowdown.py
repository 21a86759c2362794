"""An emulated slower device: each rank's compute stretched by a factor, on this machine.

A mixed cluster's slower ranks can be tried on one host: after a rank's forward, backward or
weight-gradient computation it waits (factor - 1) times as long as the computation took, so the
action ends when it would on a device `factor` times slower. It waits by sleeping, so the
rank's processor is free meanwhile, as a GPU's host core is while its kernels run; the
prediction to compare with is the simulator's on `Cluster.with_slowdowns(factors)`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from pdcompile.errors import PipelineInputError

EXAMPLE = "e.g. 1,2 (rank 1 twice as slow as rank 0)"


def check_slowdowns(slowdowns: Sequence[float] | str | None, workers: int) -> tuple[float, ...]:
    """Per-rank factors from a sequence or "1,2"; () for none. One factor per rank, each >= 1
    (a run can be slowed down, not sped up)."""
    if slowdowns is None:
        return ()
    if isinstance(slowdowns, str):
        try:
            slowdowns = [float(p) for p in slowdowns.split(",")]
        except ValueError:
            raise PipelineInputError(f"slowdown {slowdowns!r}: write one number per rank, "
                                     f"{EXAMPLE}") from None
    factors = tuple(float(f) for f in slowdowns)
    if len(factors) != workers:
        raise PipelineInputError(f"slowdown has {len(factors)} factors for {workers} ranks; give "
                                 f"one per rank, {EXAMPLE}")
    bad = [f for f in factors if not math.isfinite(f) or f < 1.0]
    if bad:
        raise PipelineInputError(f"slowdown factor {bad[0]!r}: each is >= 1 (1: full speed, 2: "
                                 f"twice as slow; a run cannot be sped up), {EXAMPLE}")
    return () if all(f == 1.0 for f in factors) else factors


def stretch(started: float, factor: float) -> None:
    """Wait until an action begun at `started` (time.time()) has taken `factor` times what it
    has taken so far."""
    if factor > 1.0:
        taken = time.time() - started
        if taken > 0:
            time.sleep((factor - 1.0) * taken)


__all__ = ["EXAMPLE", "check_slowdowns", "stretch"]
