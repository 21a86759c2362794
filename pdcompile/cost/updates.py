"""Time of the memory-bound work around an update: an optimizer step and a weight-version copy.

Defaults when nothing was measured (cost/optimizer_timing.py times the real ones on this machine): a
step reads weights and gradients and writes the weights once (3 P bytes at the device's memory
bandwidth); a copy of the weights for weight stashing reads and writes them once (2 P).
"""

from __future__ import annotations

from pdcompile.machine.device import Device


def step_seconds(params: float, device: Device) -> float:
    """One optimizer step over `params` bytes of weights."""
    return 3.0 * params / device.mem_bandwidth


def copy_seconds(params: float, device: Device) -> float:
    """One copy of `params` bytes of weights (a new stashed version)."""
    return 2.0 * params / device.mem_bandwidth


__all__ = ["copy_seconds", "step_seconds"]
