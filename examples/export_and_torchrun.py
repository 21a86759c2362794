"""Compile a model, export it to a folder, and train the folder under torchrun (`pdcompile run`).

    python examples/export_and_torchrun.py            # 2 processes, 32 minibatches
    python examples/export_and_torchrun.py --small    # what the tests run

The exported folder holds everything a worker needs (stage modules and weights, the generated
rank loops, the plan, the loss and optimizer); `pdcompile run DIR --nproc 2 --data FILE:FN`
starts torchrun, whose workers load it and train on the minibatches `FN()` yields. The same
folder runs under a plain torchrun:

    torchrun --nproc-per-node 2 -m pdcompile.worker DIR --data FILE:FN
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch
from torch import nn

import pdcompile

STEPS_ENV = "EXAMPLE_STEPS"  # read by `batches` in the worker processes


def make_model() -> nn.Module:
    """A small MLP classifier."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))


def batches() -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """The training stream (the same in every worker: a fixed seed). Class = sign of x0 + x1."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(int(os.environ.get(STEPS_ENV, "32"))):
        x = torch.randn(16, 16, generator=gen)
        yield (x,), (x[:, 0] + x[:, 1] > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few minibatches (tests)")
    parser.add_argument("--out", default=None, help="export folder (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = 8 if args.small else 32

    (x,), _ = next(batches())
    # The export records the loss function by import path (torch's, a functools.partial of
    # one, a function of an importable module; not a lambda or a function of this __main__)
    # and the optimizer by its class and hyper-parameters (a lambda making it is fine).
    pipe = pdcompile.compile(make_model(), example_inputs=(x,), stages=2,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or os.path.join(tmp, "mlp-2stages")
        pipe.export(folder)
        print(pipe.summary())
        command = [sys.executable, "-m", "pdcompile", "run", folder, "--nproc", "2",
                   "--steps", str(steps), "--threads", "1",
                   "--data", f"{os.path.abspath(__file__)}:batches"]
        print("\n$ " + " ".join(command[1:]).replace("-m pdcompile", "pdcompile", 1))
        env = dict(os.environ, **{STEPS_ENV: str(steps)})
        done = subprocess.run(command, env=env, timeout=600, check=False)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
