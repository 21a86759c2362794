"""Long runs stay flat: worker memory (RSS) and steps/s at the start and the end of a long run.

A tiny model (Linear(16, 16) + ReLU | Linear(16, 4), minibatch 8, SGD) exported for 2 stages
(schedules with chunks: 3 x (Linear(16, 16) + ReLU) + Linear(16, 4), 2 workers x 2 chunks,
4 microbatches) trains `--steps` minibatches on 2 gloo processes (`run_distributed` through
`backends/launch.launch`, as `train_processes` starts them) from an endless generator of fresh
minibatches, per schedule, without and with checkpoints. Each rank samples its RSS
(/proc/self/statm) and the time as minibatches go: the rank of the last stage as their losses
become known (rank 1; rank 0 where the chunks sit in a V), rank 0 otherwise as it reads them from
the data, a rank doing neither (rank 1 of a V) by the clock. The table shows, per rank, the RSS
after the first tenth of the run (warm-up over: the first windows read, buffers allocated) and at
the end, and the steps/s of the second and the last tenth (the first holds the start-up), on
the last stage's wall clock and, per rank, per second of the process's CPU time (which the other
jobs of a shared machine do not inflate). Issue 25's target:
RSS growth under 50 MB, the last tenth's throughput within 10% of the first's.

    python benchmarks/long_run.py [--steps 30000] [--only 1f1b,1f1b-flush] [--md FILE]
                                  [--training autocast,clip] [--samples FILE.json]

`--malloc` (a diagnostic: it changes what it measures) calls glibc's malloc_trim(0) at every
sample and adds malloc's bytes in use (mallinfo2) to each sample: RSS that grows while malloc's
bytes in use stay flat is memory the allocator keeps, not memory the program holds.

`--local` measures `Pipeline.train` (the local backend, one process) on the same stream instead.
`--drain` measures instead what draining an asynchronous run every K minibatches (checkpoints,
the stream's window) changes: the losses of the same stream trained as one run and as runs of K
(local backend, `Pipeline.train` per run), their largest and mean difference.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH, CLASSES, BATCH = 16, 4, 8
PAGE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_in_use_mb(trim: bool = True) -> float:
    """glibc malloc's bytes in use (heap and mmapped blocks) in MB, after malloc_trim(0)
    (`trim`) has handed free pages back; NaN outside glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return float("nan")
    if trim:
        libc.malloc_trim(0)
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 1e6


def rss_mb() -> float:
    """This process's resident memory in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def endless(seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh minibatches forever (a data loader that never ends)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield (torch.randn(BATCH, WIDTH, generator=gen),
               torch.randint(0, CLASSES, (BATCH,), generator=gen))


def export(folder: Path, schedule: str, training: tuple[str, ...] = ()) -> Path:
    """The tiny model, compiled for 2 stages under `schedule`, exported to `folder`;
    `training`: "autocast" (bfloat16 forwards), "clip" (clip_grad_norm=1.0, flush schedules)."""
    import pdcompile
    from pdcompile.schedule.kinds import kind

    torch.manual_seed(0)
    chunked = kind(schedule).interleaved  # 2 chunks per worker: 4 layers, 4 microbatches
    hidden = [layer for _ in range(3 if chunked else 1)
              for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    model = nn.Sequential(*hidden, nn.Linear(WIDTH, CLASSES))
    x, y = next(endless())
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                             schedule=schedule, microbatches=4 if chunked else 2,
                             stages=2 if chunked else [1, 1],
                             autocast=torch.bfloat16 if "autocast" in training else None,
                             clip_grad_norm=1.0 if "clip" in training else None)
    pipe.export(str(folder))
    return folder


# minibatch, wall time, RSS MB, process CPU time (and with --malloc: malloc's MB in use)
Sample = tuple[float, ...]
MALLOC_ENV = "PDCOMPILE_LONG_RUN_MALLOC"  # --malloc, as the worker processes see it


def _probe(step: int) -> Sample:
    if os.environ.get(MALLOC_ENV):
        in_use = malloc_in_use_mb()  # trims first: the RSS read after it is what is held
        return step, time.perf_counter(), rss_mb(), time.process_time(), in_use
    return step, time.perf_counter(), rss_mb(), time.process_time()


def _worker(worker: Any, export_dir: str, steps: int, every: int | None,
            checkpoint_dir: str | None, sample: int) -> tuple[str, list[Sample]]:
    """One rank: train, sampling (minibatch, time, RSS, CPU time) every `sample` minibatches:
    as losses become known on the rank that reports them ("losses"), else as the rank reads
    minibatches ("reads"), else (a middle rank of a V) every 20 ms by the clock, minibatch -1
    ("clock": `_on_steps` places them by the reporting rank's samples)."""
    import threading

    from pdcompile.backends.distributed import reads_data, run_distributed
    from pdcompile.export.read import load_pipeline

    torch.set_num_threads(1)
    program = load_pipeline(export_dir).program()
    samples: list[Sample] = []

    def probed(stream: Iterator[Any]) -> Iterator[Any]:
        for index, item in enumerate(stream):
            if index % sample == 0:
                samples.append(_probe(index))
            yield item

    def progress(step: int, loss: float) -> None:
        if step % sample == 0 or step == steps - 1:
            samples.append(_probe(step))

    reads = reads_data(program, worker.rank)
    reports = program.plan.stages[-1].ranks[0] == worker.rank
    role = "losses" if reports else "reads" if reads else "clock"
    done = threading.Event()

    def by_clock() -> None:
        while not done.wait(0.02):
            samples.append(_probe(-1))

    clock = threading.Thread(target=by_clock, daemon=True)
    if role == "clock":
        clock.start()
    try:
        stream = (endless() if reports else probed(endless())) if reads else None
        run_distributed(program, stream, steps=steps, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=every, monitor=worker.monitor,
                        progress=progress if reports else None)
    finally:
        done.set()
    samples.append(_probe(steps))
    return role, samples


def _on_steps(samples: list[Sample], reporter: list[Sample]) -> list[Sample]:
    """A clock-sampled rank's samples with the minibatch the reporting rank had reached at
    each one's time (perf_counter is one clock for every process of the machine)."""
    import numpy as np

    times = np.array([s[1] for s in reporter])
    reached = np.array([s[0] for s in reporter], dtype=float)
    return [(s[0] if s[0] >= 0 else int(np.interp(s[1], times, reached)), *s[1:])
            for s in samples]


def _rate(samples: list[Sample], lo: int, hi: int, clock: int = 1) -> float:
    """Steps per second between the samples nearest minibatches `lo` and `hi` (`clock` 1: wall
    time; 3: the process's CPU time, which other jobs on the machine do not inflate)."""
    a = min(samples, key=lambda s: abs(s[0] - lo))
    b = min(samples, key=lambda s: abs(s[0] - hi))
    return (b[0] - a[0]) / (b[clock] - a[clock]) if b[clock] > a[clock] else float("nan")


def _rss_at(samples: list[Sample], step: int) -> float:
    return min(samples, key=lambda s: abs(s[0] - step))[2]


def long_runs(steps: int, schedules: list[str], every: int,
              variants: tuple[bool, ...] = (False, True),
              training: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per (schedule, checkpoints): RSS and steps/s at the start and the end."""
    from pdcompile.backends.launch import launch

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="pdcompile-long-run-"))
    try:
        for schedule in schedules:
            folder = export(tmp / schedule, schedule, training)
            for ckpt in variants:
                ckpt_dir = str(tmp / f"{schedule}-ckpt") if ckpt else None
                load = os.getloadavg()[0]
                start = time.perf_counter()
                values = launch(_worker, 2, args=(str(folder), steps, every if ckpt else None,
                                                  ckpt_dir, max(1, steps // 200)),
                                timeout=3600)
                wall = time.perf_counter() - start
                roles = [role for role, _ in values]
                reporter = values[roles.index("losses")][1]
                values = [_on_steps(samples, reporter) for _, samples in values]
                tenth = steps // 10
                row: dict[str, Any] = {
                    "schedule": " + ".join((schedule, *training)),
                    "checkpoints": f"every {every}" if ckpt else "none",
                    "steps": steps, "wall": wall, "load": (load, os.getloadavg()[0]),
                    "first": _rate(reporter, tenth, 2 * tenth),
                    "last": _rate(reporter, steps - tenth, steps - 1),
                    "cpu": [(_rate(values[r], tenth, 2 * tenth, 3),
                             _rate(values[r], steps - tenth, steps, 3)) for r in (0, 1)]}
                for rank in (0, 1):
                    row[f"rss{rank}"] = (_rss_at(values[rank], tenth),
                                         _rss_at(values[rank], steps))
                row["samples"] = values
                rows.append(row)
                print(_line(row), flush=True)
                if ckpt_dir:
                    shutil.rmtree(ckpt_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    r0, r1 = row["rss0"], row["rss1"]
    return (f"| {row['schedule']} | {row['checkpoints']} | {row['steps']} | "
            f"{r0[0]:.0f} -> {r0[1]:.0f} ({r0[1] - r0[0]:+.1f}) | "
            f"{r1[0]:.0f} -> {r1[1]:.0f} ({r1[1] - r1[0]:+.1f}) | "
            f"{row['first']:.0f} -> {row['last']:.0f} ({row['last'] / row['first'] - 1:+.1%}) | "
            + " | ".join(f"{a:.0f} -> {b:.0f} ({b / a - 1:+.1%})" for a, b in row["cpu"])
            + f" | {row['wall']:.0f} | {row['load'][0]:.1f} / {row['load'][1]:.1f} |")


HEAD = ("| schedule | checkpoints | steps | rank 0 RSS MB (tenth -> end) | rank 1 RSS MB "
        "(tenth -> end) | steps/s wall (2nd -> last tenth) | rank 0 steps per CPU s (2nd -> "
        "last tenth) | rank 1 steps per CPU s | wall s | load avg (start / end) |\n"
        "|---|---|---|---|---|---|---|---|---|---|")


def local_run(steps: int, schedule: str) -> dict[str, Any]:
    """`Pipeline.train` (the local backend) on the endless stream: RSS and steps/s."""
    import pdcompile

    tmp = Path(tempfile.mkdtemp(prefix="pdcompile-long-local-"))
    try:
        pipe = pdcompile.load(str(export(tmp / schedule, schedule)))
        samples: list[Sample] = []
        every = max(1, steps // 200)

        def probed() -> Iterator[Any]:
            for index, item in enumerate(endless()):
                if index % every == 0:
                    samples.append(_probe(index))
                yield item

        load = os.getloadavg()[0]
        start = time.perf_counter()
        pipe.train(probed(), steps=steps)
        wall = time.perf_counter() - start
        samples.append(_probe(steps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tenth = steps // 10
    return {"schedule": schedule, "steps": steps, "wall": wall,
            "load": (load, os.getloadavg()[0]), "rss": (_rss_at(samples, tenth),
                                                        _rss_at(samples, steps)),
            "first": _rate(samples, tenth, 2 * tenth),
            "last": _rate(samples, steps - tenth, steps),
            "cpu": (_rate(samples, tenth, 2 * tenth, 3), _rate(samples, steps - tenth, steps, 3))}


def drain_effect(steps: int, every: int) -> dict[str, float]:
    """Losses of one asynchronous run against runs of `every` (drained in between)."""
    import pdcompile
    from pdcompile.runtime import stream_window

    tmp = Path(tempfile.mkdtemp(prefix="pdcompile-drain-"))
    try:
        folder = export(tmp / "1f1b", "1f1b")
        data = list(itertools.islice(endless(), steps))
        whole = pdcompile.load(str(folder))
        saved, stream_window.WINDOW = stream_window.WINDOW, steps  # one run: no window
        try:
            one = whole.train(data)
        finally:
            stream_window.WINDOW = saved
        cut = pdcompile.load(str(folder))
        parts = [loss for k in range(0, steps, every) for loss in cut.train(data[k:k + every])]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    diffs = [abs(a - b) for a, b in zip(one, parts, strict=True)]
    first = next((i for i, d in enumerate(diffs) if d > 0), None)
    return {"steps": steps, "every": every, "max": max(diffs), "mean": sum(diffs) / len(diffs),
            "first_differs": -1 if first is None else first,
            "final_one": sum(one[-100:]) / len(one[-100:]),
            "final_cut": sum(parts[-100:]) / len(parts[-100:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--every", type=int, default=1000, help="checkpoint interval")
    parser.add_argument("--only", default="1f1b,1f1b-flush")
    parser.add_argument("--md", default=None, help="also write the table to this file")
    parser.add_argument("--samples", default=None,
                        help="also write every rank's samples (minibatch, time, RSS MB, CPU "
                        "s) per row to this JSON file, to see how the memory went")
    parser.add_argument("--checkpoints", default="none,every",
                        help="none: without checkpoints; every: with one every --every")
    parser.add_argument("--training", default="",
                        help="compile options to run with: autocast, clip (comma-separated)")
    parser.add_argument("--drain", action="store_true")
    parser.add_argument("--malloc", action="store_true",
                        help="malloc_trim(0) at every sample, and malloc's bytes in use added "
                        "to the samples (a diagnostic)")
    parser.add_argument("--local", action="store_true",
                        help="Pipeline.train in this process instead (the local backend)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.malloc:
        os.environ[MALLOC_ENV] = "1"  # the spawned workers inherit it
    if args.drain:
        result = drain_effect(args.steps, args.every)
        print(result)
        return 0
    if args.local:
        for schedule in args.only.split(","):
            row = local_run(args.steps, schedule)
            r = row["rss"]
            print(f"| {schedule} (local, Pipeline.train) | {row['steps']} | {r[0]:.0f} -> "
                  f"{r[1]:.0f} ({r[1] - r[0]:+.1f}) | {row['first']:.0f} -> {row['last']:.0f} "
                  f"({row['last'] / row['first'] - 1:+.1%}) | {row['cpu'][0]:.0f} -> "
                  f"{row['cpu'][1]:.0f} ({row['cpu'][1] / row['cpu'][0] - 1:+.1%}) | "
                  f"{row['wall']:.0f} | "
                  f"{row['load'][0]:.1f} / {row['load'][1]:.1f} |", flush=True)
        return 0
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}")
    print(HEAD)
    variants = tuple(v == "every" for v in args.checkpoints.split(","))
    training = tuple(t for t in args.training.split(",") if t)
    rows = long_runs(args.steps, args.only.split(","), args.every, variants, training)
    if args.md:
        Path(args.md).write_text(HEAD + "\n" + "\n".join(_line(r) for r in rows) + "\n")
    if args.samples:
        Path(args.samples).write_text(json.dumps(
            [{"schedule": r["schedule"], "checkpoints": r["checkpoints"],
              "samples": r["samples"]} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
