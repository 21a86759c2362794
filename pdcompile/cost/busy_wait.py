"""Keeping a GPU busy while the CPU queues the work to be timed.

CUDA events time the GPU between two marks, idle time included. A node timed alone after a
synchronisation leaves the GPU idle while Python and the autograd engine queue its kernels, and
that idle time was billed to the node: on an H200, ResNet-50's node sums were 1.26-1.35x the
whole model, where the CPU runs ahead and the GPU idles only where a model is launch-bound.
Queueing a spin kernel (`torch.cuda._sleep`) longer than the CPU's queueing time before the
first mark lets the kernels run back to back once the spin ends, so the events see their
execution alone; the CPU's queueing time is measured beside it (timers.CudaEventTimer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

CALIBRATION_CYCLES = 2_000_000  # about 1 ms at a GPU's clock: long enough to time with events


class SpinHold:
    """`hold(seconds)` queues a kernel that keeps the current GPU stream busy that long; the
    cycles per second of `torch.cuda._sleep` are measured once, on first use."""

    def __init__(self, *, sleep: Callable[[int], None] | None = None,
                 event_factory: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self._sleep = sleep or torch.cuda._sleep
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or torch.cuda.synchronize
        self._cycles_per_second: float | None = None

    def cycles_per_second(self) -> float:
        if self._cycles_per_second is None:
            self._synchronize()
            self._sleep(CALIBRATION_CYCLES)  # warm: the first launch loads the kernel
            start, end = self._event(), self._event()
            start.record()
            self._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            seconds = float(start.elapsed_time(end)) / 1000.0
            self._cycles_per_second = CALIBRATION_CYCLES / max(seconds, 1e-9)
        return self._cycles_per_second

    def __call__(self, seconds: float) -> None:
        self._sleep(max(1, int(seconds * self.cycles_per_second())))
