"""A user model with a module torch.fx cannot trace, kept whole as a leaf module.

    python examples/custom_leaf.py            # compile for local-2 and train 32 minibatches
    python examples/custom_leaf.py --small    # what the tests run

`GatedMixer.forward` branches on a tensor's value (`if gate.mean() > 0`), which symbolic tracing
cannot follow. Compiling without help fails with a message naming the module and the fix;
`leaf_modules=[GatedMixer]` makes each instance one opaque node in the graph that runs its
Python code as is. The planner then places whole mixers in stages like any other layer.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pdcompile


class GatedMixer(nn.Module):
    """Mixes features through one of two paths, chosen by the data (not traceable by fx)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 1)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        if gate.mean() > 0:  # data-dependent control flow
            return x + torch.tanh(self.up(x)) * torch.sigmoid(gate)
        return x + torch.relu(self.down(x))


class Net(nn.Module):
    """An input layer, four mixers, a classifier."""

    def __init__(self, width: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.Sequential(*(GatedMixer(width) for _ in range(4)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.embed(x))))


def batches(steps: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Three classes by the sign pattern of two features."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        out.append(((x,), (x[:, 0] > 0).long() + (x[:, 1] > 0).long()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few minibatches (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = batches(8 if args.small else 32)

    try:
        pdcompile.compile(Net(), "local-2", example_inputs=data[0][0])
    except pdcompile.PdcompileError as err:
        print(f"without a leaf: {err}\n")

    pipe = pdcompile.compile(Net(), "local-2", example_inputs=data[0][0],
                             leaf_modules=[GatedMixer], loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda params: torch.optim.Adam(params, lr=3e-3))
    print(pipe.summary())
    mixers = [n.name for n in pipe.graph.graph.nodes
              if n.op == "call_module" and isinstance(pipe.graph.get_submodule(n.target),
                                                      GatedMixer)]
    print(f"\nleaf nodes: {', '.join(mixers)}")
    losses = pipe.train(data)
    print(f"trained {len(losses)} minibatches: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
