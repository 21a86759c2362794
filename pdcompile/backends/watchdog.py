"""What a rank is doing, for the fault monitor's watchdog, and a model's error in one line.

The monitor (backends/launch.py) names a rank that makes no progress within the fault timeout
while not waiting for another rank; `watched_batches` and `model_activity` tell it what that rank
was doing (reading minibatch k from the user's data function, or the forward of microbatch m in
the model), read only when it is stuck. `model_failure` turns an exception raised by the model's
code inside a rank's generated loop into one line naming the rank, stage, microbatch and the
exception; the original stays attached (`__cause__`) so that its traceback is printed once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pdcompile.backends.launch import FaultMonitor
from pdcompile.errors import DistributedError, PdcompileError


class ModelError(DistributedError):
    """The model's own code raised inside a rank's loop (the message names where)."""


class watched_batches:  # noqa: N801 - used like the function it replaced
    """`batches`, read lazily, each read marked so that a data function that blocks is named.

    What the data offers besides iteration (`state_dict` / `load_state_dict` of a stateful
    loader, which checkpoints save and resume restores) is its own, passed through."""

    def __init__(self, batches: Iterable[Any], monitor: FaultMonitor) -> None:
        self.batches = batches
        self.monitor = monitor

    def __getattr__(self, name: str) -> Any:
        if name in ("batches", "monitor"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.batches, name)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batches)
        index = 0
        while True:
            before = self.monitor.activity()
            self.monitor.progress(f"reading minibatch {index} from the data function")
            try:
                item = next(iterator)
            except StopIteration:
                self.monitor.progress(before)
                return
            self.monitor.progress(before)
            yield item
            index += 1


def model_activity(rt: Any, rank: int, *, base: int = 0) -> Callable[[], str]:
    """What the rank's runtime is running now, as words (evaluated only when it is stuck);
    `base`: the run's first microbatch in the whole stream's numbering."""
    def describe() -> str:
        current = _current(rt)
        if current is None:
            return f"in rank {rank}'s generated loop"
        kind, stage, microbatch = current
        return (f"running the {kind} of microbatch {base + microbatch} on stage {stage} (the "
                "model)")
    return describe


def model_failure(err: BaseException, rt: Any, rank: int, *, base: int = 0) -> BaseException:
    """The error to raise for `err` escaping rank `rank`'s loop: pdcompile's own errors as they
    are, anything else (the model's code) as one line naming rank, stage and microbatch."""
    if isinstance(err, PdcompileError) or not isinstance(err, Exception):
        return err
    current = _current(rt)
    where = ""
    if current is not None:
        kind, stage, microbatch = current
        where = f" (stage {stage}) in the {kind} of microbatch {base + microbatch}"
    first = (str(err).strip().splitlines() or [""])[0]
    return ModelError(f"rank {rank}{where} raised {type(err).__name__}: {first}")


def _current(rt: Any) -> tuple[str, int, int] | None:
    """(kind, stage, microbatch) of what `rt` (a StageRuntime or a rank's chunks) runs now."""
    runtimes = list(getattr(rt, "chunks", {}).values()) or [rt]
    found = [r.current for r in runtimes if getattr(r, "current", None) is not None]
    if not found:
        return None
    kind, stage, microbatch, _ = max(found, key=lambda c: c[3])  # the latest started
    return kind, stage, microbatch


__all__ = ["ModelError", "model_activity", "model_failure", "watched_batches"]
