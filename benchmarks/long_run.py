"""Long runs stay flat: worker memory (RSS) and steps/s at the start and the end of a long run.

A tiny model (Linear(16, 16) + ReLU | Linear(16, 4), minibatch 8, SGD) exported for 2 stages
trains `--steps` minibatches on 2 gloo processes (`run_distributed` through
`backends/launch.launch`, as `train_processes` starts them) from an endless generator of fresh
minibatches, per schedule, without and with checkpoints. Each rank samples its RSS
(/proc/self/statm) and the time as minibatches go: rank 0 (stage 0) as it reads them from the
data, rank 1 (the last stage) as their losses become known. The table shows, per rank, the RSS
after the first tenth of the run (warm-up over: the first windows read, buffers allocated) and at
the end, and the steps/s of the first and the last tenth (on rank 1's clock). Issue 25's target:
RSS growth under 50 MB, the last tenth's throughput within 10% of the first's.

    python benchmarks/long_run.py [--steps 30000] [--only 1f1b,1f1b-flush] [--md FILE]

`--drain` measures instead what draining an asynchronous run every K minibatches (checkpoints,
the stream's window) changes: the losses of the same stream trained as one run and as runs of K
(local backend, `Pipeline.train` per run), their largest and mean difference.
"""

from __future__ import annotations

import argparse
import functools
import itertools
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


def export(folder: Path, schedule: str) -> Path:
    """The tiny model, compiled for 2 stages under `schedule`, exported to `folder`."""
    import pdcompile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))
    x, y = next(endless())
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    pipe.export(str(folder))
    return folder


def _worker(worker: Any, export_dir: str, steps: int, every: int | None,
            checkpoint_dir: str | None, sample: int) -> list[tuple[int, float, float]]:
    """One rank: train, sampling (minibatch, time, RSS) every `sample` minibatches."""
    from pdcompile.backends.distributed import reads_data, run_distributed
    from pdcompile.export.read import load_pipeline

    torch.set_num_threads(1)
    program = load_pipeline(export_dir).program()
    samples: list[tuple[int, float, float]] = []

    def probed(stream: Iterator[Any]) -> Iterator[Any]:
        for index, item in enumerate(stream):
            if index % sample == 0:
                samples.append((index, time.perf_counter(), rss_mb()))
            yield item

    def progress(step: int, loss: float) -> None:
        if step % sample == 0 or step == steps - 1:
            samples.append((step, time.perf_counter(), rss_mb()))

    reads = reads_data(program, worker.rank)
    run_distributed(program, probed(endless()) if reads else None, steps=steps,
                    checkpoint_dir=checkpoint_dir, checkpoint_every=every,
                    monitor=worker.monitor, progress=None if reads else progress)
    samples.append((steps, time.perf_counter(), rss_mb()))
    return samples


def _rate(samples: list[tuple[int, float, float]], lo: int, hi: int) -> float:
    """Steps/s between the samples nearest minibatches `lo` and `hi`."""
    a = min(samples, key=lambda s: abs(s[0] - lo))
    b = min(samples, key=lambda s: abs(s[0] - hi))
    return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else float("nan")


def _rss_at(samples: list[tuple[int, float, float]], step: int) -> float:
    return min(samples, key=lambda s: abs(s[0] - step))[2]


def long_runs(steps: int, schedules: list[str], every: int) -> list[dict[str, Any]]:
    """One row per (schedule, checkpoints): RSS and steps/s at the start and the end."""
    from pdcompile.backends.launch import launch

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="pdcompile-long-run-"))
    try:
        for schedule in schedules:
            folder = export(tmp / schedule, schedule)
            for ckpt in (False, True):
                ckpt_dir = str(tmp / f"{schedule}-ckpt") if ckpt else None
                load = os.getloadavg()[0]
                start = time.perf_counter()
                values = launch(_worker, 2, args=(str(folder), steps, every if ckpt else None,
                                                  ckpt_dir, max(1, steps // 200)),
                                timeout=3600)
                wall = time.perf_counter() - start
                tenth = steps // 10
                row: dict[str, Any] = {
                    "schedule": schedule, "checkpoints": f"every {every}" if ckpt else "none",
                    "steps": steps, "wall": wall, "load": (load, os.getloadavg()[0]),
                    "first": _rate(values[1], 0, tenth),
                    "last": _rate(values[1], steps - tenth, steps - 1)}
                for rank in (0, 1):
                    row[f"rss{rank}"] = (_rss_at(values[rank], tenth),
                                         _rss_at(values[rank], steps))
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
            f"{row['wall']:.0f} | {row['load'][0]:.1f} / {row['load'][1]:.1f} |")


HEAD = ("| schedule | checkpoints | steps | rank 0 RSS MB (tenth -> end) | rank 1 RSS MB "
        "(tenth -> end) | steps/s (first -> last tenth) | wall s | load avg (start / end) |\n"
        "|---|---|---|---|---|---|---|---|")


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
    parser.add_argument("--drain", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.drain:
        result = drain_effect(args.steps, args.every)
        print(result)
        return 0
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}")
    print(HEAD)
    rows = long_runs(args.steps, args.only.split(","), args.every)
    if args.md:
        Path(args.md).write_text(HEAD + "\n" + "\n".join(_line(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
