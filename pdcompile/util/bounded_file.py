"""A file of the user's read whole only where it is a plain file of bounded size: a FIFO put in
its place would block the reader forever, and a link to a file of gigabytes (or a sparse one)
would be read into memory. Checked on the open file itself (opened without blocking), so that
it cannot be swapped between the check and the read."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotPlainFile(Exception):
    """Why `read_plain_file` read nothing: `kind` is "folder", "special" (a FIFO, socket or
    device), "large" (more than the limit on disk) or "grew" (more while read)."""

    def __init__(self, kind: str, size: int) -> None:
        super().__init__(kind)
        self.kind, self.size = kind, size


def read_plain_file(path: Path, limit: int) -> bytes:
    """The bytes of `path` where it is a plain file of at most `limit` bytes (read: at most
    `limit` + 1 of them); NotPlainFile says why not, OSError where it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise NotPlainFile("folder", info.st_size)
        if not stat.S_ISREG(info.st_mode):
            raise NotPlainFile("special", info.st_size)
        if info.st_size > limit:
            raise NotPlainFile("large", info.st_size)
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise NotPlainFile("grew", len(data))
    return data


def plain_file_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of `path`, or None where it cannot be opened, is not a plain file (a folder,
    FIFO or device) or holds more than `limit` bytes (`read_plain_file`)."""
    try:
        return read_plain_file(path, limit)
    except (OSError, NotPlainFile):
        return None


__all__ = ["NotPlainFile", "plain_file_bytes", "read_plain_file"]
