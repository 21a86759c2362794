"""Per-stage checkpoints: atomic saves every K minibatches and the resume point of a run.

As in PipeDream, each stage checkpoints its own state independently (no global coordination):
weights, optimizer state, weight versions still needed (stash; empty at a drained point), the
random-number state and the data position (minibatches done). A save writes a temporary file in
the same folder, flushes it to disk and renames it into place, so a crash never leaves a torn
checkpoint: a file either is complete or does not exist under its final name. The file is
safetensors with the non-tensor fields as JSON (runtime/tensor_tree): loading one runs no code.

Layout of the folder a user names:

    rank_<r>/step_<k>.safetensors   the state of rank r after k minibatches (newest `keep` kept)

A run resumes from the newest k that every rank has saved (`resume_step`): if a crash hit while
some ranks had written step k and others not yet, all go back to the previous common step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import DamagedFileError, DistributedError
from pdcompile.runtime.tensor_tree import load_tree, save_tree

_STEP_RE = re.compile(r"^step_(\d+)\.safetensors$")


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
        final = self._path(step)
        tmp = folder / f".{final.name}.{os.getpid()}.tmp"
        save_tree(tmp, {**state, "step": step, "rank": self.rank},
                  where=f"the checkpoint of rank {self.rank}")
        with open(tmp, "rb+") as out:
            os.fsync(out.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
        for old in self.steps()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)
        return final

    def _path(self, step: int) -> Path:
        return self.rank_dir() / f"step_{step:08d}.safetensors"

    def resume_step(self, world_size: int) -> int | None:
        """The newest step saved by every one of `world_size` ranks (None: start afresh)."""
        common: set[int] | None = None
        for rank in range(world_size):
            steps = set(self.steps(rank))
            common = steps if common is None else common & steps
        return max(common) if common else None

    def load(self, step: int) -> dict[str, Any]:
        """This rank's state at `step`."""
        path = self._path(step)
        if not path.is_file():
            raise DistributedError(f"no checkpoint of rank {self.rank} at step {step} in "
                                   f"{self.folder}; delete the folder to start afresh")
        try:
            state = load_tree(path)
        except DamagedFileError as err:
            raise DamagedFileError(f"{err}; or delete {path} to resume from an older "
                                   "checkpoint") from None
        if not isinstance(state, dict) or state.get("rank") != self.rank \
                or state.get("step") != step:
            found = state if not isinstance(state, dict) else (
                f"rank {state.get('rank')} step {state.get('step')}")
            raise DamagedFileError(f"{path} holds {found}, not rank {self.rank} step {step}; "
                                   "delete it to resume from an older checkpoint")
        return state


def module_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 **extra: Any) -> dict[str, Any]:
    """The usual contents of a stage checkpoint (weights, optimizer, RNG, extra fields)."""
    return {"model": module.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": torch.get_rng_state(), **extra}


def restore_module_state(state: dict[str, Any], module: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None, *, origin: str = "the checkpoint"
                         ) -> None:
    """Inverse of `module_state` (in place); `origin` names the file in errors."""
    try:
        module.load_state_dict(state["model"])
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedFileError(f"{origin} does not fit this stage ({type(err).__name__}: "
                               f"{detail}); delete it to resume from an older checkpoint") \
            from None


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
