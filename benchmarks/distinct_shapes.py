"""Memory of the local backend over minibatches of many distinct shapes.

`Pipeline.train` of a tiny model (Linear(16, 16) + ReLU | Linear(16, 4) on (batch, length, 16),
mse_loss, 2 stages, async 1F1B) over `--minibatches` minibatches in runs of `--run` (one
`train` call each), every minibatch a shape not seen before (batch 2, 4, ... and length 1 to 64:
sizes grow along the run) or, with `--same`, all of one shape (64 x 32). After each run: RSS and
glibc malloc's bytes in use, after gc and malloc_trim(0) unless `--no-trim`. malloc's bytes in use
are what the process holds; RSS above them is free memory the allocator keeps.

    python benchmarks/distinct_shapes.py [--minibatches 4500] [--run 500] [--same] [--no-trim]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from long_run import malloc_in_use_mb, rss_mb  # noqa: E402  (beside this file)


def shape(index: int, same: bool) -> tuple[int, int]:
    """Minibatch `index`'s (batch, length): all distinct (4,096 before they repeat) or one."""
    return (64, 32) if same else (2 * (1 + index // 64), 1 + index % 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minibatches", type=int, default=4500)
    parser.add_argument("--run", type=int, default=500)
    parser.add_argument("--same", action="store_true")
    parser.add_argument("--no-trim", action="store_true")
    args = parser.parse_args()
    import pdcompile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 3, 16),),
                             example_target=torch.randn(8, 3, 4),
                             loss_fn=nn.functional.mse_loss, cost="analytic",
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                             stages=[1, 1], microbatches=2, schedule="1f1b")

    def data(lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(b, n, 16), torch.randn(b, n, 4))
                for b, n in (shape(i, args.same) for i in range(lo, hi))]

    def measure() -> tuple[float, float]:
        gc.collect()
        in_use = malloc_in_use_mb(trim=not args.no_trim)
        return rss_mb(), in_use

    pipe.train(data(0, args.run))  # the first run: warm-up
    rss0, use0 = measure()
    print(f"after {args.run} minibatches (warm-up): RSS {rss0:.1f} MB, malloc in use "
          f"{use0:.1f} MB; load {os.getloadavg()[0]:.1f}")
    for lo in range(args.run, args.minibatches, args.run):
        pipe.train(data(lo, lo + args.run))
        rss, use = measure()
        print(f"after {lo + args.run} minibatches: RSS {rss:.1f} MB ({rss - rss0:+.1f}), "
              f"malloc in use {use:.1f} MB ({use - use0:+.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
