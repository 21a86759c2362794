"""Compile a model into a pipeline and train it on the local backend (one process, all ranks).

    python examples/train_local.py            # 2-stage pipeline, 64 minibatches
    python examples/train_local.py --small    # what the tests run

The local backend runs every rank's generated 1F1B loop in this process in a fixed order: the
reference semantics the distributed backend reproduces. Here the planner is skipped with
`stages=2` (an even cut); pass a cluster such as "local-2" instead to let it partition.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pdcompile


def make_model() -> nn.Module:
    """A small MLP classifier."""
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def batches(steps: int, batch_size: int = 32) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """A learnable task: the class is the quadrant of the first two features."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, 32, generator=gen)
        y = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        out.append(((x,), y))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few minibatches (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = 8 if args.small else 64

    data = batches(steps)
    pipe = pdcompile.compile(
        make_model(), example_inputs=data[0][0], stages=2,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    print(pipe.summary())
    losses = pipe.train(data)  # minibatches overlap in the pipeline (1F1B, weight stashing)
    print(f"trained {len(losses)} minibatches: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    x, _ = data[0]
    print("pipeline output shape:", tuple(pipe(*x).shape))


if __name__ == "__main__":
    main()
