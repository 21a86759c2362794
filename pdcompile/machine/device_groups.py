"""Device groups: the runs of consecutive ranks of a mixed cluster that share one kind of device.

A mixed cluster (two servers of A100 next to two of V100 behind one network) keeps its link
hierarchy in `Cluster.levels` and lists its devices as groups in rank order: ranks 0-15 A100,
16-31 V100. Short form of the device part of a cluster string: `NAME*WORKERS` items joined by
commas (`8x4@300GB/s,100Gbps:a100*16,v100*16`).

A group's `speed` is how many times faster it computes than the cluster's reference device (the
device whose times a CostGraph holds, `Cluster.device`); None: from the device models
(`Device.speed_relative_to`). Give it where a profile per kind measured it, or to emulate a
slower device on this machine (speed 0.5: each stage's compute takes twice as long).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pdcompile.errors import ClusterError
from pdcompile.machine.device import Device

GROUPS_EXAMPLE = '"8x4@300GB/s,100Gbps:a100*16,v100*16" (16 A100 then 16 V100)'


@dataclass(frozen=True)
class DeviceGroup:
    """`workers` consecutive ranks with one kind of device (see the module docstring)."""

    device: Device
    workers: int
    speed: float | None = None

    def check(self, index: int) -> None:
        """Raise ClusterError naming the group when its count or speed is not usable."""
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) \
                or self.workers < 1:
            raise ClusterError(f"device group {index} ({self.device.name}) has "
                               f"{self.workers!r} workers; each group needs a positive integer, "
                               f"e.g. {GROUPS_EXAMPLE}")
        if self.speed is not None and (isinstance(self.speed, bool)
                                       or not isinstance(self.speed, (int, float))
                                       or not math.isfinite(self.speed) or self.speed <= 0):
            raise ClusterError(f"device group {index} ({self.device.name}) has speed "
                               f"{self.speed!r}; a speed is > 0 (times faster than the "
                               "reference device: 0.5 = half as fast), or leave it out to take "
                               "it from the device models")

    def speed_over(self, reference: Device) -> float:
        """Times faster than `reference`: the given speed, else the device models' ratio."""
        return float(self.speed) if self.speed is not None \
            else self.device.speed_relative_to(reference)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the device in full, so that a file needs no preset table)."""
        out: dict[str, Any] = {"device": asdict(self.device), "workers": self.workers}
        if self.speed is not None:
            out["speed"] = self.speed
        return out


def parse_groups(text: str, part: str, device: Callable[[str], Device]) -> tuple[DeviceGroup, ...]:
    """Read `NAME*WORKERS[,NAME*WORKERS...]` (the device part of cluster string `text`)."""
    groups = []
    for item in (p.strip() for p in part.split(",")):
        name, star, count = item.partition("*")
        if not star or not count.strip().isdigit() or int(count) < 1 or not name.strip():
            raise ClusterError(f"in cluster {text!r}: device group {item!r} is not NAME*WORKERS; "
                               f"write e.g. {GROUPS_EXAMPLE}")
        try:
            groups.append(DeviceGroup(device(name.strip()), int(count)))
        except ClusterError as err:
            raise ClusterError(f"in cluster {text!r}: {err}; write e.g. {GROUPS_EXAMPLE}") \
                from None
    return tuple(groups)


def groups_from_list(raw: Any, device: Callable[[Any], Device]) -> tuple[DeviceGroup, ...]:
    """Read a file's `groups: [{device, workers, speed}]` (inverse of DeviceGroup.to_dict)."""
    if not isinstance(raw, list) or not raw:
        raise ClusterError("'groups' must be a non-empty list of {device, workers, speed} in "
                           "rank order, e.g. [{device: a100, workers: 16}, {device: v100, "
                           "workers: 16}]")
    groups = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "device" not in item or "workers" not in item:
            raise ClusterError(f"device group {i} ({item!r}) needs 'device' and 'workers', "
                               "e.g. {device: v100, workers: 16}")
        unknown = set(item) - {"device", "workers", "speed"}
        if unknown:
            raise ClusterError(f"device group {i} has unknown keys {sorted(unknown)}; a group "
                               "has device, workers and (optional) speed")
        speed = item.get("speed")
        group = DeviceGroup(device(item["device"]), item["workers"],
                            None if speed is None else speed)
        group.check(i)
        groups.append(group)
    return tuple(groups)


__all__ = ["GROUPS_EXAMPLE", "DeviceGroup", "groups_from_list", "parse_groups"]
