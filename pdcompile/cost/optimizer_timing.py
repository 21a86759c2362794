"""Measured optimizer-step and weight-snapshot times per stage: what the simulator charges for
STEP and for each new stashed weight version.

The simulator's default for a step is one read of weights and gradients and one write of the
weights at the device's memory bandwidth (3 P / bandwidth). That holds for plain SGD on an
accelerator, not for Adam on a CPU: torch's default CPU Adam makes several passes over four
tensors per parameter, and on this project's development VM it took 15 ms per step for 2.2 M
parameters, against 0.9 ms for 3 P / bandwidth. So a pipeline whose optimizer is known gets
its steps timed: each stage's parameters are cloned (the pipeline's own weights and optimizer
state are never touched), given random gradients, and stepped by a fresh optimizer from the
pipeline's factory. Weight stashing (asynchronous 1F1B) clones a stage's parameters for each new
version; the simulator's default, a read and a write at the device's memory bandwidth
(2 P / bandwidth), took half the measured clone time on the same VM (0.63 against 1.26 ms for
16.8 MB), so `time_weight_copies` times the clone itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pdcompile.cost.cache_flush import CACHES, CacheFlush
from pdcompile.runtime.stash import WeightVersions


class Stages(Protocol):
    """What the timers read of a pipeline (`pdcompile.pipeline.Pipeline` has both)."""

    @property
    def stage_modules(self) -> Sequence[torch.nn.Module]: ...

    @property
    def optimizer_factory(self) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        ...


def time_optimizer_steps(pipe: Stages, *, repeats: int = 5,
                         caches: str = "cold") -> tuple[float, ...]:
    """Median seconds of one optimizer step of each stage, on clones of its parameters.

    The first step of each stage (lazy state allocation) is not counted. Stages without
    parameters take 0 s. Parameters on the `meta` device cannot be stepped: use the
    simulator's default there. `caches="cold"` (default) evicts the last-level cache before
    every timed step (cost/cache_flush.py): a training step touches the optimizer's state once,
    and a whole forward and backward pass through the caches between two steps, so back-to-back
    steps on warm caches are optimistic (Adam on 2.2 M parameters on the development VM: 5.0 ms
    warm, 7.9 ms cold, 9.6 ms in a 2-process pipeline). "warm" times them back to back."""
    if repeats < 1:
        raise ValueError(f"repeats must be a positive integer (got {repeats})")
    if caches not in CACHES:
        raise ValueError(f"caches={caches!r}: use 'cold' (the default) or 'warm'")
    return tuple(_time_steps(pipe, list(module.parameters()), repeats, cold=caches == "cold")
                 for module in pipe.stage_modules)


def time_weight_copies(pipe: Stages, *, repeats: int = 5) -> tuple[float, ...]:
    """Median seconds to snapshot each stage's parameters once, as weight stashing does
    in its steady state (runtime/stash.WeightVersions: a copy of every distinct parameter into
    the tensors of the version last dropped). The first snapshot of each stage, a clone, is not
    counted; stages without parameters take 0 s."""
    if repeats < 1:
        raise ValueError(f"repeats must be a positive integer (got {repeats})")
    return tuple(_time_copies(dict(module.named_parameters(remove_duplicate=False)), repeats)
                 for module in pipe.stage_modules)


def _time_copies(params: dict[str, torch.Tensor], repeats: int) -> float:
    if not params:
        return 0.0
    first = next(iter(params.values()))
    if any(p.device.type == "meta" for p in params.values()):
        raise ValueError("parameters on the meta device have no data to copy; time the copies "
                         "on a materialised model, or leave the simulator's default")
    versions = WeightVersions(params, copy=True)  # the runtime's own snapshots
    seconds = []
    for attempt in range(repeats + 1):
        _synchronize(first)
        started = time.perf_counter()
        copies = versions.acquire(versions.current)
        _synchronize(first)
        if attempt:  # the first one clones (and may grow the heap); the others reuse it
            seconds.append(time.perf_counter() - started)
        del copies
        versions.release(versions.current)  # dropped: the next snapshot's storage
        versions.advance()
    return statistics.median(seconds)


def _time_steps(pipe: Stages, params: Sequence[torch.Tensor], repeats: int, *,
                cold: bool) -> float:
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0.0
    if any(p.device.type == "meta" for p in trainable):
        raise ValueError("parameters on the meta device have no data to step; time the "
                         "optimizer on a materialised model, or leave the simulator's default")
    clones = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    generator = torch.Generator(device="cpu").manual_seed(0)
    for clone in clones:
        clone.grad = torch.randn(clone.shape, generator=generator,
                                 dtype=clone.dtype).to(clone.device)
    optimizer = pipe.optimizer_factory(clones)
    optimizer.step()  # allocates its state
    flush = CacheFlush(clones[0].device) if cold else None
    seconds = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        _synchronize(clones[0])
        started = time.perf_counter()
        optimizer.step()
        _synchronize(clones[0])
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
