"""A user's own model file in an export: what `pdcompile export FILE.py:factory` records by
import path from that file (the `loss_fn` beside the factory, a leaf module's class, an
optimizer class) names a module no other process can import, so the export keeps a copy of the
file, with its SHA-256, and reading the export imports that copy under the same name.

The imported file is read again (to copy it, and to tell whether a module already imported
under the name is the exported one) only as a plain file of bounded size
(util/bounded_file.py): before, it was read whole, whatever it had become since its import, so
a FIFO in its place hung the export and a huge file filled memory.

    user_code/pdcompile_user_mynet.py   a copy of mynet.py, as it was at export
    pipeline.json "user_modules": {"pdcompile_user_mynet": {"file": "user_code/...",
                                                            "sha256": "..."}}
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.util.bounded_file import (
    NotPlainFile,
    plain_file_bytes,
    read_plain_file,
    refusal,
)
from pdcompile.util.module_file import exec_module_source
from pdcompile.util.user_code import USER_MODULE_PREFIX, user_module_file

FOLDER = "user_code"
MAX_SOURCE_BYTES = 1 << 26  # a model file's source: a larger file is not one a person wrote


def named_user_modules(tree: Any) -> set[str]:
    """The user-file modules named in a JSON tree or a text: import paths ("module:Qual.name")
    and the `import` lines of generated code."""
    if isinstance(tree, dict):
        return set().union(*(named_user_modules(v) for v in tree.values()))
    if isinstance(tree, list | tuple):
        return set().union(*(named_user_modules(v) for v in tree))
    if isinstance(tree, str):
        names = re.findall(rf"{USER_MODULE_PREFIX}[^\s:.,'\"]+", tree)
        return {name for name in names if user_module_file(name) is not None}
    return set()


def save_user_modules(trees: Iterable[Any], out: Path) -> dict[str, dict[str, str]]:
    """Copy the files of the user modules named in `trees` to out/user_code; pipeline.json's
    "user_modules" entry (module name -> file and SHA-256)."""
    folder = out / FOLDER
    for old in folder.glob("*.py"):
        old.unlink()
    saved = {}
    for name in sorted(set().union(*(named_user_modules(t) for t in trees))):
        source = user_module_file(name)
        assert source is not None  # named_user_modules keeps only these
        data = plain_file_bytes(source, MAX_SOURCE_BYTES)
        if data is None:
            raise PipelineInputError(
                f"the model file {source}, which the export copies, is no longer a plain file "
                f"of at most {MAX_SOURCE_BYTES:,} bytes (replaced since its import by a pipe, a "
                "folder or a larger file?); put the model file back and export again")
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.py").write_bytes(data)
        saved[name] = {"file": f"{FOLDER}/{name}.py", "sha256": hashlib.sha256(data).hexdigest()}
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    return saved


def load_user_modules(entries: dict[str, Any], folder: Path,
                      read: Callable[[str], bytes] | None = None) -> None:
    """Import each copied user file under its recorded module name (a module of that name
    already imported from the same content is kept). Raises DamagedFileError when a copy is
    missing or altered, PipelineInputError when its code fails. `read`: a file's bytes by
    name, as the loader read and checked them (export/verified_files.py). The code run is the
    bytes whose SHA-256 was checked, never the file opened again."""
    for name, entry in entries.items():
        try:
            path = folder / entry["file"]
            expected = str(entry["sha256"])
        except (KeyError, TypeError):
            raise DamagedFileError(f"{folder / 'pipeline.json'} has a malformed user_modules "
                                   f"entry {name!r}; export the pipeline again") from None
        try:
            data = _copy_bytes(path) if read is None else read(str(entry["file"]))
        except OSError:
            raise DamagedFileError(f"{path} (the model file the export recorded) is missing; "
                                   "export the pipeline again") from None
        if hashlib.sha256(data).hexdigest() != expected:
            raise DamagedFileError(f"{path} is not the model file that was exported (its "
                                   "SHA-256 differs); export the pipeline again")
        loaded = user_module_file(name)  # the same content is no more bytes than the copy
        imported = None if loaded is None else plain_file_bytes(loaded, len(data))
        if imported is not None and hashlib.sha256(imported).hexdigest() == expected:
            continue
        try:
            source = data.decode()
        except UnicodeDecodeError:
            raise DamagedFileError(f"{path} cannot be imported as Python (not UTF-8 text); "
                                   "export the pipeline again") from None
        try:
            exec_module_source(source, path, name)
        except Exception as err:
            raise PipelineInputError(f"importing {path} (the model file the export recorded) "
                                     f"raised {type(err).__name__}: {err}") from None


def _copy_bytes(path: Path) -> bytes:
    """A copied model file's bytes, read only as a plain file of at most MAX_SOURCE_BYTES
    (no copy the writer made is larger): before, a file of gigabytes in its place (or a pipe)
    was read whole before its SHA-256 refused it."""
    try:
        return read_plain_file(path, MAX_SOURCE_BYTES)
    except NotPlainFile as why:
        raise DamagedFileError(refusal(
            why, path, role="the copy of a model file the export recorded",
            limit=MAX_SOURCE_BYTES, because="any model file the export copies",
            fix="it is not the copy the export wrote; export the pipeline again")) from None


__all__ = ["load_user_modules", "named_user_modules", "save_user_modules"]
