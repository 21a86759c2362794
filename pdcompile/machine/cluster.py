"""The cluster we plan for: a hierarchy of link levels (innermost first) and a device model.

String grammar (`Cluster.parse`), levels innermost first as in PipeDream's `-n 8 2`:

    [LEVELS][@BANDWIDTHS][~LATENCIES][:DEVICES]     or a preset name, or local-N
    LEVELS      N or NxMx...         "8x2" = 2 servers of 8 workers each
    BANDWIDTHS  B[,B...]             one per level, innermost first; 1e9, 10Gbps, 25GB/s
    LATENCIES   L[,L...]             one per level; 10us, 1e-5
    DEVICES     a device preset      v100, titanx, a100, h100, cpu
                or groups NAME*N,... a mixed cluster, in rank order (machine/device_groups.py)

Examples: "4", "16@1e9", "4x4@1e10,1.25e9", "8x2@300GB/s,25Gbps~5us,50us:v100", "A", "local-4",
"8x4@150GB/s,100Gbps:a100*16,v100*16" (two servers of A100, then two of V100).
Ranks are numbered innermost level fastest: in "4x4", ranks 0-3 share the first server.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from pdcompile.errors import ClusterError
from pdcompile.machine.device import DEVICES, Device
from pdcompile.machine.device_groups import (
    GROUPS_EXAMPLE,
    DeviceGroup,
    groups_from_list,
    parse_groups,
)
from pdcompile.units import format_bandwidth, format_bytes, parse_quantity
from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal

_EXAMPLE = 'e.g. "4x4@1e10,1.25e9:v100" (2 levels, innermost first) or "16@10Gbps" or "A"'
_FILE_EXAMPLE_YAML = ("levels:\n  - {workers: 4, bandwidth: 10GB/s, latency: 10us}\n"
                      "  - {workers: 4, bandwidth: 10Gbps}\ndevice: v100")
_FILE_EXAMPLE_JSON = ('{"levels": [{"workers": 4, "bandwidth": "10GB/s", "latency": "10us"},\n'
                      '            {"workers": 4, "bandwidth": "10Gbps"}],\n "device": "v100"}')

# the outer bounds of a cluster's figures: past them a transfer's seconds overflow a float (a
# bandwidth of 1e-300 bytes/s, a latency of 1e300 s or of .inf) and the planner hung or failed
# on a NaN; real links are many orders of magnitude inside them
_SLOWEST_LINK = 1.0  # bytes/s
_LONGEST_LATENCY = 3600.0  # seconds
_SMALLEST_BUCKET, _LARGEST_BUCKET = 1.0, 1e15  # bytes (1e30 broke the CP-SAT model's integers)
_SLOWEST_DEVICE = 1.0  # FLOP/s or bytes/s of memory (1e-300 overflowed an update's seconds)


def _check_link_speed(value: float, what: str) -> None:
    """Raise ClusterError unless `value` is a finite bandwidth of at least _SLOWEST_LINK."""
    if not _SLOWEST_LINK <= value < math.inf:
        raise ClusterError(f"{what} {value!r} bytes/s; a link's bandwidth is finite and at least "
                           f"{_SLOWEST_LINK:.0f} byte/s (write e.g. 10Gbps or 1.25e9)")


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: `workers` children joined by links of this speed.

    `cpu_copies`: transfers over this level are copies made by the endpoints' CPUs, as between
    processes of one host over loopback, so the sending rank is busy for the transfer's duration
    (a NIC or NVLink copies by itself and leaves the rank free).

    `cores`: the workers of one group of this level run on this many processors between them,
    as the processes of one host share its cores; None: each worker has its own (a GPU).

    `flow_bandwidth`: the most one connection (one TCP flow) achieves over this level, where the
    network caps single flows below the link (AWS: 5 Gbps per flow between instances outside a
    cluster placement group); None: a flow gets the whole link. NCCL 2.4's socket transport
    (one socket per ring connection before NCCL_NSOCKS_PERTHREAD, 2.4.8) and gloo's pairs both
    send one flow per peer, so every transfer and every hop of a ring runs at `flow_rate`.

    `allreduce_bandwidth`: the bus bandwidth (2 (r-1)/r bytes per second of a ring all-reduce)
    that the collective achieves over this level where it falls below `flow_rate`; None: the
    ring runs at `flow_rate`. gloo's all-reduce of CPU tensors between processes of one host
    also copies and reduces its buffers on those CPUs: on a 2-core machine it achieves about a
    third of a send's bandwidth (machine/loopback.py measures both).

    `allreduce_flows`: the connections a collective spreads each hop over this level across
    (NCCL's channels, one socket each: NCCL 2.4 builds one ring per network interface and
    doubles the rings between servers of NVLink GPUs), so a ring hop runs at `flows` times
    `flow_rate`, at most the link; 1: one connection, as gloo and a single-channel ring."""

    workers: int
    bandwidth: float
    latency: float = 0.0
    cpu_copies: bool = False
    cores: int | None = None
    flow_bandwidth: float | None = None
    allreduce_bandwidth: float | None = None
    allreduce_flows: int = 1

    @property
    def flow_rate(self) -> float:
        """Bytes/s one transfer (one flow) gets over this level."""
        if self.flow_bandwidth is None:
            return self.bandwidth
        return min(self.bandwidth, self.flow_bandwidth)

    @property
    def allreduce_rate(self) -> float:
        """Bus bandwidth (bytes/s) of a ring all-reduce over this level: its hops' connections
        (`allreduce_flows` of `flow_rate` each, at most the link), at most
        `allreduce_bandwidth`."""
        hop = min(self.bandwidth, self.allreduce_flows * self.flow_rate)
        if self.allreduce_bandwidth is None:
            return hop
        return min(hop, self.allreduce_bandwidth)


_PCIE, _NVLINK_V100, _NVLINK_H100 = 1e10, 1.5e11, 4.5e11
_MOST_FLOWS = 64  # NCCL's most channels (MAXCHANNELS: 16 in 2.4, 32 in 2.7, 64 later)
_AWS_FLOW = 5e9 / 8  # AWS EC2 documentation, "instance network bandwidth": single-flow limit
_NCCL_PCIE = 4.9e9  # NCCL's ring all-reduce over 4 GPUs on PCIe: bus bandwidth (NVIDIA/nccl#445)
_NCCL_NVLINK_CHANNELS = 2  # NCCL 2.4 (misc/rings.cc): rings doubled across NVLink servers
_DDP_BUCKET = 25.0 * 2**20  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb=25

PRESET_HELP: dict[str, str] = {
    "A": "PipeDream cluster A: 4 servers x 4 V100, PCIe inside (10 GB/s), 10 Gbps between",
    "B": "PipeDream cluster B: 2 servers x 8 V100, NVLink inside (150 GB/s), 25 Gbps between",
    "C": "PipeDream cluster C: 4 servers x 1 Titan X, 40 Gbps between",
    "h100-node": "one server of 8 x H100 with NVLink (450 GB/s)",
    "h100-4node": "4 servers x 8 H100, NVLink inside, 400 Gbps between",
    "local-N": "N processes of this machine (local: 2), bandwidth measured",
    "mixed-a100-v100": "mixed: 2 servers x 8 A100 then 2 x 8 V100, NVLink inside (150 GB/s, "
                       "the V100's), 100 Gbps between",
    "mixed-h100-a100": "mixed: 1 server of 8 H100 then 2 of 8 A100, NVLink inside (300 GB/s), "
                       "200 Gbps between",
    "mixed-A": "mixed PipeDream cluster A: 2 servers x 4 V100 then 2 x 4 Titan X, PCIe inside, "
               "10 Gbps between",
}
_UNSET_DEVICE = replace(DEVICES["v100"])  # Cluster.device not given: a mixed one takes group 0's


@dataclass(frozen=True)
class Cluster:
    """Workers in nested levels (innermost first) and the device each worker has.

    `allreduce_bucket`: bytes of gradients per bucket where a replicated stage all-reduces its
    gradients bucket by bucket as the backward produces them (PyTorch's DistributedDataParallel,
    25 MiB buckets by default; the paper's clusters ran it), so that the all-reduce overlaps the
    backward (cost/links.py, `exposed_allreduce_seconds`); None: the all-reduce starts after the
    backward, as pdcompile's runtime does.

    `groups`: a mixed cluster's devices in rank order (machine/device_groups.py); empty: every
    worker has `device`. In a mixed cluster `device` is the reference whose times a CostGraph
    holds (default: the first group's), and `device_of(rank)` / `speed_of(rank)` say what each
    rank has; in a homogeneous one they are `device` and 1.0 for every rank."""

    levels: tuple[Level, ...]
    device: Device = field(default_factory=lambda: _UNSET_DEVICE)
    name: str = ""
    allreduce_bucket: float | None = None
    groups: tuple[DeviceGroup, ...] = ()

    def __post_init__(self) -> None:
        if not self.levels:
            raise ClusterError(f"a cluster needs at least one level ({_EXAMPLE})")
        object.__setattr__(self, "groups", tuple(self.groups))
        if self.groups and self.device is _UNSET_DEVICE:
            object.__setattr__(self, "device", self.groups[0].device)
        if self.allreduce_bucket is not None and not self.allreduce_bucket > 0:
            raise ClusterError(f"allreduce_bucket {self.allreduce_bucket!r}: a gradient bucket "
                               "holds > 0 bytes (PyTorch DDP: 25MiB), or leave it out")
        if self.allreduce_bucket is not None and not (
                _SMALLEST_BUCKET <= self.allreduce_bucket <= _LARGEST_BUCKET):
            raise ClusterError(f"allreduce_bucket {self.allreduce_bucket!r}: a gradient bucket "
                               f"holds {_SMALLEST_BUCKET:.0f} to {_LARGEST_BUCKET:.0e} bytes "
                               "(PyTorch DDP: 25MiB), or leave it out")
        for i, level in enumerate(self.levels):
            if not isinstance(level.workers, int) or level.workers < 1:
                raise ClusterError(
                    f"level {i} has {level.workers!r} workers; each level needs a positive "
                    f"integer ({_EXAMPLE})"
                )
            if not level.bandwidth > 0 or math.isnan(level.bandwidth):
                raise ClusterError(
                    f"level {i} has bandwidth {level.bandwidth!r}; bandwidth must be > 0 "
                    f"bytes/s ({_EXAMPLE})"
                )
            _check_link_speed(level.bandwidth, f"level {i} has bandwidth")
            if not level.latency >= 0:  # NaN too
                raise ClusterError(f"level {i} has latency {level.latency!r} s; a latency is "
                                   "0 or more seconds (e.g. 10us), or leave it out")
            if not level.latency <= _LONGEST_LATENCY:  # infinite too
                raise ClusterError(f"level {i} has latency {level.latency!r} s; a latency is "
                                   f"at most {_LONGEST_LATENCY:.0f} s (a real link's is "
                                   "microseconds: write e.g. 10us)")
            if not isinstance(level.cpu_copies, bool):
                raise ClusterError(f"level {i} has cpu_copies {level.cpu_copies!r}; write true "
                                   "or false")
            if level.flow_bandwidth is not None and not level.flow_bandwidth > 0:
                raise ClusterError(f"level {i} has flow_bandwidth {level.flow_bandwidth!r}; a "
                                   "flow's bandwidth must be > 0 bytes/s, or leave it out")
            if level.flow_bandwidth is not None:
                _check_link_speed(level.flow_bandwidth, f"level {i} has flow_bandwidth")
            if level.allreduce_bandwidth is not None and not level.allreduce_bandwidth > 0:
                raise ClusterError(f"level {i} has allreduce_bandwidth "
                                   f"{level.allreduce_bandwidth!r}; an all-reduce's bus "
                                   "bandwidth must be > 0 bytes/s, or leave it out")
            if level.allreduce_bandwidth is not None:
                _check_link_speed(level.allreduce_bandwidth,
                                  f"level {i} has allreduce_bandwidth")
            if not isinstance(level.allreduce_flows, int) or isinstance(level.allreduce_flows,
                                                                       bool) \
                    or not 1 <= level.allreduce_flows <= _MOST_FLOWS:
                raise ClusterError(f"level {i} has allreduce_flows {level.allreduce_flows!r}; "
                                   f"write a whole number of connections from 1 to "
                                   f"{_MOST_FLOWS} (NCCL's channels across the level), or "
                                   "leave it out for 1")
            if level.cores is not None and (not isinstance(level.cores, int)
                                            or isinstance(level.cores, bool) or level.cores < 1):
                raise ClusterError(f"level {i} has cores {level.cores!r}; write a positive "
                                   "integer (the processors one group of the level shares), or "
                                   "leave it out for a processor per worker")
        for i, group in enumerate(self.groups):
            if not isinstance(group, DeviceGroup):
                raise ClusterError(f"device group {i} is a {type(group).__name__}, not a "
                                   "DeviceGroup(device, workers, speed)")
            group.check(i)
        held = sum(group.workers for group in self.groups)
        if self.groups and held != self.workers:
            shape = "x".join(str(lv.workers) for lv in self.levels)
            raise ClusterError(f"the device groups hold {held} workers but the levels {shape} "
                               f"hold {self.workers}; make the groups' counts add up to "
                               f"{self.workers}, e.g. {GROUPS_EXAMPLE}")

    # ----------------------------------------------------------------------------- queries
    @property
    def workers(self) -> int:
        """All workers of the cluster."""
        return math.prod(level.workers for level in self.levels)

    @cached_property
    def _group_sizes(self) -> tuple[int, ...]:
        """`group_size` of each level, innermost first: the pricing of one plan asks for link
        levels millions of times on a large graph (a product per question was a fifth of it)."""
        return tuple(itertools.accumulate((lv.workers for lv in self.levels), operator.mul))

    def group_size(self, level: int) -> int:
        """Workers inside one group of `level` (level 0: one server's workers)."""
        if 0 <= level < len(self.levels):
            return self._group_sizes[level]
        return math.prod(lv.workers for lv in self.levels[: level + 1])

    def link_level(self, rank_a: int, rank_b: int) -> int:
        """The innermost level whose group holds both ranks (the level their link crosses)."""
        for k, size in enumerate(self._group_sizes):
            if rank_a // size == rank_b // size:
                return k
        raise ClusterError(f"ranks {rank_a} and {rank_b} are outside this "
                               f"{self.workers}-worker cluster")

    def bandwidth_between(self, rank_a: int, rank_b: int) -> float:
        """Bytes/s of the link between two ranks."""
        return self.levels[self.link_level(rank_a, rank_b)].bandwidth

    def latency_between(self, rank_a: int, rank_b: int) -> float:
        """Seconds of latency of the link between two ranks."""
        return self.levels[self.link_level(rank_a, rank_b)].latency

    def cpu_copies_between(self, rank_a: int, rank_b: int) -> bool:
        """Whether the CPUs copy the data between two ranks (the sender is busy meanwhile)."""
        return self.levels[self.link_level(rank_a, rank_b)].cpu_copies

    def flow_rate_between(self, rank_a: int, rank_b: int) -> float:
        """Bytes/s one transfer between two ranks gets (`Level.flow_rate`)."""
        return self.levels[self.link_level(rank_a, rank_b)].flow_rate

    def shared_cores(self) -> tuple[int, int] | None:
        """(workers per group, cores) of the innermost level whose groups have more workers than
        processors (ranks `g*size .. g*size+size-1` share `cores`); None when every worker has
        a processor of its own."""
        for k, level in enumerate(self.levels):
            if level.cores is not None and self.group_size(k) > level.cores:
                return self.group_size(k), level.cores
        return None

    def oversubscribed(self, ranks: Iterable[int]) -> bool:
        """Whether some group of `shared_cores` holds more of `ranks` than it has cores."""
        sharing = self.shared_cores()
        if sharing is None:
            return False
        size, cores = sharing
        groups: dict[int, int] = {}
        for rank in ranks:
            groups[rank // size] = groups.get(rank // size, 0) + 1
        return max(groups.values(), default=0) > cores

    def slowest_level_of(self, ranks: tuple[int, ...] | list[int]) -> int:
        """The outermost level that a group of ranks spans (its all-reduce's bottleneck)."""
        if len(ranks) <= 1:
            return 0
        # groups are runs of consecutive ranks: the lowest and the highest rank span the most
        return self.link_level(min(ranks), max(ranks))

    # ------------------------------------------------------------------- devices per rank
    @property
    def is_mixed(self) -> bool:
        """Whether the workers differ in device or speed (`groups` with more than one kind)."""
        if not self.groups:
            return False
        first = self.groups[0]
        return any(g.device != first.device or self.group_speed(i) != self.group_speed(0)
                   for i, g in enumerate(self.groups)) or self.group_speed(0) != 1.0

    def group_ranks(self, index: int) -> range:
        """The ranks of device group `index` (all ranks for a homogeneous cluster's group 0)."""
        if not self.groups:
            if index != 0:
                raise ClusterError(f"device group {index}: a homogeneous cluster has group 0 "
                                   "only")
            return range(self.workers)
        if not 0 <= index < len(self.groups):
            raise ClusterError(f"device group {index}: this cluster has groups "
                               f"0-{len(self.groups) - 1}")
        start = sum(g.workers for g in self.groups[:index])
        return range(start, start + self.groups[index].workers)

    def group_of(self, rank: int) -> int:
        """The index of the device group that holds `rank` (0 in a homogeneous cluster)."""
        if not 0 <= rank < self.workers:
            raise ClusterError(f"rank {rank} is outside this {self.workers}-worker cluster")
        end = 0
        for i, group in enumerate(self.groups):
            end += group.workers
            if rank < end:
                return i
        return 0

    def group_speed(self, index: int) -> float:
        """How many times faster group `index` computes than the reference `device`."""
        if not self.groups:
            return 1.0
        return self.groups[index].speed_over(self.device)

    def device_of(self, rank: int) -> Device:
        """The device of `rank` (`device` in a homogeneous cluster)."""
        index = self.group_of(rank)
        return self.groups[index].device if self.groups else self.device

    def speed_of(self, rank: int) -> float:
        """How many times faster `rank` computes than the reference device (1.0: the same, as
        every rank of a homogeneous cluster): a stage's compute on it takes time / speed."""
        return self.group_speed(self.group_of(rank))

    def slowest_speed(self, ranks: Iterable[int]) -> float:
        """The speed of the slowest of `ranks` (replicas of a stage take minibatches in turn, so
        the slowest sets the stage's pace)."""
        if not self.groups:  # one device: no need to look at each of 100,000 ranks in turn
            self._check_ranks(ranks)
            return 1.0
        return min((self.speed_of(r) for r in ranks), default=1.0)

    def _check_ranks(self, ranks: Iterable[int]) -> None:
        """ClusterError for a rank outside the cluster (what `group_of` says of each)."""
        held = tuple(ranks)
        if held and (min(held) < 0 or max(held) >= self.workers):
            self.group_of(min(held) if min(held) < 0 else max(held))

    def memory_of(self, ranks: Iterable[int]) -> float:
        """Bytes of the smallest device among `ranks` (what a stage on them may use)."""
        if not self.groups:
            self._check_ranks(ranks)
            return self.device.memory
        return min((self.device_of(r).memory for r in ranks), default=self.device.memory)

    def with_slowdowns(self, slowdowns: Iterable[float]) -> Cluster:
        """This cluster with rank r's compute `slowdowns[r]` times slower (runs of equal
        factors become device groups): the prediction for a run emulating slower devices
        (runtime/slowdown.py, `pdcompile run --slowdown`)."""
        factors = [float(f) for f in slowdowns]
        if len(factors) != self.workers or any(not f > 0 for f in factors):
            raise ClusterError(f"slowdowns {factors}: give one factor > 0 for each of the "
                               f"{self.workers} workers")
        groups: list[DeviceGroup] = []
        for rank, factor in enumerate(factors):
            device, speed = self.device_of(rank), self.speed_of(rank) / factor
            if groups and groups[-1].device == device and groups[-1].speed == speed:
                groups[-1] = replace(groups[-1], workers=groups[-1].workers + 1)
            else:
                groups.append(DeviceGroup(device, 1, speed))
        return replace(self, groups=tuple(groups))

    def group_cluster(self, index: int) -> Cluster:
        """Device group `index` alone as a homogeneous cluster of its device: the levels cut to
        its workers (whole servers where it holds whole servers)."""
        ranks = self.group_ranks(index)
        device = self.groups[index].device if self.groups else self.device
        levels: list[Level] = []
        left = len(ranks)
        for level in self.levels:
            if left <= level.workers or left % level.workers:
                levels.append(replace(level, workers=left))
                break
            levels.append(level)
            left //= level.workers
        return replace(self, levels=tuple(levels), device=device, groups=(),
                       name=f"{self.name or 'cluster'} group {index}")

    def with_workers(self, workers: int) -> Cluster:
        """The same kind of cluster flattened to its innermost link with `workers` workers (a
        mixed one keeps its groups in rank order, the last cut or grown to fit)."""
        groups: list[DeviceGroup] = []
        left = workers
        for group in self.groups:
            if left <= 0:
                break
            groups.append(replace(group, workers=min(group.workers, left)))
            left -= groups[-1].workers
        if groups and left > 0:
            groups[-1] = replace(groups[-1], workers=groups[-1].workers + left)
        return replace(self, levels=(replace(self.levels[0], workers=workers),),
                       groups=tuple(groups))

    def describe(self) -> str:
        """One line: "4x4 workers (10 GB/s, 1.25 GB/s) of v100 (16.0 GiB)"."""
        shape = "x".join(str(lv.workers) for lv in self.levels)
        links = ", ".join(format_bandwidth(lv.bandwidth)
                          + (f" ({format_bandwidth(lv.flow_rate)} per flow)"
                             if lv.flow_rate < lv.bandwidth else "")
                          + (f" ({format_bandwidth(lv.allreduce_rate)} all-reduce)"
                             if lv.allreduce_rate != lv.flow_rate else "")
                          + (" CPU copies" if lv.cpu_copies else "")
                          + (f", {lv.cores} cores" if lv.cores is not None else "")
                          for lv in self.levels)
        label = f"{self.name}: " if self.name else ""
        if self.groups:
            kinds = " + ".join(
                f"{g.workers} {g.device.name} ({format_bytes(g.device.memory)}"
                + (f", speed {self.group_speed(i):.3g}" if self.group_speed(i) != 1.0 else "")
                + ")" for i, g in enumerate(self.groups))
            return f"{label}{shape} workers ({links}) of {kinds}"
        memory = format_bytes(self.device.memory)
        return f"{label}{shape} workers ({links}) of {self.device.name} ({memory})"

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def flat(cls, workers: int, bandwidth: float | str,
             device: Device | str | None = None) -> Cluster:
        """A single level of `workers` all joined by links of `bandwidth` bytes/s."""
        bw = _quantity(bandwidth, "bandwidth", "bandwidth")
        return cls(levels=(Level(workers, bw),), device=_device(device))

    @classmethod
    def preset(cls, name: str, *, workers: int | None = None) -> Cluster:
        """A named cluster; see `PRESET_HELP` (also listed by `pdcompile plan --help`)."""
        key = name.strip()
        if key.lower() == "local" or key.lower().startswith("local-"):
            if key.lower() != "local" and not key[6:].isdigit():  # 'local--1' was local-2
                raise ClusterError(f"cluster {name!r}: give local-N with N a whole number of "
                                   "processes, e.g. local-4 (or local: 2)")
            count = workers or (int(key[6:]) if key[6:].isdigit() else 2)
            return _local_cluster(count)
        v100, titan, h100 = DEVICES["v100"], DEVICES["titanx"], DEVICES["h100"]
        gbps = 1e9 / 8
        mixed = _mixed_presets(gbps)
        if key in mixed:
            levels, groups = mixed[key]
            cluster = cls(levels=levels, groups=groups, name=key)
            return cluster if workers is None else cluster.with_workers(workers)
        table: dict[str, tuple[tuple[Level, ...], Device]] = {
            # NCCL's ring over 4 GPUs on PCIe reaches 4.9 GB/s of bus bandwidth (nccl#445)
            "A": ((Level(4, _PCIE, 10e-6, allreduce_bandwidth=_NCCL_PCIE),
                   Level(4, 10 * gbps, 50e-6)), v100),
            # AWS caps one flow at 5 Gbps between instances outside a cluster placement group;
            # NCCL 2.4 doubles its rings between servers of NVLink GPUs: 2 sockets per hop
            "B": ((Level(8, _NVLINK_V100, 5e-6),
                   Level(2, 25 * gbps, 50e-6, flow_bandwidth=_AWS_FLOW,
                         allreduce_flows=_NCCL_NVLINK_CHANNELS)), v100),
            "C": ((Level(4, 40 * gbps, 30e-6),), titan),
            "h100-node": ((Level(8, _NVLINK_H100, 3e-6),), h100),
            "h100-4node": ((Level(8, _NVLINK_H100, 3e-6), Level(4, 400 * gbps, 5e-6)), h100),
        }
        for alias, canonical in (("a", "A"), ("b", "B"), ("c", "C"), ("paper-a", "A"),
                                 ("paper-b", "B"), ("paper-c", "C")):
            table[alias] = table[canonical]
        if key not in table:
            from pdcompile.util.suggest import did_you_mean

            names = ", ".join(PRESET_HELP)
            known = [*table, *mixed, *(f"local-{n}" for n in range(1, 9))]
            raise ClusterError(f"unknown cluster preset {name!r}{did_you_mean(key, known)}; "
                               f"presets are: {names}; or write a short form, {_EXAMPLE}")
        levels, device = table[key]
        # the paper's clusters ran PyTorch 1.1's DistributedDataParallel: bucketed all-reduces
        bucket = _DDP_BUCKET if key.upper() in ("A", "B", "C") or key.startswith("paper") \
            else None
        cluster = cls(levels=levels, device=device, name=key.upper() if len(key) == 1 else key,
                      allreduce_bucket=bucket)
        return cluster if workers is None else cluster.with_workers(workers)

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """Read the short form (module docstring); a bad part is quoted with a valid example."""
        if not isinstance(text, str) or not text.strip():
            raise ClusterError(f"empty cluster string; write {_EXAMPLE}")
        spec = text.strip()
        head = re.split(r"[@~:]", spec, maxsplit=1)[0]
        if head and not re.fullmatch(r"[0-9x ]+", head):
            if spec != head:
                raise ClusterError(f"in cluster {text!r}: a preset name ({head!r}) takes no "
                                   "options; "
                                   f"write {_EXAMPLE}")
            return cls.preset(head)
        match = re.fullmatch(r"([^@~:]*)(?:@([^~:]*))?(?:~([^:]*))?(?::(.*))?", spec)
        if match is None:  # pragma: no cover - the pattern accepts every string
            raise ClusterError(f"cannot read cluster {text!r}; write {_EXAMPLE}")
        shape, bws, lats, dev = match.groups()
        # a mark with nothing after it ("4@", a shell variable that expanded to nothing) took
        # the default (1 GB/s, no latency, a V100) without a word
        for mark, part, what in (("@", bws, "a bandwidth per level, e.g. 4@10Gbps"),
                                 ("~", lats, "a latency per level, e.g. 4@10Gbps~5us"),
                                 (":", dev, "a device, e.g. 4@10Gbps:h100")):
            if part is not None and not part.strip():
                raise ClusterError(f"in cluster {text!r}: nothing after {mark!r}; give {what}, "
                                   f"or leave {mark!r} out for the default")
        counts: list[int] = []
        for part in shape.split("x"):
            if not part.strip().isdigit() or int(part) < 1:
                raise ClusterError(f"in cluster {text!r}: {part.strip()!r} is not a positive "
                                   "worker "
                                   f"count; write {_EXAMPLE}")
            counts.append(int(part))
        n = len(counts)
        bandwidths = _per_level(text, bws, n, "bandwidth", default=1e9)
        latencies = _per_level(text, lats, n, "seconds", default=0.0)
        levels = tuple(Level(c, b, lat) for c, b, lat in zip(counts, bandwidths, latencies,
                                                                   strict=True))
        if dev and ("*" in dev or "," in dev):
            return cls(levels=levels, groups=parse_groups(text, dev, _device))
        try:
            device = _device(dev.strip() if dev else None)
        except ClusterError as err:
            fixed = spec[:len(spec) - len(dev or "") - 1]
            raise ClusterError(f"in cluster {text!r}: {err}; write e.g. \"{fixed}:v100\"") from None
        return cls(levels=levels, device=device)

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read a JSON or YAML file: {name, device, allreduce_bucket, levels: [{workers,
        bandwidth, latency, cpu_copies, cores, flow_bandwidth, allreduce_bandwidth,
        allreduce_flows}], groups:
        [{device, workers, speed}]} (all but workers and bandwidth optional; groups make a mixed
        cluster, and its device, the reference, defaults to the first group's).

        A file that is missing, not JSON/YAML (the message quotes the bad line and marks the
        column) or not a cluster gets one ClusterError that shows a valid file."""
        file = Path(path)
        is_json = file.suffix.lower() == ".json"
        example = _FILE_EXAMPLE_JSON if is_json else _FILE_EXAMPLE_YAML
        valid = f"a valid {'JSON' if is_json else 'YAML'} cluster file:\n{example}"
        try:
            raw = read_plain_file(file, MAX_CLUSTER_FILE_BYTES).decode()
        except NotPlainFile as why:
            raise ClusterError(refusal(
                why, file, role="cluster file", limit=MAX_CLUSTER_FILE_BYTES,
                because=f"3 times a file of {_MAX_VALUES:,} values, the most one may hold",
                fix=f"give a YAML or JSON cluster file, or the cluster as a string, {_EXAMPLE}")
            ) from None
        except OSError as err:
            raise ClusterError(f"cannot read cluster file {str(file)!r}: "
                               f"{err.strerror or err}; check the path, or write {valid}\n"
                               f"or give the cluster as a string, {_EXAMPLE}") from None
        except UnicodeDecodeError as err:
            raise ClusterError(f"cluster file {file} is not text (byte {err.start} is not "
                               f"UTF-8); write {valid}") from None
        try:
            if is_json:
                data = json.loads(raw)
            else:
                import yaml

                data = yaml.safe_load(raw)
        except Exception as err:  # json/yaml errors carry the position
            raise ClusterError(f"cluster file {file} is not valid "
                               f"{'JSON' if is_json else 'YAML'}: {_syntax_error(err, raw)}\n"
                               f"{valid}") from None
        if _expanded_size(data, _MAX_VALUES) > _MAX_VALUES:
            raise ClusterError(f"cluster file {file} expands to more than {_MAX_VALUES:,} values "
                               "(YAML aliases repeated inside each other, or a structure that "
                               f"refers to itself); write the cluster out plainly: {valid}")
        if not isinstance(data, dict) or "levels" not in data:
            raise ClusterError(f"cluster file {file} needs a 'levels' list; {valid}")
        try:
            return cls.from_dict(data)
        except ClusterError as err:
            raise ClusterError(f"cluster file {file}: {err}\n{valid}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Inverse of `to_dict`; quantities may carry units ("10Gbps")."""
        levels_raw = data.get("levels")
        if not isinstance(levels_raw, list) or not levels_raw:
            raise ClusterError("'levels' must be a non-empty list, innermost first")
        levels = []
        for i, item in enumerate(levels_raw):
            if not isinstance(item, dict) or "workers" not in item or "bandwidth" not in item:
                raise ClusterError(f"level {i} ({item!r}) needs 'workers' and 'bandwidth'")
            unknown = set(item) - {"workers", "bandwidth", "latency", "cpu_copies", "cores",
                                   "flow_bandwidth", "allreduce_bandwidth",
                                   "allreduce_flows"}
            if unknown:
                raise ClusterError(f"level {i} has unknown keys {sorted(unknown)}")
            workers = item["workers"]
            if not isinstance(workers, int) or isinstance(workers, bool):
                raise ClusterError(f"level {i}: workers {workers!r} is not an integer")
            bandwidth = _quantity(item["bandwidth"], "bandwidth", f"level {i} bandwidth")
            latency = _quantity(item.get("latency", 0.0), "seconds", f"level {i} latency")
            cpu_copies = item.get("cpu_copies", False)
            if not isinstance(cpu_copies, bool):
                raise ClusterError(f"level {i}: cpu_copies {cpu_copies!r} is not true or false")
            cores = item.get("cores")
            if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool)):
                raise ClusterError(f"level {i}: cores {cores!r} is not an integer")
            flow = item.get("flow_bandwidth")
            flow = None if flow is None else _quantity(flow, "bandwidth",
                                                       f"level {i} flow_bandwidth")
            ring = item.get("allreduce_bandwidth")
            ring = None if ring is None else _quantity(ring, "bandwidth",
                                                       f"level {i} allreduce_bandwidth")
            flows = item.get("allreduce_flows", 1)
            if not isinstance(flows, int) or isinstance(flows, bool):
                raise ClusterError(f"level {i}: allreduce_flows {flows!r} is not an integer")
            levels.append(Level(workers, bandwidth, latency, cpu_copies, cores, flow, ring,
                                flows))
        bucket = data.get("allreduce_bucket")
        bucket = None if bucket is None else _quantity(bucket, "bytes", "allreduce_bucket")
        unknown = set(data) - {"name", "device", "allreduce_bucket", "levels", "groups"}
        if unknown:
            raise ClusterError(f"unknown keys {sorted(unknown)}; a cluster has name, device, "
                               "allreduce_bucket, levels and groups")
        if data.get("groups") is not None:
            groups = groups_from_list(data["groups"], _device)
            device = _device(data["device"]) if data.get("device") is not None \
                else groups[0].device
            return cls(levels=tuple(levels), device=device, name=str(data.get("name", "")),
                       allreduce_bucket=bucket, groups=groups)
        return cls(levels=tuple(levels), device=_device(data.get("device")),
                   name=str(data.get("name", "")), allreduce_bucket=bucket)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (base units: bytes, bytes/s, seconds, FLOP/s)."""
        optional = {"flow_bandwidth": None, "allreduce_bandwidth": None, "allreduce_flows": 1}
        levels = [{k: v for k, v in asdict(level).items()
                   if k not in optional or v != optional[k]} for level in self.levels]
        out: dict[str, Any] = {"name": self.name, "device": asdict(self.device), "levels": levels}
        if self.allreduce_bucket is not None:
            out["allreduce_bucket"] = self.allreduce_bucket
        if self.groups:
            out["groups"] = [group.to_dict() for group in self.groups]
        return out


def _expanded_size(data: Any, limit: int) -> int:
    """How many values `data` holds with every alias expanded (a YAML alias is one object met
    many times), counting stops past `limit`: a file of nested aliases ("billion laughs")
    would otherwise take exponential time and memory to print in an error message."""
    count, stack = 0, [data]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set):
            stack.extend(value)
    return count


def _syntax_error(err: Exception, raw: str) -> str:
    """A JSON or YAML parse error as "what, at line L column C:" and the line with a caret."""
    if isinstance(err, json.JSONDecodeError):
        what, line, column = err.msg, err.lineno, err.colno
    else:  # yaml.MarkedYAMLError: 0-based marks
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        what = str(getattr(err, "problem", None) or getattr(err, "context", None) or err)
        if mark is None:
            return what
        line, column = mark.line + 1, mark.column + 1
    lines = raw.splitlines()
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return (f"{what}, at line {line} column {column}:\n    {text}\n"
            f"    {' ' * (column - 1)}^")


def _quantity(value: Any, kind: str, what: str) -> float:
    try:
        return parse_quantity(value, kind)
    except (ValueError, TypeError) as err:
        raise ClusterError(f"{what}: {err}") from None


def _per_level(text: str, part: str | None, n: int, kind: str, default: float) -> list[float]:
    if part is None or not part.strip():
        return [default] * n
    items = [p.strip() for p in part.split(",")]
    if len(items) != n:
        raise ClusterError(f"in cluster {text!r}: {len(items)} {kind} values ({part!r}) for {n} "
                           f"level(s); give one per level, innermost first, {_EXAMPLE}")
    try:
        return [parse_quantity(p, kind) for p in items]
    except ValueError as err:
        raise ClusterError(f"in cluster {text!r}: {err}") from None


def _device(device: Device | str | dict[str, Any] | None) -> Device:
    if device is None:
        return DEVICES["v100"]
    if isinstance(device, Device):
        return device
    if isinstance(device, dict):
        try:
            made = Device(
                name=str(device.get("name", "custom")),
                memory=parse_quantity(device["memory"], "bytes"),
                flops=parse_quantity(device["flops"], "flops"),
                mem_bandwidth=parse_quantity(device["mem_bandwidth"], "bandwidth"),
                flops_lowp=(parse_quantity(device["flops_lowp"], "flops")
                            if device.get("flops_lowp") is not None else None),
            )
        except KeyError as err:
            raise ClusterError(f"device {device!r} lacks {err.args[0]!r}; a device needs memory, "
                               "flops and mem_bandwidth (or name a preset: "
                               f"{', '.join(DEVICES)})") from None
        except (ValueError, TypeError) as err:
            raise ClusterError(f"device {device!r}: {err}") from None
        for what in ("memory", "flops", "mem_bandwidth", "flops_lowp"):
            value = getattr(made, what)
            if value is not None and not value > 0:  # zero, negative or NaN
                raise ClusterError(f"device {device!r}: {what} {value!r} must be > 0 (a speed "
                                   "or size of 0 makes every time infinite or nothing fit)")
            if value is not None and not math.isfinite(value):
                raise ClusterError(f"device {device!r}: {what} {value!r} must be finite (an "
                                   "infinite size or speed makes the planner's sums "
                                   "meaningless); write the device's real figure, e.g. 16GiB")
            if value is not None and what != "memory" and value < _SLOWEST_DEVICE:
                raise ClusterError(f"device {device!r}: {what} {value!r} is below "
                                   f"{_SLOWEST_DEVICE:.0f} per second (an update's seconds "
                                   "overflow); write the device's real figure, e.g. 900GB/s")
        return made
    key = device.strip().lower()
    if key in ("cpu-local", "local"):
        from pdcompile.machine.local import local_device

        return local_device()
    if key not in DEVICES:
        raise ClusterError(f"unknown device {device!r}; devices are: {', '.join(DEVICES)}, "
                       "cpu-local")
    return DEVICES[key]


_MAX_VALUES = 100_000  # values a cluster file may hold, aliases expanded (a real one: tens)
MAX_CLUSTER_FILE_BYTES = 1 << 22
"""The largest cluster file read (4 MiB): more than 3 times a file of `_MAX_VALUES` values
written out plainly (15,000 groups: 0.75 MB of YAML, 1.28 MB of JSON indented by 2), 10,000
times a real one (some hundred bytes). A FIFO named as one blocked the reader forever, a sparse
file of gigabytes filled memory."""


def _mixed_presets(gbps: float) -> dict[str, tuple[tuple[Level, ...], tuple[DeviceGroup, ...]]]:
    """The mixed presets of PRESET_HELP: (levels, device groups in rank order)."""
    a100, v100, h100, titan = (DEVICES[k] for k in ("a100", "v100", "h100", "titanx"))
    return {
        "mixed-a100-v100": ((Level(8, _NVLINK_V100, 5e-6), Level(4, 100 * gbps, 10e-6)),
                            (DeviceGroup(a100, 16), DeviceGroup(v100, 16))),
        "mixed-h100-a100": ((Level(8, 3e11, 3e-6), Level(3, 200 * gbps, 5e-6)),
                            (DeviceGroup(h100, 8), DeviceGroup(a100, 16))),
        "mixed-A": ((Level(4, _PCIE, 10e-6), Level(4, 10 * gbps, 50e-6)),
                    (DeviceGroup(v100, 8), DeviceGroup(titan, 8))),
    }


def _local_cluster(workers: int) -> Cluster:
    from pdcompile.machine.local import local_bandwidth, local_device, usable_cores

    if workers < 1:
        raise ClusterError(f"local cluster needs at least 1 worker (got {workers})")
    loopback = local_bandwidth()
    # processes of one host: gloo over loopback is a copy made by the sending process's CPU, and
    # the processes take turns on the host's cores when they outnumber them
    level = Level(workers, loopback.bandwidth, loopback.latency, cpu_copies=True,
                  cores=usable_cores(), allreduce_bandwidth=loopback.allreduce_bandwidth)
    return Cluster(levels=(level,), device=local_device(workers),
                   name=f"local-{workers}")
