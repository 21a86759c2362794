"""An export's manifest (MANIFEST.json): written last by the writer, verified before any file of
the folder is read or any of its code runs.

`seal_export` lists every file the writer put in the folder with its size and SHA-256
(util/manifest.py); `verified_export` checks them all (the loader instead reads each once,
checked as it is read: export/verified_files.py), and both refuse a folder with files of the
writer's names that the manifest does not list (code, or data such as an example minibatch a
signed export never had); `code_text` hands the loader the text of a generated Python file
exactly as it was checked (read once), so that what runs is what was verified. A manifest
catches damage and edits; it is not a signature (see docs/how-it-works.md, "Trust").
"""

from __future__ import annotations

import re
from pathlib import Path

from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export.signing import SIGNATURE_NAME, sign
from pdcompile.export.user_modules import FOLDER as USER_CODE
from pdcompile.util.manifest import Manifest, read_manifest, read_verified, verify, write_manifest

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_KIND = "export"
FIX = "export the pipeline again"
# every name the writer produces: what a new export replaces, and code the loader may run
_WRITTEN = re.compile(r"^(stage_\d+(\.py|\.safetensors|_modules\.safetensors)|optimizer_\d+"
                      r"\.safetensors|rank_\d+\.py|graph\.py|graph_modules\.safetensors|"
                      r"example\.safetensors|unused\.safetensors|pipeline\.json|plan\.json|"
                      r"schedule\.txt|launch\.sh|README\.md)$")
_CODE = re.compile(r"^(stage_\d+\.py|rank_\d+\.py|graph\.py)$")


def is_written_name(name: str) -> bool:
    """Whether the writer produces a file of this name at the top of an export folder."""
    return bool(_WRITTEN.match(name))


def clear_export(folder: Path) -> None:
    """Remove what an earlier export wrote here (manifest first), so that a folder whose new
    export is interrupted has no manifest and is refused, and no stale stage or rank file
    survives beside a smaller pipeline. pipeline.json stays (the writer has already put its
    placeholder there, export/target_folder.py, and replaces it at the end)."""
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    (folder / SIGNATURE_NAME).unlink(missing_ok=True)
    for path in folder.iterdir():
        stale = path.name.startswith(f".{MANIFEST_NAME}.") and path.name.endswith(".tmp")
        if (_WRITTEN.match(path.name) or stale) and path.is_file() \
                and path.name != "pipeline.json":
            path.unlink()


def seal_export(folder: Path) -> Path:
    """Write the manifest of every file the writer produced in `folder`, and its signature
    (export/signing.py; call last)."""
    (folder / SIGNATURE_NAME).unlink(missing_ok=True)
    names = [p.name for p in folder.iterdir() if p.is_file() and _WRITTEN.match(p.name)]
    names += [f"{USER_CODE}/{p.name}" for p in sorted((folder / USER_CODE).glob("*.py"))]
    manifest = write_manifest(folder, names, kind=MANIFEST_KIND, manifest_name=MANIFEST_NAME)
    sign(folder, MANIFEST_NAME)
    return manifest


def verified_export(path: str | Path) -> Manifest:
    """The export's manifest, every file it lists checked (size, SHA-256); one line naming the
    first file that differs, is missing, or is code the manifest does not list. (The loader
    reads each file once instead, export/verified_files.py: this is for checks that load
    nothing.)"""
    manifest = listed_export(path)
    verify(manifest, fix=FIX)
    return manifest


def listed_export(path: str | Path) -> Manifest:
    """The export's manifest, its files not yet read; one line naming a file of the writer's
    names that it does not list (code, or data such as an example minibatch)."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise PipelineInputError(f"export folder {str(folder)!r} {what}; name a folder written "
                                 "by `pdcompile export` or Pipeline.export(path)")
    if not (folder / MANIFEST_NAME).exists() and not (folder / "pipeline.json").exists():
        raise PipelineInputError(f"{folder} has no pipeline.json; is it a folder written by "
                                 "Pipeline.export or `pdcompile export`?")
    manifest = read_manifest(folder / MANIFEST_NAME, kind=MANIFEST_KIND, fix=FIX)
    for path_ in sorted(folder.iterdir()):  # the writer lists every file of these names
        if _WRITTEN.match(path_.name) and path_.name not in manifest.files:
            what = "code" if _CODE.match(path_.name) else "a file"
            raise DamagedFileError(f"{path_} is not listed in {MANIFEST_NAME}: {what} the "
                                   "export did not write; remove it, or export the pipeline "
                                   "again")
    return manifest


def export_manifest(path: str | Path) -> Manifest:
    """The export's manifest, read (its files not checked: `verified_export` does that)."""
    return read_manifest(Path(path) / MANIFEST_NAME, kind=MANIFEST_KIND, fix=FIX)


def code_text(manifest: Manifest, name: str) -> str:
    """The text of a generated Python file of the export, read once and checked against the
    manifest (the loader compiles this text, never the file again)."""
    data = read_verified(manifest, name, fix=FIX)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise DamagedFileError(f"{manifest.path.parent / name} is not UTF-8 text; {FIX}") \
            from None


def code_files(manifest: Manifest, prefix: str) -> list[str]:
    """The generated Python files of the export whose names start with `prefix`."""
    return sorted(n for n in manifest.files if n.startswith(prefix) and _CODE.match(n))


__all__ = ["FIX", "MANIFEST_NAME", "clear_export", "code_files", "code_text", "export_manifest",
           "is_written_name", "listed_export", "seal_export", "verified_export"]
