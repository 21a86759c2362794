"""Time of the memory-bound work around an update: an optimizer step and a weight-version copy.

Defaults when nothing was measured (cost/optimizer_timing.py times the real ones on this machine): a
step reads weights and gradients and writes the weights once (3 P bytes at the device's memory
bandwidth); a copy of the weights for weight stashing reads and writes them once (2 P).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import Device


def step_seconds(params: float, device: Device) -> float:
    """One optimizer step over `params` bytes of weights."""
    return 3.0 * params / device.mem_bandwidth


def copy_seconds(params: float, device: Device) -> float:
    """One copy of `params` bytes of weights (a new stashed version)."""
    return 2.0 * params / device.mem_bandwidth


def update_scale(cluster: Cluster, ranks: Iterable[int]) -> float:
    """How many times longer an update's memory-bound work (a step, a weight copy) takes on the
    slowest memory among `ranks` than on the cluster's reference device: a measured or
    estimated reference time times this is the time there (1.0 on a homogeneous cluster)."""
    if not cluster.groups:  # every rank has the reference device
        return 1.0
    reference = cluster.device.mem_bandwidth
    return max((reference / cluster.device_of(r).mem_bandwidth for r in ranks), default=1.0)


__all__ = ["copy_seconds", "step_seconds", "update_scale"]
