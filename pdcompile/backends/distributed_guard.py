"""Collectives of the whole process group with dead peers named, not gloo's error text.

Every call that all ranks make together (the announcement of the next minibatches, the
agreement on a checkpoint, the gathering of losses and timelines, the barrier before training)
runs under `guarded`: with the fault monitor, a failure names the worker that died; without it,
the first line of the backend's error and what was being done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from pdcompile.backends.launch import FaultMonitor
from pdcompile.errors import DistributedError


@contextmanager
def guarded(monitor: FaultMonitor | None, what: str) -> Iterator[None]:
    """Run a collective of the whole group so that a dead peer is named, not a gloo error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if monitor is None:
        try:
            yield
        except RuntimeError as err:
            raise DistributedError(f"rank {rank}: {what} failed: "
                                   f"{str(err).splitlines()[0] if str(err) else err!r}") from None
        return
    with monitor.blocking(what):
        try:
            yield
        except RuntimeError as err:
            raise monitor.explain((rank + 1) % world, err, what=what) from None


__all__ = ["guarded"]
