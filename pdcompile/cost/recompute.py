"""Activation recomputation per stage: a stage's time and memory with and without it.

A stage that recomputes (`Stage.recompute`) keeps no activations between a microbatch's forward
and its backward, only its inputs (the tensors it received, or the model inputs); at the start of
the backward it runs the forward again, with the same weights and random state, and then the
backward as usual (runtime/stage_runtime.py; the result is the same bit for bit). So per
microbatch it computes one more forward, and with k microbatches in flight it holds k inputs
plus the activations of the one microbatch whose backward is running, instead of k microbatches'
activations. A plan that does not fit the device's memory can fit with some stages recomputing;
the planner weighs the extra forward against the memory (Chen et al., "Training Deep Nets with
Sublinear Memory Cost", 2016, for the idea; GPipe recomputes every stage). Torch-free: the
planner calls it on CostGraph figures; the simulator (backends/simulate.py) charges the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.errors import PlanError


@dataclass(frozen=True)
class StageFootprint:
    """Per microbatch: backward seconds (recomputation included) and forward + backward; peak
    activation bytes on one worker with the given microbatches in flight."""

    backward: float
    compute: float
    activations: float


def recompute_costs(*, fwd: float, bwd: float, activations: float, inputs: float,
                    in_flight: int) -> dict[bool, StageFootprint]:
    """{False: without recomputation, True: with} for a stage whose microbatch takes `fwd` and
    `bwd` seconds, keeps `activations` bytes for its backward, receives `inputs` bytes, and has
    `in_flight` microbatches between forward and backward at most."""
    if min(fwd, bwd, activations, inputs) < 0 or in_flight < 1:
        raise PlanError(f"recompute_costs needs times and bytes >= 0 and in_flight >= 1 (got "
                        f"fwd {fwd}, bwd {bwd}, activations {activations}, inputs {inputs}, "
                        f"in_flight {in_flight})")
    return {
        False: StageFootprint(bwd, fwd + bwd, in_flight * activations),
        True: StageFootprint(bwd + fwd, 2 * fwd + bwd, in_flight * inputs + activations),
    }


__all__ = ["StageFootprint", "recompute_costs"]
