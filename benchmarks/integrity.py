"""What verifying an export costs: SHA-256 of every file against its manifest, on a 1 GB export.

Builds an MLP whose weights take about `--gib` GiB (float32 Linear(4096, 4096) layers, two
stages), exports it, then measures side by side, `--repeats` times each, interleaved:

    verify   export/checked.checked_export (`pdcompile verify`: every file read once, hashed
             against MANIFEST.json and parsed as the loader parses it, tensors not kept)
    load     pdcompile.load (which reads every file once, checked, then rebuilds the stages)
    seal     export/integrity.seal_export (what writing the manifest adds to an export)

and prints a Markdown table (median seconds, GB/s, verify's share of load). The files are in
the page cache (just written), as when a run loads an export it has just copied or exported;
a cold read from disk costs the disk's time on top, for the load as for the verification.

    python benchmarks/integrity.py [--gib 1.0] [--repeats 3] [--md FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pdcompile
from pdcompile.export.checked import checked_export
from pdcompile.export.integrity import seal_export


def build(folder: Path, gib: float) -> int:
    """Export a two-stage MLP of about `gib` GiB of weights; its size on disk in bytes."""
    torch.manual_seed(0)
    layers = max(2, round(gib * 2 ** 30 / (4096 * 4096 * 4)))
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(layers)])
    x = torch.randn(8, 4096)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=torch.randn(8, 4096),
                             loss_fn=nn.functional.mse_loss, stages=[1, 1],
                             schedule="1f1b-flush", microbatches=2,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    pipe.export(str(folder))
    del pipe, model
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="pdcompile-integrity-")) / "export"
    try:
        size = build(folder, args.gib)
        times: dict[str, list[float]] = {"verify": [], "load": [], "seal": []}
        for _ in range(args.repeats):
            times["verify"].append(timed(lambda: checked_export(folder)))
            times["load"].append(timed(lambda: pdcompile.load(str(folder))))
            times["seal"].append(timed(lambda: seal_export(folder)))
        median = {k: statistics.median(v) for k, v in times.items()}
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    load = os.getloadavg()
    lines = [
        f"Export of {size / 2 ** 30:.2f} GiB ({size:,} bytes, {len(times)} measurements x "
        f"{args.repeats}, median), files in the page cache; load average at the start of the "
        f"table {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.",
        "",
        "| step | seconds | GB/s | share of `pdcompile.load` |",
        "|---|---|---|---|",
    ]
    for name in ("verify", "seal", "load"):
        rate = size / median[name] / 1e9
        share = median[name] / median["load"]
        lines.append(f"| {name} | {median[name]:.2f} | {rate:.2f} | {share:.0%} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
