"""This machine as a cluster: loopback bandwidth and CPU speed, measured once and cached.

The figures are cached in `$PDCOMPILE_CACHE` (default `~/.cache/pdcompile/local.json`) so that
the measurement (under a second: gloo between two threads, machine/loopback.py, and a matmul)
runs once per machine; it starts no process. The file names the machine and torch version
that measured it (`machine_identity`), and only this machine's finite positive figures are
used: a damaged file, or one another host or another torch wrote (a shared home folder), is
measured again (a file without the name, from before it was kept, counts as this machine's).
A cache folder that cannot be written costs a measurement per process.
`PDCOMPILE_LOCAL_BANDWIDTH` (bytes/s) overrides the measured bandwidth, and
`PDCOMPILE_LOCAL_ALLREDUCE_BANDWIDTH` the all-reduce's (without it, the override's).
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from pdcompile.machine.device import Device
from pdcompile.machine.loopback import Loopback, measure_loopback
from pdcompile.util.bounded_file import plain_file_bytes


def _cache_file() -> Path:
    root = os.environ.get("PDCOMPILE_CACHE") or os.path.join(Path.home(), ".cache", "pdcompile")
    return Path(root) / "local.json"


def machine_identity() -> str:
    """What the cached figures belong to: this host and the torch that measured them (a home
    folder shared by several machines, or a torch upgraded since, has other figures)."""
    import torch

    return f"{socket.gethostname()} {platform.machine()} torch {torch.__version__}"


# the figures a machine can have, widely: a cached one outside (1e-300 bytes/s, a latency of
# a day) is no measurement of this machine's and is measured again
_PLAUSIBLE = {"bandwidth": (1e3, 1e15), "allreduce_bandwidth": (1e3, 1e15),
              "latency": (1e-9, 60.0), "flops": (1e5, 1e18), "mem_bandwidth": (1e5, 1e16)}
_MOST_BYTES = 1 << 16  # the cache holds a handful of numbers: a larger file is none of ours


def _read_cache() -> dict[str, float]:
    """The cached figures of this machine: each a finite positive number within what a
    machine can have (anything else in the file, a damaged value or another machine's
    figures, is measured again). A cache that is no plain file of ours (a FIFO, a link to
    /dev/zero, a file of gigabytes: reading it hung or filled the memory) is measured again."""
    text = _cache_text()
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("machine", machine_identity()) != machine_identity():
        return {}
    return {key: number for key, value in data.items() if key != "machine"
            and (number := _figure(key, value)) is not None}


def _cache_text() -> str | None:
    """The cache file's text, or None where it is missing, unreadable, not a plain file (read
    without blocking: checked on the open file) or larger than any cache pdcompile writes."""
    data = plain_file_bytes(_cache_file(), _MOST_BYTES)
    try:
        return None if data is None else data.decode()
    except UnicodeDecodeError:
        return None


def _figure(key: str, value: Any) -> float | None:
    """`value` as the cached figure `key`: a finite positive number (an int too large for a
    float, 10**400, raised OverflowError) within what a machine can have; else None."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    low, high = _PLAUSIBLE.get(key, (0.0, math.inf))
    return number if math.isfinite(number) and number > 0 and low <= number <= high else None


def _write_cache(update: dict[str, Any]) -> None:
    data = {**_read_cache(), **update, "machine": machine_identity()}
    file = _cache_file()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        # a temporary file of this writer's own (threads share a pid), renamed over the cache
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".local.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(data, indent=1))
            os.replace(tmp, file)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_bandwidth() -> Loopback:
    """Loopback between processes here (a send's bytes/s and latency, an all-reduce's bus
    bytes/s): env override, cache, or measured."""
    override = os.environ.get("PDCOMPILE_LOCAL_BANDWIDTH")
    if override:
        from pdcompile.units import parse_quantity

        bandwidth = parse_quantity(override, "bandwidth")
        ring = os.environ.get("PDCOMPILE_LOCAL_ALLREDUCE_BANDWIDTH")
        return Loopback(bandwidth, 50e-6,
                        parse_quantity(ring, "bandwidth") if ring else bandwidth)
    cached = _read_cache()
    if all(key in cached for key in Loopback._fields):
        return Loopback(*(float(cached[key]) for key in Loopback._fields))
    measured = measure_loopback()
    _write_cache(measured._asdict())
    return measured


def _measure_cpu() -> tuple[float, float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        flops = 2 * 512**3 / best
        x = torch.empty(8 * 2**20)
        y = torch.empty_like(x)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            y.copy_(x)
            best = min(best, time.perf_counter() - start)
        return flops, 2 * x.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def usable_cores() -> int:
    """The processors this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def oversubscription_note(workers: int) -> str | None:
    """A NOTE for predictions of `workers` processes on this machine when they outnumber its
    cores (the simulator shares the cores among them, but not the way the operating system
    does); None when they do not."""
    cores = usable_cores()
    if workers <= cores:
        return None
    return (f"NOTE: {workers} worker processes would share this machine's {cores} cores; the "
            "prediction shares the cores among them (costs profiled with cold caches, as the "
            "workers take turns) but not in the operating system's time slices "
            "(benchmarks/results/simulator.md: 4 processes on 2 cores, within 15% in steady "
            "state, slower in their first ~100 minibatches)")


def local_device(workers: int = 1) -> Device:
    """One process of this machine: one thread's FLOP/s, memory shared among `workers`."""
    cached = _read_cache()
    if "flops" not in cached or "mem_bandwidth" not in cached:
        flops, mem_bw = _measure_cpu()
        _write_cache({"flops": flops, "mem_bandwidth": mem_bw})
        cached = _read_cache() | {"flops": flops, "mem_bandwidth": mem_bw}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu-local", total / max(workers, 1), float(cached["flops"]),
                  float(cached["mem_bandwidth"]), None)
