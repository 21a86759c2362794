"""What loading a checkpoint from the bytes its manifest was checked against costs.

`Checkpointer.load` once hashed the file (in 1 MB chunks), then opened it again and read it
through safetensors' memory map: the file read twice, and a file swapped in between loaded
unchecked. It now reads the file once, front to back, each tensor's bytes straight into its own
memory, hashing every chunk as it lands, and uses the value only once the hash matches. This
measures both side by side on one checkpoint of about `--mib` MiB (the weights, and SGD momentum
of the same size, of Linear(1024, 1024) layers), interleaved, `--repeats` times each, each in a
fresh process (so that its peak resident memory is its own):

    check, then reopen   Checkpointer.verify, then tensor_tree.load_tree (the old load)
    read once            Checkpointer.load

and prints a Markdown table (median seconds, peak RSS). The file is in the page cache (just
written), as at a resume right after a crash.

    python benchmarks/checkpoint_load.py [--mib 256] [--repeats 5] [--md FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from pdcompile.runtime.checkpoint import Checkpointer, module_state

_VARIANTS = ("check, then reopen", "read once")


def build(folder: Path, mib: float) -> int:
    """A checkpoint of rank 0 at step 1 of about `mib` MiB; its size in bytes."""
    layers = max(1, round(mib * 2 ** 20 / (2 * 1024 * 1024 * 4)))
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return Checkpointer(folder, rank=0, every=1).save(1, module_state(model, opt)).stat().st_size


def measure(folder: Path, variant: str) -> dict[str, float]:
    """One load in this process: seconds and peak RSS (MiB)."""
    import resource

    from pdcompile.runtime.tensor_tree import load_tree

    ckpt = Checkpointer(folder, rank=0, every=1)
    start = time.perf_counter()
    if variant == _VARIANTS[0]:
        ckpt.verify(1)
        state = load_tree(ckpt.rank_dir() / "step_00000001.safetensors")
    else:
        state = ckpt.load(1)
    seconds = time.perf_counter() - start
    assert state["model"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "rss_mib": peak}


def load_table(what: str, files: str, repeats: int, load: tuple[float, float, float],
               found: dict[str, list[dict[str, float]]], versus: str) -> str:
    """The Markdown table of `found` (per variant, in order: each load's seconds and peak RSS):
    medians, and seconds against the first variant's (`versus`, as the heading names it)."""
    rows = [f"{what}, {repeats} loads of each, interleaved, each in a fresh process, median; "
            f"{files} in the page cache; load average at the start {load[0]:.1f} / "
            f"{load[1]:.1f} / {load[2]:.1f}, at the end "
            f"{' / '.join(f'{v:.1f}' for v in os.getloadavg())}.", "",
            f"| load | seconds | peak RSS (MiB) | seconds vs {versus} |", "|---|---|---|---|"]
    base = statistics.median(r["seconds"] for r in next(iter(found.values())))
    for variant, runs in found.items():
        secs = statistics.median(r["seconds"] for r in runs)
        rss = statistics.median(r["rss_mib"] for r in runs)
        rows.append(f"| {variant} | {secs:.3f} | {rss:.0f} | {secs / base:.2f}x |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(measure(Path(args.one[0]), args.one[1])))
        return 0
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        size = build(Path(tmp), args.mib)
        found: dict[str, list[dict[str, float]]] = {v: [] for v in _VARIANTS}
        for _ in range(args.repeats):
            for variant in _VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--one", tmp, variant],
                                     capture_output=True, text=True, check=True, timeout=600)
                found[variant].append(json.loads(out.stdout))
    text = load_table(f"Checkpoint of {size / 2 ** 20:.0f} MiB ({size:,} bytes)", "file",
                      args.repeats, load, found, "the old load")
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
