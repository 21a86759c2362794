"""The folder an export is written into: only pdcompile's own files in it are replaced.

Writing an export removes what an earlier export left (export/integrity.py `clear_export`) and
writes files with fixed names (README.md, graph.py, plan.json, launch.sh...). In a folder that
holds no export those names may be the user's own files, so such a folder is refused in one
line before anything is removed or written; a folder that is an export (its pipeline.json or
MANIFEST.json says so: the writer puts a pipeline.json there before any other file, so an
export stopped midway is one too), an empty one and one without such names are written as
before. In an export folder, an entry with one of those names that is a symbolic link is
removed, link only, so that nothing is written or deleted where it points, outside the folder.
One writer at a time: a second export into a folder being written is refused (`writing_lock`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdcompile.errors import PipelineInputError
from pdcompile.export.integrity import MANIFEST_NAME, is_written_name
from pdcompile.export.signing import SIGNATURE_NAME
from pdcompile.export.user_modules import FOLDER as USER_CODE

# the files of the first export format (pickles): removed when such a folder is exported again
OLD_FILE = re.compile(r"^(callables\.pkl|example\.pt|graph_modules\.pt|optimizer_\d+\.pt|"
                      r"stage_\d+_modules\.pt)$")
_FORMAT_PREFIX = "pdcompile.export/"
_MARKER_LIMIT = 1 << 26  # bytes of pipeline.json read to tell whether a folder is an export
_SHOWN = 4
LOCK_NAME = ".export.lock"


def replaced_name(name: str) -> bool:
    """Whether writing an export replaces or removes an entry of this name."""
    return (is_written_name(name) or bool(OLD_FILE.match(name))
            or name in (MANIFEST_NAME, SIGNATURE_NAME, USER_CODE))


def prepare_folder(folder: Path) -> None:
    """Make `folder` (created if need be) ready for an export: refuse one that holds files of
    the user's that the export would replace (module docstring), and remove links that bear
    the export's names, so that no write follows them out of the folder."""
    taken = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:  # mkdir raised FileExistsError or NotADirectoryError
        raise PipelineInputError(f"cannot export into {folder}: {taken} is a file, not a "
                                 "folder; export into a new or empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    entries = sorted(folder.iterdir())
    if not is_export_folder(folder):
        theirs = [p.name for p in entries if replaced_name(p.name)]
        if theirs:
            shown = ", ".join(theirs[:_SHOWN]) + (", ..." if len(theirs) > _SHOWN else "")
            raise PipelineInputError(
                f"{folder} is not an export folder but holds {shown}, which writing an export "
                "there would replace; export into a new or empty folder (or an earlier "
                "export's), or move those files away")
    for path in entries:
        if path.is_symlink() and replaced_name(path.name):
            path.unlink()


@contextmanager
def writing_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's writer lock (`.export.lock`, an advisory lock of the OS) while an
    export is written: a second writer at the same time is refused in one line instead of
    mixing its files with the first's under one manifest (two pipelines' stages, a manifest
    that lists both). Where the OS has no such locks (not POSIX), nothing is held."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (Windows)
        yield
        return
    with open(folder / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PipelineInputError(f"another export is being written into {folder} right now "
                                     "(its .export.lock is held); wait for it to finish, or "
                                     "export into another folder") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def is_export_folder(folder: Path) -> bool:
    """Whether `folder` holds a pdcompile export, whole or stopped midway (its pipeline.json
    or MANIFEST.json says so)."""
    meta = _small_json(folder / "pipeline.json")
    if isinstance(meta, dict) and str(meta.get("format", "")).startswith(_FORMAT_PREFIX):
        return True
    manifest = _small_json(folder / MANIFEST_NAME)
    return isinstance(manifest, dict) and manifest.get("kind") == "export"


def mark_export_folder(folder: Path, export_format: str) -> None:
    """Put a placeholder pipeline.json in `folder` first (the writer replaces it at its end),
    so that a folder whose writer was stopped is still known as an export; loading it is
    refused, as its manifest is missing."""
    replace_text(folder / "pipeline.json",
                 json.dumps({"format": export_format, "incomplete": True}))


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _small_json(path: Path) -> object:
    """The JSON of a regular file that is not too big; None for anything else."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MARKER_LIMIT:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


__all__ = ["LOCK_NAME", "OLD_FILE", "is_export_folder", "mark_export_folder", "prepare_folder",
           "replace_text", "replaced_name", "writing_lock"]
