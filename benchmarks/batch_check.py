"""What compile's batch check costs (passes/batch_check.py): the model in eval mode on the
example minibatch and on its two halves along dimension 0, beside the whole compile.

    python benchmarks/batch_check.py [--rounds 3] [--batch 8] [--size 224]

Writes benchmarks/results/batch-check.md. Models: torchvision's ResNet-50 and VGG-16 (random
weights), compiled as 2 stages of '1f1b-flush' with 2 microbatches (measured costs), which
runs the check; the check alone is timed `--rounds` times on the compiled pipeline's model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

import pdcompile
from pdcompile.passes.batch_check import check_samples_apart

OUT = Path(__file__).resolve().parent / "results" / "batch-check.md"


def measure(name: str, batch: int, size: int, rounds: int) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    x = torch.randn(batch, 3, size, size)
    start = time.perf_counter()
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=F.cross_entropy,
                             schedule="1f1b-flush", microbatches=2, stages=2)
    whole = time.perf_counter() - start
    named = pipe._named((x,))
    checks = []
    for _ in range(rounds):
        start = time.perf_counter()
        check_samples_apart(model, named, lambda values: model(values["x"]), pipe.whole_inputs)
        checks.append(time.perf_counter() - start)
    return whole, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = datetime.datetime.now(datetime.UTC)
    rows = []
    for name in ("resnet50", "vgg16"):
        whole, checks = measure(name, args.batch, args.size, args.rounds)
        check = statistics.median(checks)
        rows.append(f"| {name} | {whole:.1f} s | {check:.2f} s | {100 * check / whole:.0f}% | "
                    f"{', '.join(f'{c:.2f}' for c in checks)} |")
        print(rows[-1], flush=True)
    ended = datetime.datetime.now(datetime.UTC)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    OUT.write_text(
        "# The batch check's cost at compile\n\n" + textwrap.fill(
        f"`python benchmarks/batch_check.py --rounds {args.rounds} --batch {args.batch} "
        f"--size {args.size}`, {began:%Y-%m-%d %H:%M}-{ended:%H:%M} UTC, one thread, load "
        f"{load} (other jobs on the 2-core VM). torchvision models with random weights at batch "
        f"{args.batch} of {args.size}x{args.size}, compiled as 2 stages of '1f1b-flush' with 2 "
        "microbatches (measured costs): the compile runs the check once (3 eval-mode "
        "forwards: the whole example, then its two halves along dimension 0; more only "
        "where their rows differ). The check is then timed alone.", 96) + "\n\n"
        "| model | compile (check included) | check (median) | share | rounds (s) |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
