"""How a stream of minibatches is read into runs: a bounded window, read as it is needed.

A generated rank loop covers one run of a known length; an asynchronous schedule (1F1B, 2BW)
fills the pipeline at a run's start and drains it at its end. A stream of unknown or large
length (millions of minibatches, an endless iterator) is trained as consecutive runs of at most
`WINDOW` minibatches and, past `least` of them, `WINDOW_BYTES` of data, so that what a worker
holds is one window (the run in flight and the one being read), whatever the stream's length.
The local backend (`Pipeline.train`) and the distributed one cut a stream by this same rule, so
they train the same runs (same losses). Draining once per window changes an asynchronous run
only at its boundaries (the first minibatches of a window see no stale weights), and costs one
fill and drain per window (about (stages - 1) / WINDOW of the time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError
from pdcompile.schedule.kinds import kind

# minibatches in one run of an asynchronous stream (at most)
WINDOW = 1024
# bytes of minibatch data (tensors' storage) after which a window closes early, once it holds
# `least` minibatches: big minibatches make short windows rather than gigabytes read ahead
WINDOW_BYTES = 256 * 2**20

Item = TypeVar("Item")
_END = object()


def window_limit(index: int, *, steps: int | None, segment: int | None, multiple: int = 1,
                 window: int | None = None) -> int:
    """The most minibatches the run starting at minibatch `index` may take: a window (rounded
    down to whole rounds of `multiple`), not past `steps`, and ending on a multiple of `segment`
    (the checkpoint interval: runs end where checkpoints are due)."""
    window = WINDOW if window is None else window
    limit = max(multiple, window // multiple * multiple)
    if segment is not None:
        limit = min(limit, segment - index % segment)
    if steps is not None:
        limit = min(limit, steps - index)
    return max(0, limit)


def resumed_stream(batches: Iterable[Any], done: int, *, state: Any = None) -> Iterator[Any]:
    """The minibatches of `batches` from minibatch `done` on (a resumed run), reading none of
    those before where the data can say where it was: `state` given to its
    `load_state_dict` (saved from its `state_dict()` with the checkpoint, as a stateful data
    loader offers), or a sequence indexed from `done`; otherwise the first `done` are read and
    dropped."""
    if done and state is not None and callable(getattr(batches, "load_state_dict", None)):
        batches.load_state_dict(state)  # type: ignore[attr-defined]
        return iter(batches)
    if done and isinstance(batches, Sequence):
        if len(batches) < done:
            raise PipelineInputError(f"the data holds {len(batches)} minibatches but the run "
                                     f"resumes at minibatch {done} (checkpoint)")
        return (batches[i] for i in range(done, len(batches)))
    stream = iter(batches)
    for skipped in range(done):
        if next(stream, _END) is _END:
            raise PipelineInputError(f"the data ends after {skipped} minibatches but the run "
                                     f"resumes at minibatch {done} (checkpoint)")
    return stream


def window_rounds(schedule: str, replicas: Sequence[int]) -> tuple[int, int]:
    """A run's length in whole rounds (`multiple`: the replicas' round of '1f1b', where each
    replica takes whole minibatches) and the fewest minibatches a window closed early by its
    bytes holds (`least`: four per stage, so that filling and draining stay a small share)."""
    multiple = 1 if kind(schedule).microbatched else math.lcm(*replicas)
    least = -(-4 * len(replicas) // multiple) * multiple
    return multiple, least


def data_bytes(item: Any) -> int:
    """The bytes of the tensors in a minibatch (what reading it ahead holds)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(item)
               if isinstance(t, torch.Tensor))


def take_window(stream: Iterator[Any], limit: int, *, convert: Callable[[Any, int], Item],
                first: int = 0, multiple: int = 1, least: int = 1,
                max_bytes: int = WINDOW_BYTES) -> list[Item]:
    """The next run's minibatches from `stream`: up to `limit`, fewer where the stream ends or
    where, past `least` minibatches and at a whole round of `multiple`, they hold `max_bytes`.
    `convert(item, index)` checks and normalises each as it is read (`first` numbers them)."""
    items: list[Item] = []
    held = 0
    while len(items) < limit:
        item = next(stream, _END)
        if item is _END:
            break
        items.append(convert(item, first + len(items)))
        held += data_bytes(item)
        if held >= max_bytes and len(items) >= least and len(items) % multiple == 0:
            break
    return items


__all__ = ["WINDOW", "WINDOW_BYTES", "data_bytes", "resumed_stream", "take_window", "window_limit",
           "window_rounds"]
