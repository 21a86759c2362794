"""Loopback measured between two threads: comparable to two processes, never a process that
imports the caller's main module, and a failure or an overrun that names the way out."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from pdcompile.errors import MeasurementError
from pdcompile.machine import loopback
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_bounded

# two gloo processes ping-ponging 16 MiB and all-reducing it as the runtime does: the measurement
# local.py made before it used threads
TWO_PROCESSES = """
import datetime, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from pdcompile.machine.local import free_port
from pdcompile.machine.loopback import _runtime_allreduce

def rank(r, port, sizes, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    timings = []
    for numel in sizes:
        buf, best = torch.zeros(numel), float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            if r == 0:
                dist.send(buf, 1); dist.recv(buf, 1)
            else:
                dist.recv(buf, 0); dist.send(buf, 0)
            best = min(best, (time.perf_counter() - start) / 2)
        timings.append(best)
    grads = [piece.clone() for piece in torch.zeros(sizes[1]).chunk(8)]
    flat, ring = torch.empty(sizes[1]), []
    for _ in range(15):  # the runtime's all-reduce: gathered, summed, copied back, averaged
        dist.barrier()
        start = time.perf_counter()
        _runtime_allreduce(dist.group.WORLD, grads, flat, datetime.timedelta(seconds=60))
        ring.append(time.perf_counter() - start)
    timings.append(min(ring))
    if r == 0:
        out.put(timings)
    dist.destroy_process_group()

if __name__ == "__main__":
    sizes = [1, 4 * 2**20]
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank, args=(r, port, sizes, out)) for r in range(2)]
    for p in procs:
        p.start()
    small, large, ring = out.get(timeout=120)
    for p in procs:
        p.join(30)
    print("bandwidth", 4 * sizes[1] / max(large - small, large / 2), "latency", small,
          "allreduce", 4 * sizes[1] / max(ring - 2 * small, ring / 2))
"""


def _two_processes(tmp_path: Path) -> loopback.Loopback:
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    done = run_bounded([sys.executable, str(script)], timeout=240, env=env,
                       name="two-process loopback")
    assert done.returncode == 0, done.stdout
    words = done.stdout.split()
    return loopback.Loopback(*(float(words[words.index(name) + 1])
                               for name in ("bandwidth", "latency", "allreduce")))


@pytest.mark.slow
def test_threads_measure_what_two_processes_measure(tmp_path: Path) -> None:
    """Best of three each, side by side: the bandwidth and the all-reduce's within 3x of two
    processes' (on the 2-core VM they agree within run-to-run noise: sends 1.4-4.6 GB/s,
    all-reduces 1.0-1.3 GB/s, both ways), both latencies under a millisecond."""
    threads = [loopback.measure_loopback() for _ in range(3)]
    processes = [_two_processes(tmp_path) for _ in range(3)]
    for figure in ("bandwidth", "allreduce_bandwidth"):
        thread_best = max(getattr(one, figure) for one in threads)
        process_best = max(getattr(one, figure) for one in processes)
        assert process_best / 3 < thread_best < process_best * 3, (figure, threads, processes)
    assert min(one.latency for one in threads) < 1e-3
    assert min(one.latency for one in processes) < 1e-3


def _transport_allreduce(worker: Any) -> float:
    """The fastest of 15 all-reduces of 16 MiB in 8 gradients by the distributed backend's
    own transport, as a replicated stage runs it each round (then averaged, as 1f1b does)."""
    import torch

    from pdcompile.backends.distributed import DistributedTransport

    transport = DistributedTransport(monitor=worker.monitor)
    grads = [piece.clone() for piece in torch.ones(4 * 2**20).chunk(8)]
    best = float("inf")
    for _ in range(15):
        dist.barrier()
        start = time.perf_counter()
        transport.all_reduce(grads, [0, 1]).wait()
        for g in grads:
            g.div_(2)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.slow
def test_the_allreduce_figure_prices_the_runtime_transports_allreduce() -> None:
    """What the local cluster charges for an all-reduce is what the backend's transport takes
    between two worker processes: the figure of the threads' measurement, side by side with the
    transport's fastest round, within 2x either way (on the 2-core VM at load 7, 2026-11-26:
    priced 21-22 ms, the transport 17-19 ms)."""
    from pdcompile.backends.launch import launch

    figure = max(loopback.measure_loopback().allreduce_bandwidth for _ in range(2))
    seconds = min(min(launch(_transport_allreduce, 2, timeout=120)) for _ in range(2))
    priced = 4 * 4 * 2**20 / figure
    assert priced / 2 < seconds < priced * 2, (priced, seconds)


@pytest.mark.slow
def test_a_script_without_a_main_guard_measures_local_once(tmp_path: Path) -> None:
    """A user's `python3 train.py` naming local-2 on a machine never measured: its module runs
    once (no child re-imports it) and it finishes in seconds."""
    script = tmp_path / "train.py"
    script.write_text("import pdcompile\n"
                      "print('main module ran')\n"
                      "print(pdcompile.Cluster.preset('local-2').levels[0].bandwidth > 0)\n")
    env = {**os.environ, "PDCOMPILE_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PDCOMPILE_LOCAL_BANDWIDTH", None)
    started = time.monotonic()
    done = run_bounded([sys.executable, str(script)], timeout=60, env=env, cwd=tmp_path,
                       name="train.py")
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("main module ran") == 1 and "True" in done.stdout, done.stdout
    assert (tmp_path / "cache" / "local.json").exists()
    assert time.monotonic() - started < 60


def test_a_failing_group_names_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise RuntimeError("no loopback interface")

    monkeypatch.setattr(dist, "ProcessGroupGloo", type("Refusing", (), {
        "__init__": refuse, "_Options": dist.ProcessGroupGloo._Options,
        "create_device": dist.ProcessGroupGloo.create_device}))
    with pytest.raises(MeasurementError, match=r"loopback.*failed \(RuntimeError: no loopback "
                                               r"interface\); set PDCOMPILE_LOCAL_BANDWIDTH"):
        loopback.measure_loopback(numel=16, timeout_s=10)


def test_an_overrun_names_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that never connects: the wait ends at its timeout, naming the override."""
    def stall(self: Any, *args: Any) -> None:
        time.sleep(2)
        raise RuntimeError("late")

    monkeypatch.setattr(dist, "ProcessGroupGloo", type("Stalling", (), {
        "__init__": stall, "_Options": dist.ProcessGroupGloo._Options,
        "create_device": dist.ProcessGroupGloo.create_device}))
    started = time.monotonic()
    with pytest.raises(MeasurementError, match=r"two gloo ranks on 127.0.0.1.* did not finish "
                                               r"in 0.2 s; set PDCOMPILE_LOCAL_BANDWIDTH"):
        loopback.measure_loopback(numel=16, timeout_s=0.2)
    assert time.monotonic() - started < 1.5
