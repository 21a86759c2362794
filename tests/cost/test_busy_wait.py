"""A GPU timing counts the kernels' execution and the CPU's queueing, not the GPU's idling.

Without a GPU: a fake stream where events read a GPU clock, a spin kernel advances it, and the
CPU has its own clock. On an H200 the events alone billed the GPU's idle time while Python
queued each node to the node (ResNet-50's node sums 1.26-1.35x the whole model;
benchmarks/results/gpu.md)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcompile.cost.busy_wait import CALIBRATION_CYCLES, SpinHold
from pdcompile.cost.timers import MIN_COVER, CudaEventTimer, measure


class Stream:
    """One GPU stream and the CPU beside it. Work queued while the GPU is held by a spin starts
    when the spin ends; work queued on an idle GPU starts when it is queued."""

    def __init__(self, cycles_per_second: float = 1.5e9) -> None:
        self.cpu = 0.0        # the CPU's clock
        self.gpu_free = 0.0   # when the GPU finishes what is queued
        self.rate = cycles_per_second
        self.holds: list[float] = []

    def queue(self, gpu_seconds: float, cpu_seconds: float = 0.0) -> None:
        self.cpu += cpu_seconds  # the CPU's time to queue it
        self.gpu_free = max(self.gpu_free, self.cpu) + gpu_seconds

    def sleep(self, cycles: int) -> None:
        self.holds.append(cycles / self.rate)
        self.queue(cycles / self.rate)

    def event(self) -> Any:
        stream = self

        class Event:
            def record(self) -> None:
                stream.queue(0.0)
                self.at = stream.gpu_free

            def synchronize(self) -> None:
                stream.cpu = max(stream.cpu, stream.gpu_free)

            def elapsed_time(self, other: Any) -> float:
                return (other.at - self.at) * 1000.0

        return Event()

    def synchronize(self) -> None:
        self.cpu = max(self.cpu, self.gpu_free)

    def timer(self) -> CudaEventTimer:
        hold = SpinHold(sleep=self.sleep, event_factory=self.event, synchronize=self.synchronize)
        return CudaEventTimer(event_factory=self.event, synchronize=self.synchronize, hold=hold,
                              clock=lambda: self.cpu)


def test_the_spin_is_calibrated_in_cycles_per_second() -> None:
    stream = Stream(cycles_per_second=1.5e9)
    hold = SpinHold(sleep=stream.sleep, event_factory=stream.event,
                    synchronize=stream.synchronize)
    assert hold.cycles_per_second() == pytest.approx(1.5e9)
    hold(0.004)
    assert stream.holds[-1] == pytest.approx(0.004)
    assert len([h for h in stream.holds if h == pytest.approx(CALIBRATION_CYCLES / 1.5e9)]) == 2


@given(kernels=st.lists(st.tuples(st.floats(1e-6, 1e-3), st.floats(1e-6, 1e-3)), min_size=1,
                        max_size=12))
def test_a_node_costs_its_kernels_or_its_queueing_whichever_is_longer(
        kernels: list[tuple[float, float]]) -> None:
    """A node that queues kernels (each taking the CPU `cpu` s to queue and the GPU `gpu` s to
    run): once warm, its time is its kernels' execution back to back, or the CPU's queueing
    where that is longer, never their sum as when the GPU idled between queueing and running."""
    stream = Stream()

    def node(_: Any) -> None:
        for gpu, cpu in kernels:
            stream.queue(gpu, cpu)

    seconds = measure(stream.timer(), node, warmup=1, repeats=3)
    gpu = sum(g for g, _ in kernels)
    cpu = sum(c for _, c in kernels)
    assert seconds == pytest.approx(max(gpu, cpu))


def test_without_the_hold_the_events_billed_the_idle_gpu() -> None:
    """The old timer (no hold) on the same stream: the node's queueing time is added to its
    execution (the defect); with the hold, execution alone."""
    stream = Stream()

    def node() -> None:
        stream.queue(gpu_seconds=50e-6, cpu_seconds=200e-6)  # queued slowly, runs fast
        stream.queue(gpu_seconds=400e-6, cpu_seconds=10e-6)

    unheld = CudaEventTimer(event_factory=stream.event, synchronize=stream.synchronize,
                            hold=lambda seconds: None, clock=lambda: stream.cpu)
    assert unheld.time(node) == pytest.approx(650e-6)  # 200 idle + 50 + 400
    held = stream.timer()
    held.time(node)  # sizes the hold
    assert held.time(node) == pytest.approx(450e-6)


def test_the_hold_follows_the_calls_queueing_time() -> None:
    stream = Stream()
    timer = stream.timer()
    timer.time(lambda: stream.queue(1e-3, cpu_seconds=30e-3))  # a whole model
    assert timer.cover == pytest.approx(60e-3)
    for _ in range(20):  # small nodes after it: the hold comes down, not 60 ms each
        timer.time(lambda: stream.queue(1e-5, cpu_seconds=1e-5))
    assert timer.cover == pytest.approx(MIN_COVER)
