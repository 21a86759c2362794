"""A stage's own random stream on a worker (`StageRandom`): what its forwards draw from.

Every worker of a distributed run seeds torch with the same seed, so that readers of the
user's data draw the same minibatches. Drawn from that shared stream, a dropout of stage 1
would draw the very masks a dropout of the same shape on stage 0 drew (the two layers would
drop the same units, as no single process does), and replicas would drop the same units of
different samples. Each (rank, stage) therefore draws its model's random numbers from a stream
of its own, seeded from the run's seed and its place, swapped in around its forwards: the data
keeps the shared stream, runs stay reproducible, and the streams are independent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_SPREAD = 1_000_003  # a prime: distinct (rank, stage) pairs get distinct seeds


class StageRandom:
    """The CPU (and CUDA) random states of one stage on one worker between its forwards."""

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor]) -> None:
        self.cpu = cpu
        self.cuda = cuda

    @classmethod
    def seeded(cls, rank: int, stage: int) -> StageRandom:
        """The stream of `stage` on `rank`, from the seed this process was seeded with."""
        seed = (torch.initial_seed() * _SPREAD + 1 + rank * 4099 + stage) % 2**63
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = []
        if torch.cuda.is_initialized():
            cuda = [torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state()
                    for i in range(torch.cuda.device_count())]
        return cls(cpu, cuda)

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Within the block the process draws from this stream; after it, from where the
        shared stream was, this stream kept where the block left it."""
        shared_cpu = torch.get_rng_state()
        shared_cuda = torch.cuda.get_rng_state_all() if self.cuda else []
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(shared_cpu)
            if self.cuda:
                self.cuda = torch.cuda.get_rng_state_all()
                torch.cuda.set_rng_state_all(shared_cuda)

    def state(self) -> torch.Tensor:
        """The CPU state, for a checkpoint."""
        return self.cpu.clone()

    def restore(self, cpu: torch.Tensor) -> None:
        """Back to a checkpoint's CPU state."""
        self.cpu = cpu.clone()


__all__ = ["StageRandom"]
