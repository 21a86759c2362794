"""Timers for the measured cost source: wall clock (or CPU time) on the CPU, CUDA events on a
GPU, one interface.

On a GPU a call's time is the larger of its kernels' execution (events around kernels queued
back to back) and the CPU's time to queue it.

`select_timer(device)` picks the right one; `measure(timer, fn, setup=..., warmup=, repeats=)`
runs `setup` untimed and `fn` timed, after warm-up, and returns the median (robust to the odd
slow run caused by the OS or the allocator).
"""

from __future__ import annotations

import functools
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pdcompile.cost.busy_wait import SpinHold


class Timer(ABC):
    """Times one call of a function, in seconds, on the device the work runs on."""

    @abstractmethod
    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds `fn()` takes (work queued on the device included)."""


class WallClockTimer(Timer):
    """time.perf_counter around the call; right for CPU work, which runs synchronously."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def time(self, fn: Callable[[], Any]) -> float:
        start = self._clock()
        fn()
        return self._clock() - start


class CpuTimeTimer(Timer):
    """CPU seconds the call took. Unlike the wall clock it does not count time other processes
    took the core away, so it stays steady on a busy machine. With one torch thread torch
    computes (forward and, on a CPU, backward) on the calling thread, so that thread's CPU time
    (time.thread_time) is the compute, and other threads of the process (a progress bar's
    refresh, a communication library's) do not inflate it; with more torch threads, the whole
    process's (time.process_time). `clock` fixes one."""

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock

    def time(self, fn: Callable[[], Any]) -> float:
        clock = self._clock or (time.thread_time if torch.get_num_threads() == 1
                                else time.process_time)
        start = clock()
        fn()
        return clock() - start


class CudaEventTimer(Timer):
    """The call's time on a GPU: the larger of the GPU's execution time between two CUDA events
    and the CPU's time to queue the call (a node runs no faster than it can be issued).

    Before the first event a spin kernel (cost/busy_wait.py) holds the stream longer than the
    CPU took to queue the last call, so the GPU starts the call's kernels back to back instead
    of idling while Python queues them (that idle time was billed to each node); the hold
    follows the calls' queueing times (warm-up runs size it for the timed ones). `event_factory`, `synchronize`, `hold` and `clock`
    exist so that the interface can be tested without a GPU.
    """

    def __init__(self, *, event_factory: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None,
                 hold: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or torch.cuda.synchronize
        self._hold = hold or SpinHold(event_factory=self._event, synchronize=self._synchronize)
        self._clock = clock
        self.cover = INITIAL_COVER  # seconds the GPU is held before the call

    def time(self, fn: Callable[[], Any]) -> float:
        return max(self.readings(fn))

    def readings(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(the kernels' execution between the events, the CPU's queueing) of one call, s."""
        self._synchronize()  # work queued earlier must not be billed to fn
        start, end = self._event(), self._event()
        self._hold(self.cover)
        issued = self._clock()
        start.record()
        fn()
        end.record()
        host = self._clock() - issued
        end.synchronize()
        # the next call's hold: at once long enough for a call like this one, and halving
        # call by call after a long one (a whole model's hold would slow every node after it)
        self.cover = max(host * COVER_MARGIN, self.cover / 2.0, MIN_COVER)
        return float(start.elapsed_time(end)) / 1000.0, host  # elapsed_time is in ms


INITIAL_COVER = 1e-3  # seconds; warm-up runs size it to the call's own queueing time
MIN_COVER = 20e-6
COVER_MARGIN = 2.0


CLOCKS = ("wall", "cpu")


def select_timer(device: torch.device | str, *, clock: str = "wall") -> Timer:
    """CudaEventTimer for a CUDA device; on other devices the wall clock, or with clock="cpu"
    the process's CPU time (steady on a shared machine; right with one torch thread)."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; use one of {', '.join(CLOCKS)}")
    kind = torch.device(device).type
    if kind == "cuda":
        return CudaEventTimer()
    return CpuTimeTimer() if clock == "cpu" else WallClockTimer()


STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "min": min,
    "mean": statistics.fmean,
}


def measure(timer: Timer, fn: Callable[[Any], Any], *, setup: Callable[[], Any] | None = None,
            warmup: int = 2, repeats: int = 5, statistic: str = "median") -> float:
    """Seconds of `fn(setup())`: the `statistic` (median by default; "min" is the estimate least
    disturbed by other processes on a busy machine) over `repeats` runs after `warmup` untimed
    ones; `setup` (untimed) prepares each run's argument (None when not given)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; use one of {', '.join(STATISTICS)}")
    samples: list[float] = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        seconds = timer.time(functools.partial(fn, arg))
        if i >= warmup:
            samples.append(seconds)
    return float(STATISTICS[statistic](samples))
