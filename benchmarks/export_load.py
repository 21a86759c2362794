"""What loading an export from the bytes its manifest was checked against costs.

`pdcompile.load` once hashed every file of the export against MANIFEST.json, then opened them
again to load them (the weights through safetensors' memory map, then copied into fresh memory;
optimizer states, examples and the user's model file read again): every file read twice, and a
file swapped in between loaded unchecked. It now reads every file once, front to back, each
tensor's bytes straight into its own memory, hashing every chunk as it lands
(export/verified_files.py, with the reader checkpoints use). This measures both side by side on
one export of about `--mib` MiB (two stages of Linear(1024, 1024) layers, with SGD momentum of
the same size), interleaved, `--repeats` times each, each load in a fresh process:

    before   pdcompile.load of the package at `--old` (a checkout of the commit before)
    now      pdcompile.load of this package

and prints a Markdown table (median seconds of the whole load, torch._dynamo imported before
the clock starts, peak RSS). The files are in the
page cache (just written), as when a worker loads an export another just wrote.

    python benchmarks/export_load.py --old /path/to/old/checkout [--mib 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from checkpoint_load import load_table  # beside this file (its table, the same columns)

HERE = Path(__file__).resolve().parent.parent


def build(folder: Path, mib: float) -> int:
    """An export of about `mib` MiB in `folder`; its size in bytes."""
    import pdcompile

    layers = max(2, round(mib * 2 ** 20 / (2 * 1024 * 1024 * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    x, y = torch.randn(4, 1024), torch.randn(4, 1024)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, cost="analytic",
                             stages=[1, 1], microbatches=2,
                             optimizer=partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    pipe.step(x, target=y)  # momentum buffers: the optimizer files as large as the weights
    pipe.export(str(folder))
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(folder: Path) -> dict[str, float]:
    """One load in this process: seconds and peak RSS (MiB)."""
    import resource

    import torch._dynamo  # noqa: F401  (imported by any optimizer's first use: 1-2 s, not timed)

    import pdcompile

    start = time.perf_counter()
    pipe = pdcompile.load(str(folder))
    seconds = time.perf_counter() - start
    assert pipe.states()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "rss_mib": peak}


def _one(package: Path, folder: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(package), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--one", str(folder)], capture_output=True,
                         text=True, check=True, timeout=600, env=env, cwd=package)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="a checkout of the package before")
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    if args.old is None:
        parser.error("--old: a checkout of the package to compare with")
    variants = {"before": args.old.resolve(), "now": HERE}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        size = build(folder, args.mib)
        found: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant, package in variants.items():
                found[variant].append(_one(package, folder))
    text = load_table(f"Export of {size / 2 ** 20:.0f} MiB ({size:,} bytes)", "files",
                      args.repeats, load, found, "before")
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
