"""Evicting the caches before each timed run: profiles of nodes as a pipeline meets them.

Why: the cost pass times one node many times in a row, so from the second run on its weights
and inputs sit in the last-level cache. In a training step every other layer runs between two
uses of a node's weights, and in a pipeline the other workers on the host stream their own, so
the node often finds its data in memory instead. Memory-bound work pays for that: on the 2-core
development VM, an MLP's profiled forwards took 46% longer and its backwards 12% longer with the
caches flushed before every run (the forwards of small minibatches read a whole weight matrix
for little arithmetic); the same forwards ran 30-45% longer in a 2-process pipeline than in the
warm profile. Benchmarking tools flush the same way (Triton's `do_bench` clears the GPU's L2).

`CacheFlush(device, touched=...)` is a callable that overwrites a buffer as large as the
device's last-level cache (CPU: the highest cache level sysfs lists; CUDA: the L2) and waits for
it; no larger than what a training step touches besides the node (`touched`, from
`step_bytes`): between two uses of a node's weights a pipeline streams the rest of its model's
weights, gradients and activations through the cache, no more, so a flush larger than that
would evict what the pipeline keeps. It also keeps profiling cheap where the reported cache is
huge: a VM sharing a 480 MiB L3 across its host wrote 480 MiB before every timed run of a tiny
T5 (77 ms a flush, 314 of a 351-s compile).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdcompile.machine.cluster import Cluster

CACHES = ("warm", "cold")  # how the profilers may leave the caches before a timed run
DEFAULT_BYTES = 64 * 2**20  # when the cache size cannot be read
MAX_BYTES = 2**30  # a flush must stay cheap next to the run it precedes
SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def caches_for(cluster: Cluster) -> str:
    """The cache state to profile in for a pipeline on `cluster`: "cold" where its workers
    outnumber the processors they share, because the operating system then runs them in turns
    and each turn evicts the data of the worker before it (on the development VM, 4 processes on
    2 cores ran within 5% of cold-profile predictions, 14-25% slower than warm ones); "warm"
    where every worker keeps a processor and its caches (benchmarks/results/simulator.md)."""
    return "cold" if cluster.shared_cores() is not None else "warm"


def last_level_cache_bytes(device: torch.device, *, sysfs: Path = SYSFS_CACHES) -> int:
    """Size of `device`'s last-level cache in bytes (DEFAULT_BYTES where it cannot be read)."""
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        return size or DEFAULT_BYTES
    best_level, best_size = -1, 0
    for index in sorted(sysfs.glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if level > best_level or (level == best_level and size > best_size):
            best_level, best_size = level, size
    return best_size or DEFAULT_BYTES


def _parse_size(text: str) -> int:
    """sysfs cache sizes: "48K", "2048K", "480M"."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"cache size {text!r}")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2).upper()]
    return int(match.group(1)) * scale


def step_bytes(gm: torch.nn.Module, activation_bytes: int) -> int:
    """Bytes one training step of `gm` brings through the caches: every parameter and buffer,
    each parameter's gradient, and every activation (`activation_bytes`, the nodes' outputs)
    with its gradient. Optimizer state is left out (the cost pass does not know the optimizer),
    so this is a lower bound of the stream between two uses of a node."""
    params = sum(p.numel() * p.element_size() for p in gm.parameters())
    grads = sum(p.numel() * p.element_size() for p in gm.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in gm.buffers())
    return params + grads + buffers + 2 * activation_bytes


class CacheFlush:
    """Evicts a device's last-level cache when called: writes `nbytes` (by default the cache's
    size, at most `touched` where given and at most MAX_BYTES) and waits until the writes are
    done."""

    def __init__(self, device: torch.device, size: int | None = None, *,
                 touched: int | None = None) -> None:
        nbytes = min(size if size is not None else last_level_cache_bytes(device), MAX_BYTES)
        if touched is not None:
            nbytes = min(nbytes, touched)
        self._buffer = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        self.nbytes = self._buffer.numel() * 4
        self.calls = 0

    def __call__(self) -> None:
        self._buffer.fill_(1.0)
        if self._buffer.device.type == "cuda":
            torch.cuda.synchronize(self._buffer.device)
        self.calls += 1


__all__ = ["CACHES", "CacheFlush", "last_level_cache_bytes", "step_bytes"]
