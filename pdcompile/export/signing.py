"""Exports signed by their writer: an edit with a matching manifest forged is refused.

A manifest (export/integrity.py) catches damage, but whoever can write the folder can write a
manifest too, and an export is code that runs when it is loaded. So the writer also signs the
manifest: `MANIFEST.sig` holds the HMAC-SHA256 of MANIFEST.json's bytes under a secret key of
the user's, kept outside every export (`export_key_path`: `$PDCOMPILE_KEY`, else
`$XDG_CONFIG_HOME/pdcompile/export.key`, else `~/.config/pdcompile/export.key`, made on first
use with 32 random bytes, readable by the user alone; a shorter key, or one others may read,
signs nothing and verifies nothing, as anyone could sign with it; nor does a key path that is
not a plain file of bounded size, such as a pipe or a device, which is never read whole).
Without `trust=True` (`--trust`) a folder loads only when its signature verifies under that
key: written by this user (on this machine, or wherever the key file was copied) and not
changed since. An export from anyone else, or one edited by hand, needs `trust=True`: the
choice to run its code is the user's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tempfile
import warnings
from pathlib import Path

from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal
from pdcompile.util.manifest import MAX_JSON_BYTES, read_json_bytes

SIGNATURE_NAME = "MANIFEST.sig"
_KEY_BYTES = 32
_MOST_SIGNATURE_BYTES = 4096  # a signature is 64 hex digits and a line break


def export_key_path() -> Path:
    """Where the user's signing key lives (module docstring)."""
    given = os.environ.get("PDCOMPILE_KEY")
    if given:
        return Path(given).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "pdcompile" / "export.key"


class UnusableKeyError(OSError):
    """A key file that must not sign: too short to be secret, or readable by others."""


def _key(*, create: bool) -> bytes | None:
    """The user's key; made (atomically, mode 0600) when `create` and there is none. Raises
    OSError (UnusableKeyError) for a key file that cannot be read or must not sign."""
    path = export_key_path()
    try:
        return _usable(path, _key_bytes(path))
    except FileNotFoundError:
        if not create:
            return None
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary name of this writer's own (threads share a pid), linked into place
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(_KEY_BYTES))
        os.link(tmp, path)  # never replaces a key another process made meanwhile
    except FileExistsError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)
    return _usable(path, _key_bytes(path))


def _key_bytes(path: Path) -> bytes:
    """The key file's bytes, read only as a plain file no larger than any file pdcompile reads
    whole: PDCOMPILE_KEY naming /dev/zero or a pipe was read forever, a file of gigabytes into
    memory. Raises UnusableKeyError otherwise (OSError where it cannot be read)."""
    try:
        return read_plain_file(path, MAX_JSON_BYTES)
    except NotPlainFile as why:
        if why.kind == "folder":  # the callers say what a folder in the key's place means
            raise IsADirectoryError(f"{path} is a folder") from None
        raise UnusableKeyError(refusal(
            why, path, role="the signing key", limit=MAX_JSON_BYTES,
            because="any file pdcompile reads whole",
            fix="delete it (a new one is made) or set PDCOMPILE_KEY to a path of your own")
        ) from None


def _usable(path: Path, key: bytes) -> bytes:
    """`key` (read from `path`), refused where anyone could sign with it: an empty or short
    file (PDCOMPILE_KEY=/dev/null, a file made by hand), or one others may read."""
    if len(key) < _KEY_BYTES:
        raise UnusableKeyError(f"the signing key {path} holds {len(key)} bytes, fewer than "
                               f"{_KEY_BYTES} random ones; delete it (a new one is made) or "
                               "set PDCOMPILE_KEY to a path of your own")
    if os.name == "posix" and path.stat().st_mode & 0o077:
        raise UnusableKeyError(f"the signing key {path} may be read or written by other users "
                               f"(mode {path.stat().st_mode & 0o777:o}); chmod 600 {path}")
    return key


def _mac(key: bytes, manifest: bytes) -> str:
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def sign(folder: Path, manifest_name: str) -> Path | None:
    """Write the folder's signature of its manifest (call right after writing the manifest).
    Where no key can be made (a read-only home), the export is left unsigned, with a warning:
    loading it then takes trust=True."""
    try:
        key = _key(create=True)
    except OSError as err:
        warnings.warn(f"pdcompile: no signing key could be made or used at {export_key_path()} "
                      f"({err}); "
                      f"{folder} is left unsigned, so loading it takes trust=True; set "
                      "PDCOMPILE_KEY to a file path you can write", stacklevel=3)
        return None
    assert key is not None
    out = folder / SIGNATURE_NAME
    tmp = folder / f".{SIGNATURE_NAME}.{os.getpid()}.tmp"
    tmp.write_text(_mac(key, (folder / manifest_name).read_bytes()) + "\n")
    os.replace(tmp, out)
    return out


def unsigned_reason(folder: Path, manifest_name: str, manifest_data: bytes | None = None
                    ) -> str | None:
    """Why the folder's manifest is not signed by this user's key; None when it is.
    `manifest_data`: the manifest's bytes as the caller read and used them (its files were
    checked against these bytes: the signature must vouch for the same ones, not for a
    manifest put in their place since)."""
    signature = folder / SIGNATURE_NAME
    if not signature.is_file():
        return f"it has no {SIGNATURE_NAME} (written by another tool, or by a version before " \
               "exports were signed)"
    try:
        key = _key(create=False)
    except OSError as err:  # a folder, unreadable, or unusable (UnusableKeyError)
        return f"this user's signing key cannot be used ({err})"
    if key is None:
        return f"this user has no signing key ({export_key_path()}): it was written elsewhere"
    found = _signature_bytes(signature)  # bytes: a signature that is not text differs too
    if found is None:
        return (f"its {SIGNATURE_NAME} is not a plain file of a signature's size (a link, a "
                "pipe or a large file): not one the writer made")
    data = manifest_data
    if data is None:  # read as the loader reads a manifest: a plain file of bounded size
        data = read_json_bytes(folder / manifest_name, fix="export the pipeline again")
    if not hmac.compare_digest(found, _mac(key, data).encode()):
        return f"its {SIGNATURE_NAME} does not match the signing key {export_key_path()}: it " \
               "was written by someone else, or changed after it was written"
    return None


def _signature_bytes(path: Path) -> bytes | None:
    """The signature file's bytes (stripped), or None where it is a link, not a plain file
    (checked on the open file, read without blocking) or larger than any signature: a link to
    a file of gigabytes was read whole before, and a pipe put in its place waited forever."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError:  # ELOOP: a link
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MOST_SIGNATURE_BYTES:
            return None
        return handle.read(_MOST_SIGNATURE_BYTES + 1).strip()


__all__ = ["SIGNATURE_NAME", "UnusableKeyError", "export_key_path", "sign", "unsigned_reason"]
