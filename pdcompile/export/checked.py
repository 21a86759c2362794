"""An export checked without loading it: what `pdcompile verify` and `pdcompile run` decide from.

Every file the manifest lists is read once, checked against its entry as it is read, by the
reader the loader uses (export/verified_files.py, runtime/verified_read.py): safetensors files
by the same parser (the header, and the tensors' layout against the file's size), their
tensors' bytes hashed and dropped. pipeline.json is checked for its format and fields,
plan.json fitted to the other files (export/plan_file.py), every generated Python file
compiled (not run), each rank file compared with the code generated from schedule.txt
(export/rank_code.py), each stage's optimizer state fitted to its recorded optimizer by the
loader's check on shapes alone (export/optimizer_state.py), and the JSON part of every
tensor-tree file parsed. What the launcher then decides from (the worker count, the modules
the trust check scans) is what was checked here, never a file read again: before, the folder
was hashed first, then its files opened again by safetensors (`safe_open`, whose header check
is not the loader's) and by the trust scan, so a file swapped in between, or a header whose
sizes the loader refuses, passed the check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcompile.errors import DamagedFileError, PdcompileError, PipelineInputError
from pdcompile.export.files import checked_source, folder_path, read_file, read_meta
from pdcompile.export.integrity import FIX, code_files
from pdcompile.export.optimizer_recipe import OptimizerRecipe
from pdcompile.export.optimizer_state import fit_optimizer_state
from pdcompile.export.trust import BASE_PACKAGES
from pdcompile.export.plan_file import export_plan
from pdcompile.export.rank_code import check_rank_code, generated_sources
from pdcompile.export.verified_files import ExportFiles, read_export
from pdcompile.plan import Plan
from pdcompile.schedule.ir import Schedule
from pdcompile.util.manifest import Manifest

# the files the loader reads as tensor trees (runtime/tensor_tree): optimizer states, the
# example minibatch, and the module records of the stages and of the graph
_TREE_FILE = re.compile(r"^(optimizer_\d+|example|stage_\d+_modules|graph_modules)"
                        r"\.safetensors$")


@dataclass(frozen=True)
class CheckedExport:
    """What `checked_export` read of an export, each file once and checked."""

    folder: Path
    meta: dict[str, Any]  # pipeline.json
    plan: Plan  # plan.json, fitted to the other files
    manifest: Manifest
    code: dict[str, str]  # the generated Python files' text (compiled, not run), by name
    trees: dict[str, Any]  # the recorded module files' JSON parts (what they name), by name


def checked_export(path: str | Path) -> CheckedExport:
    """Check an export folder without loading it (module docstring); one line naming the first
    file that is missing, damaged, altered or does not fit the others."""
    folder = folder_path(path, "check_export")
    if folder.exists() and not folder.is_dir():
        raise PipelineInputError(f"{folder} is a file, not an export folder; name the folder "
                                 "written by Pipeline.export or `pdcompile export`")
    if not folder.is_dir():
        raise PipelineInputError(f"export folder {str(folder)!r} does not exist; write one with "
                                 "`pdcompile export` or Pipeline.export(path)")
    read_meta(folder)  # the format named first, as the loader names it
    files = read_export(folder, tensors=False)
    meta = read_meta(folder, files.text("pipeline.json"))
    for name in _expected(meta):
        if not files.has(name):
            raise DamagedFileError(f"{folder / name} is missing from the export; {FIX}")
    trees = {name: files.skeleton(name) for name in sorted(files.manifest.files)
             if _TREE_FILE.match(name)}  # what the loader reads as trees: their JSON parts
    plan = export_plan(files, meta)
    code = {name: checked_source(files.text(name), folder / name)
            for name in code_files(files.manifest, "")}
    # each rank file is what codegen makes of schedule.txt (export_plan fitted schedule.txt to
    # the plan's ranks; the loader also checks it is the schedule the plan makes)
    schedule = read_file(folder / "schedule.txt",
                         lambda _: Schedule.from_text(files.text("schedule.txt")))
    check_rank_code(folder, {int(name[len("rank_"):-len(".py")]): code[name]
                             for name in code_files(files.manifest, "rank_")},
                    generated_sources(schedule))
    _check_optimizer_states(files, meta)
    recorded = {name: tree for name, tree in trees.items()
                if name.endswith("_modules.safetensors")}
    return CheckedExport(folder, meta, plan, files.manifest, code, recorded)


def check_export(path: str | Path) -> dict[str, Any]:
    """Check an export folder without loading it (`checked_export`), so that a launcher can
    refuse a damaged one in one line before starting workers; its pipeline.json."""
    return checked_export(path).meta


def _check_optimizer_states(files: ExportFiles, meta: dict[str, Any]) -> None:
    """Each stage's optimizer state fitted by the loader's check (export/optimizer_state.py) to
    the optimizer the loader builds from its recipe, built here over parameters of the stage's
    shapes alone (meta tensors). Not checked here: a stage whose optimizer was not recorded
    (none, or one load must be given), or whose class is not torch's or pdcompile's (the
    user's code, which a check runs none of): the loader fits those to the optimizer it gets."""
    folder = files.folder
    for index, recorded in enumerate(meta["optimizers"]):
        if recorded is None:
            continue
        try:
            recipe = OptimizerRecipe.from_dict(recorded)
        except (KeyError, TypeError, ValueError):
            raise DamagedFileError(f"{folder / 'pipeline.json'} has a malformed optimizer of "
                                   f"stage {index}; {FIX}") from None
        if recipe.cls.split(".")[0] not in BASE_PACKAGES:
            continue
        params = read_file(folder / f"stage_{index}.safetensors",
                           lambda _, i=index: files.layout(f"stage_{i}.safetensors"))
        try:
            optimizer = recipe.build(params)
        except PdcompileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DamagedFileError(f"{folder / 'pipeline.json'} records an optimizer of stage "
                                   f"{index} that cannot be built ({detail}); {FIX}") from None
        name = f"optimizer_{index}.safetensors"
        state = read_file(folder / name, lambda _, n=name: files.layout_tree(n))
        fit_optimizer_state(optimizer, state, folder / name)


def _expected(meta: dict[str, Any]) -> list[str]:
    """The files an export with this pipeline.json must hold."""
    names = ["plan.json", "schedule.txt"]
    for i, stage in enumerate(meta["stages"]):
        names += [f"stage_{i}.py", f"stage_{i}.safetensors", f"optimizer_{i}.safetensors"]
        if stage.get("recorded_modules"):
            names.append(f"stage_{i}_modules.safetensors")
    example = meta.get("example")
    if isinstance(example, dict) and example.get("inputs"):
        names.append("example.safetensors")
    if meta.get("unused"):
        names.append("unused.safetensors")
    return names


__all__ = ["CheckedExport", "check_export", "checked_export"]
