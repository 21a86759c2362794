"""The device model: what one worker can do (memory, peak FLOP/s, memory bandwidth), and the
named devices a cluster string or file may use (`DEVICES`)."""

from __future__ import annotations

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


DEVICES: dict[str, Device] = {
    "v100": Device("v100", 16 * 2.0**30, 15.7e12, 900e9, 125e12),
    "titanx": Device("titanx", 12 * 2.0**30, 11.0e12, 480e9, None),
    "a100": Device("a100", 80e9, 19.5e12, 2.0e12, 312e12),
    "h100": Device("h100", 80e9, 67e12, 3.35e12, 989e12),
    "cpu": Device("cpu", 16 * 2.0**30, 50e9, 10e9, None),
}
