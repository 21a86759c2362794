"""Per-stage checkpoints: atomic saves every K minibatches and the resume point of a run.

As in PipeDream, each stage checkpoints its own state independently (no global coordination):
weights, optimizer state, weight versions still needed (stash; empty at a drained point), the
random-number state and the data position (minibatches done). A save writes a temporary file in
the same folder, flushes it to disk and renames it into place, then writes the checkpoint's
manifest (its size and SHA-256, util/manifest.py) the same way, last: a checkpoint counts only
once its manifest exists, and is used only if its file still matches it (a flipped bit on disk
is refused, not trained on); a load reads the file once, and the bytes it hashes are the bytes
it loads; a link, pipe or device where a checkpoint or manifest belongs is refused. The file is
safetensors with the non-tensor fields as JSON (runtime/tensor_tree): loading one runs no code.
Temporary files left by a writer that was killed are removed by the next save or resume of that
rank.

Layout of the folder a user names:

    rank_<r>/step_<k>.safetensors     the state of rank r after k minibatches (newest `keep` kept)
    rank_<r>/step_<k>.manifest.json   its manifest, written last
    rank_<r>/.writer.lock             held (an advisory lock of the OS) by the run writing there

One run writes a folder at a time: each rank claims its folder's writer lock before it reads
its resume point (`claim`), for as long as the run lives (the OS drops it when the process
ends, killed or not). Before, two runs given one checkpoint folder both wrote step_<k> of each
rank, the last rename winning per rank, and a later resume could restore rank 0 from one run and
rank 1 from the other without a word.

A run resumes from the newest k that every rank has saved and that verifies (`resume_step`): if
a crash hit while some ranks had written step k and others not yet, or one rank's step k is
damaged, all go back to the previous common step.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from pdcompile.errors import DamagedFileError, DistributedError
from pdcompile.runtime.tensor_tree import save_tree
from pdcompile.runtime.verified_read import hash_file, parse_tree, read_checked, refuse_special
from pdcompile.util.manifest import FileEntry, fsync_dir, read_manifest, write_manifest

LOCK_NAME = ".writer.lock"
_STEP_RE = re.compile(r"^step_(\d+)\.safetensors$")
# .step_<k>.safetensors.<pid>.tmp and its manifest's: the temporary files a save writes (and
# nothing else: remove_stale deletes them)
_TMP_RE = re.compile(r"^\.step_\d+\.(?:safetensors|manifest\.json)\.(\d+)\.tmp$")
MANIFEST_KIND = "checkpoint"


@dataclass(frozen=True)
class Damaged:
    """A checkpoint that exists but does not verify: which step, and why (one line)."""

    step: int
    reason: str


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
        self._lock: IO[str] | None = None

    def claim(self) -> None:
        """Hold this rank's writer lock for the life of this checkpointer (see the module
        docstring); another run holding it is refused in one line. Where the OS has no such
        locks (not POSIX), nothing is held."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return
        if self._lock is not None:
            return
        folder = self._own_dir()
        refuse_special(folder / LOCK_NAME, "delete it; pdcompile writes it anew")
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        handle = os.fdopen(os.open(folder / LOCK_NAME, flags, 0o644), "a")  # held until release()
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise DistributedError(
                f"another run is writing checkpoints to {self.folder} right now (rank "
                f"{self.rank}'s {LOCK_NAME} is held); wait for it to end, or give this run "
                "another checkpoint folder") from None
        self._lock = handle

    def release(self) -> None:
        """Let another run write this rank's folder (also done when the process ends)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def rank_dir(self, rank: int | None = None) -> Path:
        """The folder of one rank's checkpoints."""
        return self.folder / f"rank_{self.rank if rank is None else rank}"

    def _own_dir(self) -> Path:
        """This rank's folder, made if missing, to write and delete files in; refused when it
        is a link (saves and clean-ups would write and delete files wherever it points)."""
        folder = self.rank_dir()
        if folder.is_symlink():
            raise DistributedError(
                f"{folder} is a link (to {os.readlink(folder)}), not a folder pdcompile made: "
                "checkpoints write and delete files there; give this run another checkpoint "
                "folder, or replace the link with a folder")
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def due(self, step: int) -> bool:
        """True when a checkpoint is due after `step` minibatches."""
        return step > 0 and step % self.every == 0

    def steps(self, rank: int | None = None) -> list[int]:
        """The steps with a complete checkpoint of `rank` (file and manifest), ascending."""
        folder = self.rank_dir(rank)
        if not folder.is_dir():
            return []
        found = (_STEP_RE.match(p.name) for p in folder.iterdir())
        return sorted(int(m.group(1)) for m in found
                      if m and (folder / _manifest_name(int(m.group(1)))).is_file())

    def verified_steps(self, rank: int | None = None) -> tuple[list[int], list[Damaged]]:
        """The complete steps of `rank` whose file matches its manifest, ascending, and those
        that do not, with the reason."""
        good, bad = [], []
        for step in self.steps(rank):
            try:
                self.verify(step, rank)
                good.append(step)
            except DamagedFileError as err:
                bad.append(Damaged(step, str(err)))
        return good, bad

    def verify(self, step: int, rank: int | None = None) -> None:
        """Refuse, in one line naming the file, a checkpoint that does not match its manifest
        (read in chunks: verifying holds 1 MB of the file at a time)."""
        path, entry, fix = self._entry(step, rank)
        hash_file(path, entry, fix=fix, kind="checkpoint")

    def read_verified(self, step: int, rank: int | None = None) -> tuple[Path, Any]:
        """A checkpoint file's value, read once (runtime/verified_read.py): every byte is hashed
        as it is read and is the byte that lands in the value, which is returned only once the
        whole file matches its manifest."""
        path, entry, fix = self._entry(step, rank)
        return path, read_checked(path, entry, parse_tree, fix=fix, kind="checkpoint")

    def _entry(self, step: int, rank: int | None) -> tuple[Path, FileEntry, str]:
        """A step's file, its manifest entry and the fix its errors name."""
        folder = self.rank_dir(rank)
        fix = "delete it to resume from an older checkpoint"
        manifest_path = folder / _manifest_name(step)
        refuse_special(manifest_path, fix)
        manifest = read_manifest(manifest_path, kind=MANIFEST_KIND, fix=fix)
        name = _step_name(step)
        entry = manifest.files.get(name)
        if entry is None or len(manifest.files) != 1:
            raise DamagedFileError(f"{manifest.path} does not describe {name}; {fix}")
        return folder / name, entry, fix

    def remove_stale(self) -> list[Path]:
        """Delete this rank's temporary files whose writer is gone (killed mid-save)."""
        folder = self.rank_dir()
        if not folder.is_dir():
            return []
        folder = self._own_dir()
        removed = []
        for path in folder.iterdir():
            match = _TMP_RE.match(path.name)
            if match and (int(match.group(1)) == os.getpid()
                          or not _pid_alive(int(match.group(1)))):
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (with `step` added) atomically; drop checkpoints older than `keep`."""
        folder = self._own_dir()
        self.remove_stale()
        final = self._path(step)
        (folder / _manifest_name(step)).unlink(missing_ok=True)  # rewritten below, last
        tmp = folder / f".{final.name}.{os.getpid()}.tmp"
        save_tree(tmp, {**state, "step": step, "rank": self.rank},
                  where=f"the checkpoint of rank {self.rank}")
        with open(tmp, "rb+") as out:
            os.fsync(out.fileno())
        os.replace(tmp, final)
        fsync_dir(folder)
        write_manifest(folder, [final.name], kind=MANIFEST_KIND,
                       manifest_name=_manifest_name(step))
        for old in self.steps()[:-self.keep]:
            (folder / _manifest_name(old)).unlink(missing_ok=True)  # first: then not complete
            self._path(old).unlink(missing_ok=True)
        return final

    def _path(self, step: int) -> Path:
        return self.rank_dir() / _step_name(step)

    def resume_step(self, world_size: int) -> int | None:
        """The newest step saved by every one of `world_size` ranks that verifies on each
        (None: start afresh)."""
        common: set[int] | None = None
        for rank in range(world_size):
            steps = set(self.verified_steps(rank)[0])
            common = steps if common is None else common & steps
        return max(common) if common else None

    def load(self, step: int) -> dict[str, Any]:
        """This rank's state at `step`."""
        path = self._path(step)
        if not os.path.lexists(path):  # a link or a pipe there is named by read_verified
            raise DistributedError(f"no checkpoint of rank {self.rank} at step {step} in "
                                   f"{self.folder}; delete the folder to start afresh")
        path, state = self.read_verified(step)
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


def _step_name(step: int) -> str:
    return f"step_{step:08d}.safetensors"


def _manifest_name(step: int) -> str:
    return f"step_{step:08d}.manifest.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
