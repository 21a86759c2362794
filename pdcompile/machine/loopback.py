"""Gloo over loopback measured between two threads of this process.

Two processes would be the obvious measurement, but a spawned child re-imports the caller's
main module: a user's `python3 train.py` that names `local-2` would run its own script again in
the children (and wait on them until a timeout). So both ranks live here, each a
`ProcessGroupGloo` built directly over an in-process store (no `init_process_group`, no global
state) in its own thread; gloo still moves every byte through a TCP socket on 127.0.0.1, so the
bandwidth is the one worker processes see (tests/machine/test_loopback.py compares the two).
The all-reduce is timed as the runtime runs it, copies included (docs/cost-model.md).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, NamedTuple

from pdcompile.errors import MeasurementError

REPEATS = 5
ALLREDUCE_REPEATS = 15
GRADIENTS = 8  # tensors the all-reduce gathers into one buffer, as a stage's parameters
OVERRIDE = "set PDCOMPILE_LOCAL_BANDWIDTH (e.g. PDCOMPILE_LOCAL_BANDWIDTH=2GB/s) to skip it"


class Loopback(NamedTuple):
    """What gloo achieves between two processes of this host."""

    bandwidth: float  # bytes/s of one send
    latency: float  # seconds of a 4-byte send
    # bus bandwidth (bytes/s) of the runtime's all-reduce between the two: gloo's ring and the
    # runtime's copies into one buffer and back (`_runtime_allreduce`)
    allreduce_bandwidth: float


def _runtime_allreduce(group: Any, grads: list[Any], flat: Any,
                       timeout: datetime.timedelta) -> None:
    """The gradients' all-reduce as pdcompile's runtime runs it between the replicas of a
    stage (`DistributedTransport.all_reduce`, then `StageRuntime.all_reduce`): gathered into
    one flat buffer kept from round to round, summed by gloo, copied back, averaged."""
    import torch

    torch.cat([g.reshape(-1) for g in grads], out=flat)
    group.allreduce([flat]).wait(timeout)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    for g in grads:
        g.div_(2)


def _rank(rank: int, store: Any, sizes: list[int], timeout: datetime.timedelta,
          out: dict[int, list[float] | BaseException]) -> None:
    """Rank `rank`: the best half round trip of each size, then the fastest all-reduce of the
    largest (as the runtime runs it), into `out[rank]` (or its error)."""
    import torch
    import torch.distributed as dist

    gloo: Any = dist.ProcessGroupGloo  # its type stubs lack _Options, send, recv, barrier
    try:
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [gloo.create_device(hostname="127.0.0.1")]
        group = gloo(store, rank, 2, options)
        peer = 1 - rank
        timings = []
        for numel in sizes:
            buf = torch.zeros(numel)
            best = float("inf")
            for _ in range(REPEATS):
                group.barrier().wait(timeout)
                start = time.perf_counter()
                if rank == 0:
                    group.send([buf], peer, 0).wait(timeout)
                    group.recv([buf], peer, 0).wait(timeout)
                else:
                    group.recv([buf], peer, 0).wait(timeout)
                    group.send([buf], peer, 0).wait(timeout)
                best = min(best, (time.perf_counter() - start) / 2)
            timings.append(best)
        # the all-reduce the runtime runs, its copies included; its fastest of several: a ring
        # needs both ranks and their gloo threads on a core at once, so any other program
        # that takes a core stalls it (the median moved 2.5x with the machine's load, the
        # fastest far less), and the replicas of a training run all-reduce in lockstep
        grads = [piece.clone() for piece in torch.zeros(sizes[-1]).chunk(GRADIENTS)]
        flat = torch.empty(sizes[-1])
        allreduces = []
        for _ in range(ALLREDUCE_REPEATS):
            group.barrier().wait(timeout)
            start = time.perf_counter()
            _runtime_allreduce(group, grads, flat, timeout)
            allreduces.append(time.perf_counter() - start)
        timings.append(min(allreduces))
        out[rank] = timings
    except BaseException as err:  # handed to the measuring thread, which names it
        out[rank] = err


def measure_loopback(*, numel: int = 4 * 2**20, timeout_s: float = 60.0) -> Loopback:
    """Gloo over 127.0.0.1 between two ranks of this process: a send's bandwidth (`numel`
    float32s, default 16 MiB) and latency (4 bytes), and the bus bandwidth of the runtime's
    all-reduce of `numel` float32s in GRADIENTS tensors (between two ranks a ring moves the
    whole buffer once each way; the runtime also copies it into one buffer and back).
    Raises MeasurementError, naming what it waited for and the override, when it fails or
    takes longer than `timeout_s`."""
    import torch.distributed as dist

    if numel < 2:
        raise ValueError(f"numel must be at least 2 floats (got {numel})")
    sizes = [1, numel]
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.HashStore()
    store.set_timeout(timeout)
    out: dict[int, list[float] | BaseException] = {}
    threads = [threading.Thread(target=_rank, args=(r, store, sizes, timeout, out),
                                name=f"pdcompile-loopback-{r}", daemon=True) for r in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    what = f"measuring this machine's loopback (two gloo ranks on 127.0.0.1, {4 * numel} bytes)"
    if any(thread.is_alive() for thread in threads):
        raise MeasurementError(f"{what} did not finish in {timeout_s:g} s; {OVERRIDE}")
    errors = [result for result in out.values() if isinstance(result, BaseException)]
    if errors:
        first = str(errors[0]).strip().splitlines()
        raise MeasurementError(f"{what} failed ({type(errors[0]).__name__}: "
                               f"{first[0] if first else ''}); {OVERRIDE}") from errors[0]
    small, large, allreduce = out[0]  # type: ignore[misc]
    # the latency is subtracted, but never for more than half of the large send's time: with
    # small sizes the two timings are close and their noisy difference gave absurd bandwidths
    bandwidth = 4 * numel / max(large - small, large / 2, 1e-9)
    return Loopback(bandwidth, small, 4 * numel / max(allreduce - 2 * small, allreduce / 2, 1e-9))
