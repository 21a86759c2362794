"""An export's files read once, each checked against MANIFEST.json as it is read: what the
loader uses is what was checked.

`read_export` reads every file the manifest lists, front to back, hashing each chunk as it
lands (runtime/verified_read.py, the reader checkpoints use too): safetensors files straight
into their tensors, the rest as bytes. The loader then takes everything from `ExportFiles`,
never from the folder again. Before, the folder was hashed first and its files opened again to
load them (safetensors' memory map, JSON, the user's model file), and a file replaced between
the check and the load was loaded unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import DamagedFileError
from pdcompile.export.integrity import FIX, listed_export
from pdcompile.runtime.tensor_tree import tree_skeleton, tree_value
from pdcompile.runtime.verified_read import (
    parse_bytes,
    parse_safetensors,
    parse_safetensors_layout,
    read_checked,
)
from pdcompile.util.manifest import MAX_JSON_BYTES, Manifest


class ExportFiles:
    """Every file of one export, read once and checked (`read_export`)."""

    def __init__(self, manifest: Manifest, *, tensors: bool = True,
                 names: Iterable[str] | None = None) -> None:
        self.manifest = manifest
        self.folder = manifest.path.parent
        self.holds_tensors = tensors
        self._bytes: dict[str, bytes] = {}
        self._tensors: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        self._taken: set[str] = set()
        wanted = None if names is None else set(names)
        for name, entry in sorted(manifest.files.items()):
            if wanted is not None and name not in wanted:
                continue
            path = self.folder / name
            if name.endswith(".safetensors") and tensors:
                self._tensors[name] = read_checked(path, entry, parse_safetensors, fix=FIX,
                                                   kind="export")
            elif name.endswith(".safetensors"):  # the same parser, the tensors not kept
                self._tensors[name] = read_checked(path, entry, parse_safetensors_layout,
                                                   fix=FIX, kind="export")
            else:
                # the largest file of an export read whole (code, JSON, schedule; real
                # ones: kilobytes to a few megabytes), the bound JSON files already had
                if entry.size > MAX_JSON_BYTES:  # before a byte is read (a sparse file of
                    # gigabytes under a manifest written again took minutes and its memory)
                    raise DamagedFileError(
                        f"{path} holds {entry.size:,} bytes by its manifest, more than any "
                        f"file pdcompile writes to be read whole ({MAX_JSON_BYTES:,}); {FIX}")
                self._bytes[name] = read_checked(path, entry, parse_bytes, fix=FIX,
                                                 kind="export")

    def has(self, name: str) -> bool:
        """Whether the export holds a file of this name."""
        return name in self._bytes or name in self._tensors

    def data(self, name: str) -> bytes:
        """A file's bytes as checked."""
        if name not in self._bytes:
            raise self._missing(name)
        return self._bytes[name]

    def text(self, name: str) -> str:
        """A text file's content as checked."""
        try:
            return self.data(name).decode()
        except UnicodeDecodeError:
            raise DamagedFileError(f"{self.folder / name} is not UTF-8 text; {FIX}") from None

    def json(self, name: str) -> Any:
        """A JSON file's content as checked."""
        try:
            return json.loads(self.text(name))
        except (ValueError, RecursionError) as err:
            raise DamagedFileError(f"{self.folder / name} is not valid JSON ({err}); {FIX}") \
                from None

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A plain safetensors file's tensors as checked (each in its own aligned memory; a
        second call gets copies: two holders, replicas of one stage, never share one)."""
        return dict(self._stored(name)[1])

    def tree(self, name: str) -> Any:
        """A tensor-tree file's value (runtime/tensor_tree) as checked (its tensors copies
        on a second call, as `tensors`)."""
        return self._tree(name, *self._stored(name))

    def skeleton(self, name: str) -> Any:
        """A tensor-tree file's JSON part as checked, its tensors left as references (all a
        check that loads nothing reads of it)."""
        if name not in self._tensors:
            raise self._missing(name)
        try:
            return tree_skeleton(self._tensors[name][0], self.folder / name)
        except DamagedFileError as err:
            raise DamagedFileError(f"{str(err).removesuffix('; write it again')}; {FIX}") \
                from None

    def layout(self, name: str) -> dict[str, torch.Tensor]:
        """A plain safetensors file's tensors as meta tensors (shapes and dtypes alone: what a
        check that loads nothing fits to the other files); read without tensors only."""
        return dict(self._layout(name)[1])

    def layout_tree(self, name: str) -> Any:
        """A tensor-tree file's value with its tensors as meta tensors (`layout`)."""
        return self._tree(name, *self._layout(name))

    def _tree(self, name: str, metadata: dict[str, Any], tensors: dict[str, torch.Tensor]
              ) -> Any:
        try:
            return tree_value(metadata, tensors, self.folder / name)
        except DamagedFileError as err:
            raise DamagedFileError(f"{str(err).removesuffix('; write it again')}; {FIX}") \
                from None

    def _layout(self, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if name not in self._tensors:
            raise self._missing(name)
        if self.holds_tensors:
            raise LookupError("these files were read with their tensors (use tensors/tree)")
        return self._tensors[name]

    def _stored(self, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A safetensors file's metadata and tensors: the ones read the first time, copies
        after."""
        if name not in self._tensors:
            raise self._missing(name)
        if not self.holds_tensors:
            raise LookupError("these files were read without their tensors "
                              "(read_export(folder, tensors=False))")
        metadata, tensors = self._tensors[name]
        if name in self._taken:
            return metadata, {key: value.clone() for key, value in tensors.items()}
        self._taken.add(name)
        return metadata, tensors

    def _missing(self, name: str) -> DamagedFileError:
        return DamagedFileError(f"{self.folder / name} is missing from the export (its "
                                f"manifest does not list it); {FIX}")


def read_export(folder: Path, *, tensors: bool = True,
                names: Iterable[str] | None = None) -> ExportFiles:
    """Every file of the export in `folder`, read once and checked against its manifest (and
    no file of the writer's names that the manifest leaves out, export/integrity.py).
    `tensors=False`: safetensors files are read and checked by the same parser, their headers
    kept and their tensors dropped, kept as shapes alone (`layout`: a check that loads nothing,
    `pdcompile verify`, `run`).
    `names`: only these of the listed files (a launcher's look at the plan)."""
    return ExportFiles(listed_export(folder), tensors=tensors, names=names)


__all__ = ["ExportFiles", "read_export"]
