"""The files of an export folder: its format tag, pipeline.json read and checked, generated
Python checked to compile, and any file that cannot be made sense of named in one line (the
check of a whole folder without loading it is export/checked.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.util.manifest import read_json_text

EXPORT_FORMAT = "pdcompile.export/3"  # 3: generated code names the modules in their rooms
# what to pass instead of a loss function or optimizer an export could not record
UNSAVED_FIX = {
    "loss_fn": "Use a function with an import path (e.g. torch.nn.functional.cross_entropy, a "
               "function in an importable module, a functools.partial of one, or a torch.nn "
               "loss module).",
    "optimizer": "Use an optimizer class with an import path (any torch.optim optimizer, made "
                 "by a lambda or a partial, is fine)."}


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


def read_file(path: Path, reader: Callable[[Path], Any]) -> Any:
    """`reader(path)`, with any failure to make sense of the file as one line naming it."""
    try:
        return reader(path)
    except DamagedFileError:
        raise
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing from the export; export the pipeline "
                               "again") from None
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedFileError(f"{path} is truncated, altered or not a file pdcompile wrote "
                               f"({detail}); export the pipeline again") from None


__all__ = ["EXPORT_FORMAT", "UNSAVED_FIX", "checked_source", "folder_path", "read_file",
           "read_meta"]
