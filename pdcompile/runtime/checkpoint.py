"""Per-stage checkpoints: atomic saves every K minibatches and the resume point of a run.

As in PipeDream, each stage checkpoints its own state independently (no global coordination):
weights, optimizer state, weight versions still needed (stash; empty at a drained point), the
random-number state and the data position (minibatches done). A save writes a temporary file in
the same folder, flushes it to disk and renames it into place, so a crash never leaves a torn
checkpoint: a file either is complete or does not exist under its final name.

Layout of the folder a user names:

    rank_<r>/step_<k>.pt     the state of rank r after k minibatches (the newest `keep` kept)

A run resumes from the newest k that every rank has saved (`resume_step`): if a crash hit while
some ranks had written step k and others not yet, all go back to the previous common step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import DistributedError

_STEP_RE = re.compile(r"^step_(\d+)\.pt$")


class Checkpointer:
    """Saves and finds the checkpoints of one rank in `folder` (every `every` minibatches)."""

    def __init__(self, folder: str | os.PathLike[str], *, rank: int, every: int,
                 keep: int = 2) -> None:
        if every < 1:
            raise DistributedError(f"checkpoint interval must be a positive number of "
                                   f"minibatches ({every} < 1)")
        self.folder = Path(folder)
        self.rank = rank
        self.every = every
        self.keep = max(2, keep)

    def rank_dir(self, rank: int | None = None) -> Path:
        """The folder of one rank's checkpoints."""
        return self.folder / f"rank_{self.rank if rank is None else rank}"

    def due(self, step: int) -> bool:
        """True when a checkpoint is due after `step` minibatches."""
        return step > 0 and step % self.every == 0

    def steps(self, rank: int | None = None) -> list[int]:
        """The steps with a complete checkpoint of `rank`, ascending."""
        folder = self.rank_dir(rank)
        if not folder.is_dir():
            return []
        found = (_STEP_RE.match(p.name) for p in folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (with `step` added) atomically; drop checkpoints older than `keep`."""
        folder = self.rank_dir()
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"step_{step:08d}.pt"
        tmp = folder / f".step_{step:08d}.pt.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            torch.save({**state, "step": step, "rank": self.rank}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
        for old in self.steps()[:-self.keep]:
            (folder / f"step_{old:08d}.pt").unlink(missing_ok=True)
        return final

    def resume_step(self, world_size: int) -> int | None:
        """The newest step saved by every one of `world_size` ranks (None: start afresh)."""
        common: set[int] | None = None
        for rank in range(world_size):
            steps = set(self.steps(rank))
            common = steps if common is None else common & steps
        return max(common) if common else None

    def load(self, step: int) -> dict[str, Any]:
        """This rank's state at `step`."""
        path = self.rank_dir() / f"step_{step:08d}.pt"
        if not path.is_file():
            raise DistributedError(f"no checkpoint of rank {self.rank} at step {step} in "
                                   f"{self.folder}; delete the folder to start afresh")
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
        if state.get("rank") != self.rank or state.get("step") != step:
            raise DistributedError(f"{path} holds rank {state.get('rank')} step "
                                   f"{state.get('step')}, not rank {self.rank} step {step}")
        return state


def module_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 **extra: Any) -> dict[str, Any]:
    """The usual contents of a stage checkpoint (weights, optimizer, RNG, extra fields)."""
    return {"model": module.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": torch.get_rng_state(), **extra}


def restore_module_state(state: dict[str, Any], module: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None) -> None:
    """Inverse of `module_state` (in place)."""
    module.load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
