"""The files of an export folder: its format tag, pipeline.json read and checked, and a check of
the whole folder without loading it (headers and syntax only), so that a launcher can refuse a
damaged one in one line before starting workers; any file that cannot be read is named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export.integrity import verified_export
from pdcompile.util.manifest import read_json_text

EXPORT_FORMAT = "pdcompile.export/3"  # 3: generated code names the modules in their rooms
# what to pass instead of a loss function or optimizer an export could not record
UNSAVED_FIX = {
    "loss_fn": "Use a function with an import path (e.g. torch.nn.functional.cross_entropy, a "
               "function in an importable module, a functools.partial of one, or a torch.nn "
               "loss module).",
    "optimizer": "Use an optimizer class with an import path (any torch.optim optimizer, made "
                 "by a lambda or a partial, is fine)."}


def plan_workers(folder: str | os.PathLike[str]) -> int | None:
    """The workers the export's plan uses (plan.json's `workers`: the processes a launcher
    starts, fewer than asked where the planner left workers idle), or None where the file is
    missing or gives no count (the load that follows names what is wrong)."""
    try:
        data = json.loads((Path(folder) / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    workers = data.get("workers") if isinstance(data, dict) else None
    return workers if isinstance(workers, int) and not isinstance(workers, bool) else None


def folder_path(path: Any, call: str) -> Path:
    """`path` as an export folder: a string or os.PathLike naming one. Another value (a number,
    None, bytes) raised os's TypeError ('expected str, bytes or os.PathLike object'), and an
    empty string named the current folder. `call`: the call, as the message writes it."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if isinstance(text, str) and text:
        return Path(text)
    raise PipelineInputError(f"{call}({path!r}): give the export folder as a string or a "
                             f"pathlib.Path, e.g. {call}('vgg16-pipeline')")


def read_meta(folder: Path, text: str | None = None) -> dict[str, Any]:
    """pipeline.json of an export, checked for its format (clear errors otherwise); `text`:
    its content as already read and checked against the manifest (the loader's), else the
    file is read."""
    try:
        meta = json.loads(read_json_text(folder / "pipeline.json", fix="export the pipeline "
                                         "again") if text is None else text)
    except DamagedFileError:
        raise
    except FileNotFoundError:
        raise PipelineInputError(f"{folder} has no pipeline.json; is it a folder written by "
                                 "Pipeline.export or `pdcompile export`?") from None
    except NotADirectoryError:
        raise PipelineInputError(f"{folder} is a file, not an export folder; name the folder "
                                 "written by Pipeline.export or `pdcompile export`") from None
    except IsADirectoryError:
        raise DamagedFileError(f"{folder / 'pipeline.json'} is a folder, not the export's "
                               "JSON file; export the pipeline again") from None
    except (ValueError, RecursionError) as err:  # RecursionError: nested past json's depth
        raise DamagedFileError(f"{folder / 'pipeline.json'} is not valid JSON ({err}); export "
                               "the pipeline again") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        older = {"pdcompile.export/1": " (an older pdcompile's, which held pickles)",
                 "pdcompile.export/2": " (an older pdcompile's, whose generated code imports "
                                       "modules that have moved since)"}.get(str(found), "")
        raise PipelineInputError(f"{folder}/pipeline.json is format {found!r}{older}, expected "
                                 f"{EXPORT_FORMAT!r}; export the pipeline again with this "
                                 "pdcompile")
    shapes = {"stages": list, "optimizers": list, "data_inputs": list, "output_refs": list,
              "ties": list, "output_spec": str, "schedule": str, "name": str}
    wrong = [k for k, kind in shapes.items() if not isinstance(meta.get(k), kind)]
    if wrong or len(meta["optimizers"]) != len(meta["stages"]) or not all(
            isinstance(stage, dict) for stage in meta["stages"]):
        raise DamagedFileError(f"{folder / 'pipeline.json'} is altered or incomplete "
                               f"({', '.join(wrong) or 'stages'} missing or malformed); export "
                               "the pipeline again")
    return meta


def check_export(path: str | Path) -> dict[str, Any]:
    """Check an export folder without loading it (cheap: headers and syntax only), so that a
    launcher can refuse a damaged one in one line before starting workers; its pipeline.json.
    """
    folder = folder_path(path, "check_export")
    if folder.exists() and not folder.is_dir():
        raise PipelineInputError(f"{folder} is a file, not an export folder; name the folder "
                                 "written by Pipeline.export or `pdcompile export`")
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise PipelineInputError(f"export folder {str(folder)!r} {what}; write one with "
                                 "`pdcompile export` or Pipeline.export(path)")
    meta = read_meta(folder)
    verified_export(folder)  # every file against the manifest (sizes and SHA-256)
    tensor_files = [folder / "plan.json"]
    for i, stage in enumerate(meta["stages"]):
        tensor_files += [folder / f"stage_{i}.safetensors", folder / f"optimizer_{i}.safetensors"]
        if stage.get("recorded_modules"):
            tensor_files.append(folder / f"stage_{i}_modules.safetensors")
    if meta.get("example", {}).get("inputs"):
        tensor_files.append(folder / "example.safetensors")
    if meta.get("unused"):
        tensor_files.append(folder / "unused.safetensors")
    for file in tensor_files:
        if not file.is_file():
            raise DamagedFileError(f"{file} is missing from the export; export the pipeline "
                                   "again")
        if file.suffix == ".json":
            read_file(file, lambda p: json.loads(p.read_text()))
        else:
            read_file(file, _header)
    sources = [folder / f"stage_{i}.py" for i in range(len(meta["stages"]))]
    for file in [*sources, *sorted(folder.glob("rank_*.py"))]:
        python_source(file)
    return meta


def python_source(file: Path) -> str:
    """The text of an exported Python file, checked to compile (one line naming it if not)."""
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise DamagedFileError(f"{file} is missing from the export; export the pipeline "
                               "again") from None
    return checked_source(text, file)


def checked_source(text: str, file: Path) -> str:
    """`text` (of the exported file `file`), checked to compile (one line naming it if not)."""
    try:
        compile(text, str(file), "exec")
    except (SyntaxError, ValueError) as err:
        line = getattr(err, "lineno", None)
        raise DamagedFileError(f"{file} is not valid Python ({type(err).__name__}"
                               f"{f', line {line}' if line else ''}); export the pipeline "
                               "again") from None
    return text


def _header(path: Path) -> None:
    """Open a safetensors file's header (its size and layout are checked against the file)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        handle.keys()


def read_file(path: Path, reader: Callable[[Path], Any]) -> Any:
    """`reader(path)`, with any failure to make sense of the file as one line naming it."""
    try:
        return reader(path)
    except DamagedFileError:
        raise
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing from the export; export the pipeline "
                               "again") from None
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedFileError(f"{path} is truncated, altered or not a file pdcompile wrote "
                               f"({detail}); export the pipeline again") from None


__all__ = ["EXPORT_FORMAT", "UNSAVED_FIX", "check_export", "checked_source",
           "python_source",
           "read_file", "read_meta"]
