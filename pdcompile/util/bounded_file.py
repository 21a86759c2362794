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
    device), "large" (more than the limit on disk) or "grew" (more while read); `mode` is the
    file's st_mode, which says which special file it is."""

    def __init__(self, kind: str, size: int, mode: int = 0) -> None:
        super().__init__(kind)
        self.kind, self.size, self.mode = kind, size, mode


def read_plain_file(path: Path, limit: int) -> bytes:
    """The bytes of `path` where it is a plain file of at most `limit` bytes (read: at most
    `limit` + 1 of them); NotPlainFile says why not, OSError where it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:  # checked before os.fdopen, which refuses a folder's descriptor and leaves it open
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise NotPlainFile("folder", info.st_size, info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            raise NotPlainFile("special", info.st_size, info.st_mode)
        if info.st_size > limit:
            raise NotPlainFile("large", info.st_size, info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise NotPlainFile("grew", len(data))
    return data


def refusal(why: NotPlainFile, path: Path | str, *, role: str, limit: int, because: str,
            fix: str) -> str:
    """The one line that says why `path` was not read: it names the file (`role` before the
    path, e.g. "the signing key"; "" for none), what it is instead (a folder, a FIFO or a
    device, or its size against `limit`, with `because` saying what the limit is: "any file
    pdcompile reads whole"), and `fix`, the remedy. One wording for every reader of a user's
    file, so that each says the same thing."""
    named = f"{role} {path}" if role else str(path)
    if why.kind == "folder":
        what = "is a folder, not a plain file"
    elif why.kind == "special":
        what = f"is not a plain file but {_special_kind(why.mode)}"
    elif why.kind == "large":
        what = f"holds {why.size:,} bytes, more than {because} ({limit:,})"
    else:
        what = f"grew past {limit:,} bytes while read, more than {because}"
    return f"{named} {what}; {fix}"


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (a named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a FIFO, socket or device"


def plain_file_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of `path`, or None where it cannot be opened, is not a plain file (a folder,
    FIFO or device) or holds more than `limit` bytes (`read_plain_file`)."""
    try:
        return read_plain_file(path, limit)
    except (OSError, NotPlainFile):
        return None


__all__ = ["NotPlainFile", "plain_file_bytes", "read_plain_file", "refusal"]
