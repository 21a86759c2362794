"""A file of the user's read whole only where it is a plain file of bounded size: a FIFO put in
its place would block the reader forever, and a link to a file of gigabytes (or a sparse one)
would be read into memory. Checked on the open file itself (opened without blocking), so that
it cannot be swapped between the check and the read."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def plain_file_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of `path`, or None where it cannot be opened, is not a plain file (a folder,
    FIFO or device) or holds more than `limit` bytes (read: at most `limit` + 1 of them, so a
    file that grows while read is caught too)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        try:
            data = handle.read(limit + 1)
        except OSError:
            return None
    return data if len(data) <= limit else None


__all__ = ["plain_file_bytes"]
