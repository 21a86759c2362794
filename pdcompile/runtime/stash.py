"""Stash buffers: the weight versions and saved activations of the minibatches in flight.

Weight stashing as in PipeDream (Narayanan et al., SOSP 2019, section 3.3): a stage that updates
its weights while minibatches are in flight runs each minibatch's backward with the weight
version its forward used. Versions are snapshots of the stage's parameters (`WeightVersions`),
put in the parameters' places for a forward (runtime/weight_swap.py, as
`torch.func.functional_call` does), never loaded in place; a snapshot lives while an
in-flight minibatch refers to it (or while the schedule says a later forward will need it:
vertical sync, PipeDream-2BW) and is dropped as soon as it is not. `StashBuffer` holds, per
in-flight microbatch, its version number and the tensors its backward needs (the autograd graph
hangs off its outputs), released when its backward is done.

A dropped version's tensors are kept as the spare that the next snapshot copies into, where
nothing else holds them (runtime/tensor_reuse.py): asynchronous 1F1B snapshots once per update
and drops the older version about as often, and a fresh clone of a stage's weights costs the
allocation and its first touch of the pages besides the copy (docs/runtime-profile.md, eleventh
round: 2.2 against 1.5 ms for 16 MB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdcompile.errors import ScheduleError
from pdcompile.runtime.tensor_reuse import only_held_here


class WeightVersions:
    """Numbered versions of one stage's parameters: version k is the weights after k updates.

    `master` maps every parameter name of the stage module (tied names included) to the live
    `nn.Parameter` the optimizer updates. With `copy=False` (schedules that never update while a
    microbatch is in flight) the live parameters are the only version; otherwise a version is a
    detached clone, shared by all minibatches that use it, with its own `.grad` leaves.
    """

    def __init__(self, master: dict[str, torch.Tensor], *, copy: bool) -> None:
        self.master = master
        self.copy = copy
        self.current = 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._refs: dict[int, int] = {}
        self._kept: set[int] = set()
        # each distinct parameter once, under its first name, and every name's first name
        # (tied names share one tensor in every version)
        self._distinct: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for name, p in master.items():
            self._distinct.setdefault(first.setdefault(id(p), name), p)
        self._first_of = {name: first[id(p)] for name, p in master.items()}
        # the last dropped version's tensors by first name: the next snapshot's storage where
        # nothing else holds them (module docstring)
        self._spare: dict[str, torch.Tensor] = {}
        self.peak = 0  # most versions held at once (snapshots, or 1 without copies)

    @property
    def held(self) -> list[int]:
        """Version numbers whose snapshot is alive, ascending."""
        return sorted(self._snapshots)

    def is_master(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `tensors` are the live parameters (gradients land in `.grad` directly)."""
        return tensors is self.master

    def acquire(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of `version` for one more in-flight microbatch."""
        if not self.copy:
            if version != self.current:
                raise ScheduleError(f"weight version {version} requested but only the current "
                                    f"version {self.current} exists (schedule without stashing)")
            self.peak = max(self.peak, 1)
            return self.master
        if version not in self._snapshots:
            if version != self.current:
                raise ScheduleError(
                    f"weight version {version} is needed but no longer (or not yet) kept; the "
                    f"stage is at version {self.current} and keeps {self.held}")
            self._snapshots[version] = self.snapshot()
        self._refs[version] = self._refs.get(version, 0) + 1
        self.peak = max(self.peak, len(self._snapshots))
        return self._snapshots[version]

    def release(self, version: int) -> None:
        """One in-flight microbatch no longer needs `version`."""
        if not self.copy:
            return
        self._refs[version] -= 1
        self._drop_if_unused(version)

    def keep(self, version: int) -> None:
        """Hold `version` (snapshotting it now if it is the current one) until `unkeep`."""
        if not self.copy:
            return
        if version not in self._snapshots:
            if version != self.current:
                return
            self._snapshots[version] = self.snapshot()
            self.peak = max(self.peak, len(self._snapshots))
        self._kept.add(version)

    def unkeep(self, version: int) -> None:
        """Stop holding `version` for the schedule's sake (in-flight users still hold it)."""
        self._kept.discard(version)
        self._drop_if_unused(version)

    def unkeep_below(self, version: int) -> None:
        """Stop holding every version older than `version`."""
        for old in [v for v in self._kept if v < version]:
            self.unkeep(old)

    def advance(self) -> None:
        """The optimizer has updated the live parameters: a new current version."""
        self.current += 1

    def clear(self) -> None:
        """Drop every snapshot no in-flight microbatch holds (end of a run)."""
        self._kept.clear()
        for version in list(self._snapshots):
            self._drop_if_unused(version)
        self._spare = {}  # nothing of a finished run stays held

    def _drop_if_unused(self, version: int) -> None:
        if self._refs.get(version, 0) == 0 and version not in self._kept:
            dropped = self._snapshots.pop(version, None)
            self._refs.pop(version, None)
            if dropped is not None:
                self._spare = {name: dropped[name] for name in self._distinct}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A new version: a detached copy of every distinct live parameter, by name; into the
        last dropped version's tensors where nothing else holds them, else a clone."""
        spare, self._spare = self._spare, {}
        with torch.no_grad():
            copies = {name: _copy_into(spare, name, p) for name, p in self._distinct.items()}
        return {name: copies[first] for name, first in self._first_of.items()}


def _copy_into(spare: dict[str, torch.Tensor], name: str, p: torch.Tensor) -> torch.Tensor:
    """A detached copy of `p` with its own `.grad` (run under no_grad): `spare[name]`
    overwritten where it has p's shape, strides, dtype, device and layout, no gradient, and no
    holder but `spare`; else a clone."""
    if only_held_here(spare, name):
        old = spare[name]
        if old.shape == p.shape and old.stride() == p.stride() and old.dtype == p.dtype \
                and old.device == p.device and old.layout == p.layout and old.grad is None \
                and old.is_leaf and old.requires_grad == p.requires_grad:
            return old.copy_(p)
    return p.detach().clone().requires_grad_(p.requires_grad)


@dataclass
class StashEntry:
    """What one in-flight microbatch keeps between its forward and its backward."""

    version: int
    params: dict[str, torch.Tensor]
    inputs: list[Any] = field(default_factory=list)          # stage-module arguments
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # src -> leaves
    values: dict[str, Any] = field(default_factory=dict)     # stage outputs by name
    loss: torch.Tensor | None = None                         # last stage only
    weight_grads: list[Any] = field(default_factory=list)    # deferred W work (split backward)
    rng: Any = None                    # random state at the forward (recomputed activations)
    # buffers the forward changed, with their values before it (recomputed activations)
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class StashBuffer:
    """In-flight microbatches of one rank, keyed by microbatch number."""

    def __init__(self) -> None:
        self.entries: dict[int, StashEntry] = {}
        self.peak = 0  # most microbatches in flight at once

    def put(self, microbatch: int, entry: StashEntry) -> None:
        """Stash a microbatch after its forward."""
        if microbatch in self.entries:
            raise ScheduleError(f"microbatch {microbatch} is forwarded twice before its backward")
        self.entries[microbatch] = entry
        self.peak = max(self.peak, len(self.entries))

    def get(self, microbatch: int) -> StashEntry:
        """The stash of a microbatch whose forward has run."""
        try:
            return self.entries[microbatch]
        except KeyError:
            raise ScheduleError(f"backward of microbatch {microbatch} before its forward "
                                f"(in flight: {sorted(self.entries)})") from None

    def pop(self, microbatch: int) -> StashEntry:
        """Release a microbatch (its backward is done): its tensors can be freed."""
        return self.entries.pop(microbatch)

    def versions_in_flight(self) -> set[int]:
        """Distinct weight versions the in-flight microbatches use."""
        return {e.version for e in self.entries.values()}


__all__ = ["StashBuffer", "StashEntry", "WeightVersions"]
