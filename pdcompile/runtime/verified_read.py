"""A file read once against its manifest entry: the bytes hashed are the bytes used.

Checkpoints and exports list each of their files in a manifest (size and SHA-256,
util/manifest.py). Hashing a file and then opening it again to load it leaves a gap: a file
replaced between the two is loaded unchecked. Here the file is opened once (a plain file, not
a link: checked on the open file itself), its size compared with the entry's, and read front
to back by one parser (`read_tree`, `read_tensors`, or plain bytes), every chunk hashed as it
lands; the value is handed back only once the whole file matches the entry. A file the parser
cannot make sense of is named as altered when its bytes do not match the manifest, and as
the parser says otherwise.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import torch

from pdcompile.errors import DamagedFileError
from pdcompile.runtime.tensor_tree import read_bytes, read_tensors, read_tree
from pdcompile.util.manifest import FileEntry, check_entry

T = TypeVar("T")
Parser = Callable[[BinaryIO, int, Path, Callable[[memoryview], object]], T]
_CHUNK = 1 << 20


def parse_tree(handle: BinaryIO, size: int, path: Path,
               seen: Callable[[memoryview], object]) -> Any:
    """A tensor-tree file's value (runtime/tensor_tree)."""
    return read_tree(handle, size, path, seen=seen)


def parse_safetensors(handle: BinaryIO, size: int, path: Path,
                      seen: Callable[[memoryview], object]
                      ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors (a tree or plain tensors, for the caller to
    decide: `tensor_tree.tree_value` makes the tree)."""
    return read_tensors(handle, size, path, seen=seen)


def parse_safetensors_layout(handle: BinaryIO, size: int, path: Path,
                             seen: Callable[[memoryview], object]
                             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and its tensors as meta tensors (shapes and dtypes), read
    by the same parser as `parse_safetensors` (its header, and its tensors' layout against the
    file's size, checked), the tensors' bytes read and hashed but not kept: what a check that
    loads nothing reads."""
    return read_tensors(handle, size, path, seen=seen, keep=False)


def parse_bytes(handle: BinaryIO, size: int, path: Path,
                seen: Callable[[memoryview], object]) -> bytes:
    """The file's bytes as they are."""
    return read_bytes(handle, size, seen)


def _check_size(handle: BinaryIO, path: Path, entry: FileEntry, fix: str) -> None:
    """Refuse an open file whose size is not its manifest's before reading any of it."""
    size = os.fstat(handle.fileno()).st_size
    if size != entry.size:
        raise DamagedFileError(f"{path} does not match its manifest ({size} bytes where it "
                               f"says {entry.size}: truncated or altered); {fix}")


def read_checked(path: Path, entry: FileEntry, parse: Parser[T], *, fix: str,
                 kind: str) -> T:
    """`parse` run over `path`, read once, returned only if every byte matched `entry`
    (`kind`: "checkpoint" or "export", as errors name the folder; `fix`: what they advise)."""
    sha = hashlib.sha256()
    with open_regular(path, fix, kind) as handle:
        _check_size(handle, path, entry, fix)
        try:
            value: T | DamagedFileError = parse(handle, entry.size, path, sha.update)
        except DamagedFileError as err:
            value = err  # named below unless the file does not match its manifest
        read = handle.tell() + hash_rest(handle, sha)  # a damaged header stops early
    check_entry(path, entry, fix=fix, read=(read, sha.hexdigest()))
    if isinstance(value, DamagedFileError):  # the parser's words, with this file's fix
        raise DamagedFileError(f"{str(value).removesuffix('; write it again')}; {fix}")
    return value


def hash_file(path: Path, entry: FileEntry, *, fix: str, kind: str) -> None:
    """Refuse `path` unless it matches `entry` (read in 1 MB chunks, nothing kept)."""
    sha = hashlib.sha256()
    with open_regular(path, fix, kind) as handle:
        _check_size(handle, path, entry, fix)
        read = hash_rest(handle, sha)
    check_entry(path, entry, fix=fix, read=(read, sha.hexdigest()))


def refuse_special(path: Path, fix: str) -> None:
    """Refuse a link or anything but a plain file where pdcompile writes plain files: a link
    could point the reader at another file of the machine, and a FIFO or /dev/zero would hang
    it (one is never read to its end)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return  # named as missing by the reader
    if stat.S_ISLNK(mode):
        raise DamagedFileError(f"{path} is a link (to {os.readlink(path)}), where pdcompile "
                               f"writes a plain file; {fix}")
    if not stat.S_ISREG(mode):
        raise DamagedFileError(f"{path} is not a plain file (a folder, device or pipe), where "
                               f"pdcompile writes one; {fix}")


def open_regular(path: Path, fix: str, kind: str) -> IO[bytes]:
    """`path` opened for reading if it is a plain file and not a link (checked on the open
    file itself, so that it cannot be swapped between the check and the read)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing from the {kind} (its manifest lists it); "
                               f"{fix}") from None
    except OSError:  # ELOOP: a link, refused with O_NOFOLLOW
        refuse_special(path, fix)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        refuse_special(path, fix)
        raise DamagedFileError(f"{path} is not a plain file; {fix}")
    return os.fdopen(fd, "rb")


def hash_rest(handle: IO[bytes], sha: Any) -> int:
    """Feed the rest of `handle` to `sha` in chunks; the bytes fed."""
    fed = 0
    while chunk := handle.read(_CHUNK):
        sha.update(chunk)
        fed += len(chunk)
    return fed


__all__ = ["hash_file", "hash_rest", "open_regular", "parse_bytes", "parse_safetensors",
           "parse_safetensors_layout", "parse_tree", "read_checked", "refuse_special"]
