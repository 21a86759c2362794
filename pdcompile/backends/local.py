"""The local backend: every rank's generated loop in one process, in a fixed interleaving.

The reference semantics of a pipeline. Ranks take turns in rank order; each runs until its
generated `run_rank(rt)` yields (it waits for a message or a collective), then the next rank runs.
Messages go through in-memory mailboxes (runtime/local_transport.py). A round in which no rank
finishes an action is a deadlock and raises ScheduleError naming what each rank waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

from pdcompile.errors import ScheduleError

RankFn = Callable[[Any], Generator[Any, None, None]]


def run_local(functions: Mapping[int, RankFn], runtimes: Mapping[int, Any]) -> None:
    """Run `functions[r](runtimes[r])` for all ranks to completion, interleaved deterministically.

    A runtime exposes `completed` (actions finished so far), which is how progress is seen.
    """
    running: dict[int, Generator[Any, None, None]] = {
        rank: functions[rank](runtimes[rank]) for rank in sorted(functions)}
    waiting_on: dict[int, Any] = {}
    while running:
        progressed = False
        for rank in list(running):
            before = runtimes[rank].completed
            try:
                waiting_on[rank] = next(running[rank])
            except StopIteration:
                del running[rank]
                waiting_on.pop(rank, None)
                progressed = True
                continue
            if runtimes[rank].completed != before:
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {rank} after {runtimes[rank].completed} actions waits for "
                              f"{waiting_on.get(rank)!r}" for rank in running)
            raise ScheduleError(f"the pipeline cannot make progress (deadlock): {stuck}")


__all__ = ["run_local"]
