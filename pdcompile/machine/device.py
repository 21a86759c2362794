"""The device model: what one worker can do (memory, peak FLOP/s, memory bandwidth), and the
named devices a cluster string or file may use (`DEVICES`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """What one worker can do: memory (bytes), peak FLOP/s (fp32 and low precision), bytes/s."""

    name: str
    memory: float
    flops: float
    mem_bandwidth: float
    flops_lowp: float | None = None

    def peak_flops(self, low_precision: bool = False) -> float:
        """FLOP/s for fp32, or for fp16/bf16 where the device has faster units for those."""
        if low_precision and self.flops_lowp:
            return self.flops_lowp
        return self.flops

    def speed_relative_to(self, reference: Device) -> float:
        """How many times faster this device computes than `reference` (2.0: half the time).

        A node's roofline time is max(FLOPs / peak, bytes / bandwidth); a profile gives only the
        time, not the intensity, so both ratios count alike: the geometric mean of the FLOP/s
        and memory-bandwidth ratios. It is transitive (a/b x b/c = a/c), so which device is the
        reference does not change a plan's relative prices."""
        return math.sqrt(self.flops / reference.flops
                         * self.mem_bandwidth / reference.mem_bandwidth)


DEVICES: dict[str, Device] = {
    "v100": Device("v100", 16 * 2.0**30, 15.7e12, 900e9, 125e12),
    "titanx": Device("titanx", 12 * 2.0**30, 11.0e12, 480e9, None),
    "a100": Device("a100", 80e9, 19.5e12, 2.0e12, 312e12),
    "h100": Device("h100", 80e9, 67e12, 3.35e12, 989e12),
    "cpu": Device("cpu", 16 * 2.0**30, 50e9, 10e9, None),
}
