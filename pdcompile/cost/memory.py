"""Bytes per worker: weights, their gradients, optimizer state, stashed versions, activations.

The one memory formula of the project: the planners check plans against the device with it, the
simulator reports it per rank, and both count the same things. A worker of a stage with P bytes
of parameters and K bytes of activations kept per minibatch (or microbatch) in flight holds

    P (live weights) + P (gradients) + s P (optimizer state: s = 2 for Adam's two moments,
    1 for SGD with momentum, 0 for plain SGD) + (v - 1) P (stashed weight versions) + n K

with n minibatches in flight and v weight versions (schedule.kinds.weight_versions).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_STATE = 2.0  # optimizer state bytes per parameter byte by default (Adam: two moments)


@dataclass(frozen=True)
class WorkerMemory:
    """Peak bytes on one worker, by what they hold."""

    weights: float
    gradients: float
    optimizer: float
    stashed: float
    activations: float
    in_flight: int

    @property
    def total(self) -> float:
        """All of it."""
        return self.weights + self.gradients + self.optimizer + self.stashed + self.activations


def worker_memory(params: float, *, activations: float, in_flight: int, versions: int,
                  optimizer_state: float = OPTIMIZER_STATE) -> WorkerMemory:
    """The memory of one worker (see the module docstring): `activations`, the most bytes of
    activations it holds at once (n K for n minibatches in flight of K each)."""
    return WorkerMemory(weights=params, gradients=params, optimizer=optimizer_state * params,
                        stashed=max(0, versions - 1) * params, activations=activations,
                        in_flight=in_flight)


def max_in_flight(params: float, keep: float, *, versions_per_flight: bool, fixed_versions: int,
                  optimizer_state: float, limit: float) -> int:
    """The most minibatches a worker can keep in flight within `limit` bytes (0 if not even
    one fits). `versions_per_flight`: each minibatch in flight adds a weight version (weight
    stashing); otherwise the worker holds `fixed_versions` versions."""
    base = params * (2.0 + optimizer_state)
    if versions_per_flight:
        per = keep + params
        spare = limit - base + params  # the first version is the live weights
    else:
        per = keep
        spare = limit - base - max(0, fixed_versions - 1) * params
    if spare < per:
        return 0
    if per <= 0:
        return 1 << 20  # no limit
    return int(min(spare // per, 1 << 20))


__all__ = ["OPTIMIZER_STATE", "WorkerMemory", "max_in_flight", "worker_memory"]
