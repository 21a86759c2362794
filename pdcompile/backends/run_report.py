"""What a training run shows and keeps: its progress, a summary, and every loss in a file.

The rank that learns the losses first (the last stage's first rank) reports. On a terminal the
progress is a tqdm bar on stderr; otherwise (a log, a pipe) one line `step S/T loss L` at the
first step, about every `every_s` seconds and at the last step, so that a long run does not
print a line per minibatch. Every loss goes to `losses.csv` (`step,loss`, step counted from 1)
in the run folder as it becomes known, and the whole file is written again at the end from the
run's losses (resumed ones included); the summary names the first, last and lowest loss and the
throughput.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

LOSSES_FILE = "losses.csv"
_HEADER = "step,loss\n"


def default_run_dir(export_dir: str | os.PathLike[str]) -> Path:
    """A new run folder of an export: EXPORT_DIR/runs/<UTC date and time>-<pid>."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(export_dir) / "runs" / f"{stamp}-{os.getpid()}"


class RunReport:
    """The reporting rank's `progress(step, loss)`: the bar or lines, and the loss file."""

    def __init__(self, run_dir: str | os.PathLike[str] | None, *, total: int | None,
                 out: IO[str] | None = None, bar: bool | None = None,
                 every_s: float = 10.0) -> None:
        self.path = None if run_dir is None else Path(run_dir) / LOSSES_FILE
        self.total = total
        self.out = out or sys.stdout
        self.every_s = every_s
        self._bar: Any = None
        use_bar = sys.stderr.isatty() if bar is None else bar
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self._file: IO[str] | None = None
        self._flushed = self._printed = time.monotonic()
        self._last: tuple[int, float] | None = None

    def __call__(self, step: int, loss: float) -> None:
        if self.path is not None and self._file is None:
            self._file = self._open(first=step)
        if self._file is not None:
            self._file.write(f"{step + 1},{loss!r}\n")
        now = time.monotonic()
        if self._file is not None and now - self._flushed > 1.0:
            self._file.flush()
            self._flushed = now
        self._last = (step, loss)
        if self._bar is not None:
            if self._bar.n == 0 and step:
                self._bar.n = self._bar.last_print_n = step  # a resumed run
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        elif step == 0 or now - self._printed >= self.every_s or (
                self.total is not None and step + 1 == self.total):
            self._line(step, loss)
            self._printed = now

    def _line(self, step: int, loss: float) -> None:
        total = f"/{self.total}" if self.total else ""
        print(f"step {step + 1}{total} loss {loss:.6f}", file=self.out, flush=True)

    def _open(self, *, first: int) -> IO[str]:
        """The loss file, keeping the lines of the steps before `first` (a resumed run)."""
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        for line in (_earlier_lines(self.path) if first else [])[1:]:
            head, _, loss = line.partition(",")
            if head.isascii() and head.isdigit() and int(head) <= first and _is_loss(loss):
                kept.append(line + "\n")
        _clear_special(self.path)
        out = open(self.path, "w")  # noqa: SIM115 (closed by close())
        out.write(_HEADER + "".join(kept))
        return out

    def close(self, losses: Sequence[float] | None = None) -> None:
        """End the bar; write every loss of the run (`losses`: the whole run's) to the file."""
        if self._bar is not None:
            self._bar.close()
        elif self._last is not None and self.total is None:
            self._line(*self._last)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None and losses is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a temporary file of its own: two runs given one run folder (--run-dir, or the
            # checkpoint folder) once wrote the same losses.csv.tmp, and the second to finish
            # failed at its rename after training; now the last to finish leaves its whole file
            handle, name = tempfile.mkstemp(dir=self.path.parent, prefix=".losses.",
                                            suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                out.write(_HEADER + "".join(f"{i + 1},{v!r}\n" for i, v in enumerate(losses)))
            os.replace(name, self.path)


def _earlier_lines(path: Path) -> list[str]:
    """The lines of an earlier run's loss file, as far as they are text: a damaged byte (which
    raised UnicodeDecodeError, and a digit such as "²" ValueError, in the resumed run's
    reporting rank) is read as U+FFFD and its line dropped by the caller; a loss file that is
    no plain file (a link; a pipe, which waited forever) gives none."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError:  # missing, or a link (ELOOP): nothing of an earlier run of ours
        return []
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return handle.read().decode(errors="replace").splitlines()


def _clear_special(path: Path) -> None:
    """Remove a link, pipe or anything but a plain file where the loss file is written (opening
    a pipe to write waited forever for a reader, and a link had its target overwritten)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        path.unlink()


def _is_loss(text: str) -> bool:
    """Whether `text` is a loss as the file holds them (a float's repr, nan and inf too)."""
    try:
        float(text)
    except ValueError:
        return False
    return text.isascii()


def summary(losses: Sequence[float], *, trained: int, seconds: float, samples: int) -> str:
    """One line: minibatches trained, throughput, and the first, last and lowest loss."""
    rate = (f"{trained / seconds:.1f} steps/s, {samples / seconds:.1f} samples/s"
            if seconds > 0 else "no time measured")
    line = f"trained {trained} minibatches in {seconds:.3f} s ({rate})"
    finite = [(v, i) for i, v in enumerate(losses) if math.isfinite(v)]
    if losses:
        low, at = min(finite) if finite else (float("nan"), 0)
        line += (f"; loss first {losses[0]:.6g}, last {losses[-1]:.6g}, lowest {low:.6g} "
                 f"(step {at + 1})")
    return line


__all__ = ["LOSSES_FILE", "RunReport", "default_run_dir", "summary"]
