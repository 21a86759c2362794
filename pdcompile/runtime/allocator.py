"""CPU memory allocator settings for training processes: keep freed memory for reuse.

Why: CPU tensors come from glibc's malloc, which hands large freed blocks back to the kernel
(munmap, heap trims) and maps fresh pages on the next allocation; each new page faults and is
zeroed. Training frees and reallocates the same activations, gradients and (with weight
stashing) weight copies every minibatch, so with glibc's defaults a pipeline stage spends part of
its time in page faults, and more of it than a profiler's tight loop does. Measured on the 2-core
development VM (benchmarks/results/simulator.md): a 2-process CNN pipeline ran 56 ms per
minibatch with the defaults and 50 ms with these settings. This is what PyTorch's CUDA caching
allocator does on GPUs and what jemalloc/tcmalloc are preloaded for on CPUs: memory once used
stays with the process.

pdcompile applies `tune_allocator()` in the worker processes it starts (`train_processes`,
`pdcompile run`, `launch`) and before the cost pass times nodes, so that the profile sees the
allocator the workers will run with. `PDCOMPILE_ALLOCATOR=system` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

ENV = "PDCOMPILE_ALLOCATOR"


@dataclass(frozen=True)
class AllocatorSettings:
    """glibc malloc settings (bytes). Blocks up to `mmap_threshold` come from the heap (32 MiB
    is glibc's largest allowed value); freed memory at the top of the heap is returned to the
    kernel only beyond `trim_threshold`; the heap grows `top_pad` at a time."""

    mmap_threshold: int = 32 * 2**20
    trim_threshold: int = 2**30
    top_pad: int = 64 * 2**20


def tune_allocator(settings: AllocatorSettings = AllocatorSettings()) -> bool:
    """Apply `settings` to this process's malloc; True when applied. Nothing happens (False)
    outside glibc (macOS, musl, Windows) or when `PDCOMPILE_ALLOCATOR=system`."""
    if os.environ.get(ENV, "").strip().lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = [mallopt(_M_MMAP_THRESHOLD, settings.mmap_threshold),
               mallopt(_M_TRIM_THRESHOLD, settings.trim_threshold),
               mallopt(_M_TOP_PAD, settings.top_pad)]
    return all(ok == 1 for ok in applied)


__all__ = ["ENV", "AllocatorSettings", "tune_allocator"]
