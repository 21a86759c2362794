"""Manifests: the SHA-256 and size of every file of an export or a checkpoint, written last.

A folder pdcompile writes (an export, one rank's checkpoint) ends with a manifest, a small JSON
file naming each of its files with its size and SHA-256. It is written after everything else
and atomically (a temporary file, fsync, rename), so that a folder whose writer was killed has
no manifest, or the previous one, which no longer matches. Readers verify the files against it
before they use them and refuse a mismatch in one line naming the file. A manifest detects
damage (a flipped bit, a truncated or edited file); it is not a signature: whoever can write
the folder can write a matching manifest too.

    {"format": "pdcompile.manifest/1", "kind": "export",
     "files": {"stage_0.safetensors": {"size": 1234, "sha256": "9f86..."}, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcompile.errors import DamagedFileError
from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal

MANIFEST_FORMAT = "pdcompile.manifest/1"
# the largest JSON file of an export or a checkpoint read whole (real ones: kilobytes to a
# few megabytes, for models of hundreds of thousands of parameters)
MAX_JSON_BYTES = 1 << 28
_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """One file of a manifest: its size in bytes and its SHA-256 (hex)."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A manifest read back: what it covers (`kind`) and its files by name (relative)."""

    path: Path
    kind: str
    files: dict[str, FileEntry]
    data: bytes = field(default=b"", repr=False)  # the manifest's bytes as read (signing.py)

    @property
    def total_bytes(self) -> int:
        """The size of every file it lists together."""
        return sum(entry.size for entry in self.files.values())


def digest(path: Path) -> str:
    """The SHA-256 of a file (read in chunks: a 1 GB file takes 1 MB of memory)."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def write_manifest(folder: Path, names: Iterable[str], *, kind: str,
                   manifest_name: str) -> Path:
    """Hash `names` (files in `folder`) and write their manifest atomically, last."""
    files = {}
    for name in sorted(set(names)):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": digest(path)}
    text = json.dumps({"format": MANIFEST_FORMAT, "kind": kind, "files": files}, indent=1)
    final = folder / manifest_name
    tmp = folder / f".{manifest_name}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)
    fsync_dir(folder)
    return final


def read_json_text(path: Path, *, fix: str, limit: int = MAX_JSON_BYTES) -> str:
    """The text of a JSON file pdcompile wrote, refused (DamagedFileError) when it is larger
    than any such file can be, before a byte of it is read into memory (a hostile folder's
    multi-gigabyte pipeline.json or manifest)."""
    return read_json_bytes(path, fix=fix, limit=limit).decode()


def read_json_bytes(path: Path, *, fix: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a JSON file pdcompile wrote, with `read_json_text`'s size limit, read only
    as a plain file: opened without blocking and checked on the open file, as a FIFO put in its
    place hung the reader forever (a folder raises IsADirectoryError, as reading one does)."""
    try:
        return read_plain_file(path, limit)
    except NotPlainFile as why:
        if why.kind == "folder":  # the callers say what a folder in the file's place means
            raise IsADirectoryError(f"{path} is a folder") from None
        raise DamagedFileError(refusal(
            why, path, role="", limit=limit,
            because="any file of its kind pdcompile writes",
            fix=f"it is not one pdcompile wrote; {fix}")) from None


def read_manifest(path: Path, *, kind: str, fix: str) -> Manifest:
    """A manifest file read and checked for its format; one line naming it otherwise."""
    try:
        raw = read_json_bytes(path, fix=fix)
        data = json.loads(raw)
    except DamagedFileError:
        raise
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing (the writer was stopped before it finished, "
                               f"or the folder predates manifests); {fix}") from None
    except IsADirectoryError:
        raise DamagedFileError(f"{path} is a folder, not a manifest; {fix}") from None
    except (ValueError, RecursionError) as err:  # RecursionError: nested past json's depth
        raise DamagedFileError(f"{path} is not valid JSON ({err}); {fix}") from None
    try:
        if data["format"] != MANIFEST_FORMAT:
            raise DamagedFileError(f"{path} is format {data['format']!r}, expected "
                                   f"{MANIFEST_FORMAT!r}; {fix}")
        files = {str(name): _entry(entry) for name, entry in data["files"].items()}
        found = str(data["kind"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise DamagedFileError(f"{path} is altered or incomplete ({type(err).__name__}: {err}); "
                               f"{fix}") from None
    if found != kind:
        raise DamagedFileError(f"{path} is the manifest of a {found}, not of a {kind}; {fix}")
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise DamagedFileError(f"{path} names {name!r}, outside its folder; {fix}")
        if "\x00" in name or Path(name).parts in ((), (".",)):
            raise DamagedFileError(f"{path} names {name!r}, which is not a file name; {fix}")
    return Manifest(path, found, files, raw)


def _entry(entry: Any) -> FileEntry:
    """A manifest's entry of one file, as the writer writes it: a size that is a whole number
    of bytes (not 1.5, true, or Infinity, which int() refused with an OverflowError that no
    caller named) and a SHA-256 in hex."""
    size, sha = entry["size"], entry["sha256"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size {size!r} is not a number of bytes")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise ValueError(f"sha256 {sha!r} is not a SHA-256 in hex")
    return FileEntry(size, sha)


def check_entry(path: Path, entry: FileEntry, *, fix: str, read: tuple[int, str]) -> None:
    """Refuse `path` unless `read` (the size and SHA-256 of its bytes as the caller read them,
    runtime/verified_read.py) are the entry's; the message names the file and what differs."""
    size, found = read
    if size != entry.size:
        raise DamagedFileError(f"{path} does not match its manifest ({size} bytes where it says "
                               f"{entry.size}: truncated or altered); {fix}")
    if found != entry.sha256:
        raise DamagedFileError(f"{path} does not match its manifest (another SHA-256: altered "
                               f"or damaged on disk); {fix}")


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (best effort: not every file system allows it)."""
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


def entries(manifest: Manifest) -> dict[str, Any]:
    """The manifest's files as plain data (name -> size, sha256), for reports."""
    return {name: {"size": e.size, "sha256": e.sha256} for name, e in manifest.files.items()}


__all__ = ["MANIFEST_FORMAT", "MAX_JSON_BYTES", "FileEntry", "Manifest", "check_entry", "digest",
           "entries", "fsync_dir", "read_json_bytes", "read_json_text", "read_manifest",
           "write_manifest"]
