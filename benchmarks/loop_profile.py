"""What a rank's training loop costs beyond its compute, in measures that the load moves little.

For one schedule of benchmarks/runtime.py's MLP (2 gloo processes, one thread each; the 4 | 4 +
head split, or 2 chunks a rank for interleaved and V-shaped schedules), each rank trains
--warmup minibatches, then --rounds runs of --steps minibatches, and reports per minibatch:

- the main thread's CPU (`time.thread_time`) inside the generated rank loop (`drive`: the
  actions, their handlers, the transport) and inside the whole training loop (`_run_loop`:
  also each run's set-up, one run a minibatch under a flush schedule), medians of the rounds;
  and the whole process's CPU while `drive` runs (gloo's loop threads, the posting thread);
- Python function calls inside `drive` and inside `_run_loop` outside `drive` (cProfile, one
  more round: a count), and the functions called most inside `drive`;
- bytes that torch operators copy or allocate on the main thread inside `drive` (a
  TorchDispatchMode, one more round), by operator: what the runtime adds to the compute's own
  traffic (the posting thread's packing, backends/posting_thread.py, is not counted).

At width 8 almost no compute is left, so the loop's CPU there is the runtime's own overhead.
To compare two trees, run it with each tree first on PYTHONPATH, alternating.

    python benchmarks/loop_profile.py --schedule 1f1b [--width 1024] [--rounds 5] [--steps 16]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtime as bench  # noqa: E402 - benchmarks/runtime.py, beside this file

from pdcompile.backends.launch import Worker, launch  # noqa: E402

# operators whose output is a copy of data, or new memory
_COPIES = {"clone", "copy_", "cat", "_to_copy", "contiguous", "index_put_", "stack"}
_ALLOCS = {"empty", "empty_like", "zeros", "zeros_like", "ones_like", "new_zeros", "new_empty",
           "empty_strided", "full", "new_empty_strided"}


class _Bytes(TorchDispatchMode):
    """Bytes written by copying operators and allocated by allocating ones, by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: Counter[str] = Counter()
        self.allocated: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if isinstance(out, torch.Tensor):
            size = out.numel() * out.element_size()
            if name in _COPIES:
                self.copied[name] += size
            elif name in _ALLOCS:
                self.allocated[name] += size
        return out


class _Hooks:
    """Wraps `drive` and `_run_loop`: CPU time inside each, and optionally a cProfile of each
    or the byte counter inside `drive`."""

    def __init__(self) -> None:
        self.cpu = {"drive": 0.0, "loop": 0.0, "process": 0.0}
        self.profilers: dict[str, cProfile.Profile] | None = None
        self.bytes: _Bytes | None = None

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            profiler = self.profilers[name] if self.profilers is not None else None
            counting = self.bytes if name == "drive" else None
            if profiler is not None:
                profiler.enable()
            if counting is not None:
                counting.__enter__()
            start, process = time.thread_time(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.thread_time() - start
                if name == "drive":
                    self.cpu["process"] += time.process_time() - process
                if counting is not None:
                    counting.__exit__(None, None, None)
                if profiler is not None:
                    profiler.disable()
        return wrapped


def _calls(profiler: cProfile.Profile) -> tuple[int, list[tuple[str, int]]]:
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(v[1] for v in stats.values())
    most = sorted(((v[1], f"{os.path.basename(k[0])}:{k[1]}:{k[2]}") for k, v in
                   stats.items()), reverse=True)[:40]
    return total, [(name, n) for n, name in most]


def _worker(worker: Worker, schedule: str, width: int, rounds: int, steps: int,
            warmup: int, dump: str = "", fuse: bool = True) -> dict[str, Any]:
    from pdcompile.backends import distributed

    torch.set_num_threads(1)
    bench.WIDTH = width
    pipe, data = bench.ours_pipeline(schedule, max(steps, warmup, 4), fuse=fuse)
    hooks = _Hooks()
    distributed.drive = hooks.wrap("drive", distributed.drive)  # type: ignore[assignment]
    distributed._run_loop = hooks.wrap("loop", distributed._run_loop)  # type: ignore
    if warmup:
        distributed.run_distributed(pipe, data[:warmup], monitor=worker.monitor)
    drive_cpu, loop_cpu, process_cpu = [], [], []
    for _ in range(rounds):
        hooks.cpu = {"drive": 0.0, "loop": 0.0, "process": 0.0}
        distributed.run_distributed(pipe, data[:steps], monitor=worker.monitor)
        drive_cpu.append(hooks.cpu["drive"] / steps)
        loop_cpu.append(hooks.cpu["loop"] / steps)
        process_cpu.append(hooks.cpu["process"] / steps)
    hooks.profilers = {"drive": cProfile.Profile(time.thread_time),
                       "loop": cProfile.Profile(time.thread_time)}
    distributed.run_distributed(pipe, data[:steps], monitor=worker.monitor)
    if dump:  # for pstats: python -m pstats DUMP.rankN
        hooks.profilers["drive"].dump_stats(f"{dump}.rank{worker.rank}")
    drive_calls, most = _calls(hooks.profilers["drive"])
    loop_calls, _ = _calls(hooks.profilers["loop"])
    hooks.profilers = None
    hooks.bytes = _Bytes()
    distributed.run_distributed(pipe, data[:steps], monitor=worker.monitor)
    counted = hooks.bytes
    return {"drive_cpu": statistics.median(drive_cpu), "loop_cpu": statistics.median(loop_cpu),
            "process_cpu": statistics.median(process_cpu),
            "drive_rounds": drive_cpu, "drive_calls": drive_calls / steps,
            "loop_calls": loop_calls / steps, "most": [(k, n / steps) for k, n in most],
            "copied": {k: v / steps for k, v in counted.copied.items()},
            "allocated": {k: v / steps for k, v in counted.allocated.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--width", type=int, default=bench.WIDTH)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--most", type=int, default=25, help="functions listed per rank")
    parser.add_argument("--dump", default="", help="write each rank's cProfile of `drive` to "
                        "DUMP.rank0, DUMP.rank1")
    parser.add_argument("--no-fuse", action="store_true", help="compile without the fused "
                        "Linear (plain F.linear, weight gradients in B: passes/fuse.py)")
    args = parser.parse_args(argv)
    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    got = launch(_worker, 2, args=(args.schedule, args.width, args.rounds, args.steps,
                                   args.warmup, args.dump, not args.no_fuse), timeout=1800, fault_timeout=120)
    end = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    print(f"{args.schedule}{', unfused' if args.no_fuse else ''}, width {args.width}, "
          f"{args.rounds} rounds of {args.steps} "
          f"minibatches, load {load} -> {end}, per minibatch:")
    print("| rank | CPU in drive (ms) | rounds | CPU in _run_loop (ms) | Python calls in drive "
          "| in _run_loop outside drive | KB copied | KB allocated | all threads' CPU in drive "
          "(ms) |")
    for rank, r in enumerate(got):
        rounds = ", ".join(f"{t * 1e3:.2f}" for t in r["drive_rounds"])
        print(f"| {rank} | {r['drive_cpu'] * 1e3:.2f} | {rounds} | {r['loop_cpu'] * 1e3:.2f} | "
              f"{r['drive_calls']:.0f} | {r['loop_calls']:.0f} | "
              f"{sum(r['copied'].values()) / 1024:.0f} | "
              f"{sum(r['allocated'].values()) / 1024:.0f} | {r['process_cpu'] * 1e3:.2f} |")
    for rank, r in enumerate(got):
        print(f"\nrank {rank}: copied " + ", ".join(
            f"{k} {v / 1024:.0f} KB" for k, v in sorted(r["copied"].items())) + "; allocated "
            + ", ".join(f"{k} {v / 1024:.0f} KB" for k, v in sorted(r["allocated"].items())))
        for name, n in r["most"][:args.most]:
            print(f"  {n:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
