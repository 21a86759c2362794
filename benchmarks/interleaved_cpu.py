"""Main-thread CPU per minibatch and rank: our interleaved 1F1B against torch's
ScheduleInterleaved1F1B on benchmarks/runtime.py's chunks (chunks c and c + 2 on rank c, 8
microbatches of 32), both ranks at once as the benchmark runs them.

Why CPU time: on a loaded machine the wall clock moves with whatever else runs, while the work
a rank's main thread does (compute, message handlers, the runtime's Python, the driver) moves
far less; what one implementation does beyond the other shows here, and what is left of a wall
clock gap is waiting (docs/runtime-profile.md, tenth round).

    python benchmarks/interleaved_cpu.py [--passes 2] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdcompile.backends.launch import Worker, launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import runtime as bench  # noqa: E402

Sample = tuple[float, float]  # main-thread CPU ms, wall ms, per minibatch


def _ours(worker: Worker, rounds: int, steps: int) -> list[Sample]:
    from pdcompile.backends.distributed import run_distributed

    pipe, data = bench.ours_pipeline("interleaved-1f1b", steps)
    run_distributed(pipe, data[:2], monitor=worker.monitor)  # warm-up
    out = []
    for _ in range(rounds):
        cpu, wall = time.thread_time(), time.perf_counter()
        run_distributed(pipe, data[:steps], monitor=worker.monitor)
        out.append(((time.thread_time() - cpu) / steps * 1e3,
                    (time.perf_counter() - wall) / steps * 1e3))
    return out


def _torch(worker: Worker, rounds: int, steps: int) -> list[Sample]:
    out: list[Sample] = []

    def timed(step: Callable[[int], None], *, rounds: int, steps: int, warmup: int,
              sync: Callable[[], None] = lambda: None, cpu: Any = None) -> list[float]:
        for i in range(warmup):
            step(i)
        for _ in range(rounds):
            sync()
            start_cpu, start = time.thread_time(), time.perf_counter()
            for i in range(steps):
                step(i)
            out.append(((time.thread_time() - start_cpu) / steps * 1e3,
                        (time.perf_counter() - start) / steps * 1e3))
        return [0.0] * rounds

    bench._rounds = timed  # this worker process's copy of the module only
    bench._pp_worker(worker, "interleaved", rounds, steps, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    """Alternate torch's and ours, `--passes` times; print medians per rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for _ in range(args.passes):
        for name, fn in (("torch", _torch), ("ours", _ours)):
            got = launch(fn, 2, args=(args.rounds, args.steps), timeout=900, fault_timeout=60)
            load = Path("/proc/loadavg").read_text().split()[0]
            for rank, rows in enumerate(got):
                cpu = statistics.median(c for c, _ in rows)
                wall = statistics.median(w for _, w in rows)
                print(f"{name:<5} rank {rank}: main-thread CPU {cpu:6.1f} ms a minibatch, "
                      f"wall {wall:6.1f} ms (load {load})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
