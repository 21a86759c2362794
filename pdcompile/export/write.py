"""Writing an export: `export_pipeline` (what `Pipeline.export` calls) puts a pipeline's stage
code, weights, optimizer states, generated rank loops, plan, schedule, example minibatch and
launch files in a folder (the list is in the package docstring).
"""

from __future__ import annotations

import json
import shlex
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.fx as fx
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

from pdcompile.export.callable_ref import reference
from pdcompile.export.files import EXPORT_FORMAT, UNSAVED_FIX, folder_path
from pdcompile.export.import_paths import NotReferable
from pdcompile.export.integrity import clear_export, seal_export
from pdcompile.export.module_record import record_module
from pdcompile.export.optimizer_recipe import OptimizerRecipe
from pdcompile.export.plan_file import (
    gone_nodes,
    moved_nodes,
    plan_digest,
    recorded_stages,
    unnamed_nodes,
)
from pdcompile.export.source import module_source, tensor_state
from pdcompile.export.target_folder import (
    OLD_FILE,
    mark_export_folder,
    prepare_folder,
    replace_text,
    writing_lock,
)
from pdcompile.export.trust import export_modules
from pdcompile.export.user_modules import save_user_modules
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.passes.split import SplitResult, StageProgram
from pdcompile.plan import Plan
from pdcompile.runtime.microbatch_cut import BatchDims
from pdcompile.runtime.rank_state import NoParameters, RankState
from pdcompile.runtime.tensor_tree import save_tree
from pdcompile.schedule.ir import Schedule
from pdcompile.util.module_copy import copy_module


class Exportable(Protocol):
    """What an export reads of a pipeline (`pdcompile.pipeline.Pipeline` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def schedule_name(self) -> str: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def per_minibatch(self) -> int: ...
    @property
    def stash(self) -> bool: ...
    @property
    def vertical_sync(self) -> bool: ...
    @property
    def clip_grad_norm(self) -> float | None: ...
    @property
    def autocast(self) -> str | None: ...
    @property
    def unbatched(self) -> tuple[str, ...]: ...
    @property
    def whole_inputs(self) -> tuple[str, ...]: ...
    @property
    def batch_dims(self) -> BatchDims: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def parts(self) -> SplitResult: ...
    @property
    def graph(self) -> fx.GraphModule | None: ...
    @property
    def graph_stages(self) -> dict[str, int]: ...
    @property
    def stage_modules(self) -> list[fx.GraphModule]: ...
    @property
    def example_inputs(self) -> tuple[Any, ...] | None: ...
    @property
    def example_target(self) -> Any: ...
    @property
    def seed(self) -> int: ...
    @property
    def loss_fn(self) -> Callable[..., torch.Tensor] | None: ...
    @property
    def input_shapes(self) -> InputShapes | None: ...

    def schedule_length(self) -> int: ...
    def schedule(self, microbatches: int | None = None,
                 per_minibatch: int | None = None) -> Schedule: ...
    def rank_sources(self, microbatches: int | None = None,
                     per_minibatch: int | None = None) -> dict[int, str]: ...
    def state(self, rank: int, stage: int) -> RankState: ...
    def summary(self) -> str: ...


def export_pipeline(pipe: Exportable, path: str | Path) -> Path:
    """Write `pipe` to the folder `path` (created; an earlier export's files in it are
    replaced, a folder of other files whose names it would take is refused:
    export/target_folder.py), its manifest (MANIFEST.json, export/integrity.py) last."""
    out = folder_path(path, "pipe.export")
    prepare_folder(out)
    with writing_lock(out):
        return _write(pipe, out)


def _write(pipe: Exportable, out: Path) -> Path:
    """export_pipeline's work, in a folder prepared and locked for it."""
    mark_export_folder(out, EXPORT_FORMAT)  # first: a writer stopped from here on left an export
    clear_export(out)
    for old in out.iterdir():
        if OLD_FILE.match(old.name) and old.is_file():
            old.unlink()
    records: list[dict[str, Any]] = []  # the stages' module records, which name classes
    stages_meta = [_save_stage(pipe, program, module, out, records)
                   for program, module in zip(pipe.parts.stages, pipe.stage_modules, strict=True)]
    n, per = pipe.schedule_length(), pipe.per_minibatch
    for old in out.glob("rank_*.py"):
        old.unlink()
    for rank, source in pipe.rank_sources(n, per).items():
        (out / f"rank_{rank}.py").write_text(source)
    plan_text = pipe.plan.to_json()
    (out / "plan.json").write_text(plan_text)
    (out / "schedule.txt").write_text(pipe.schedule(n, per).to_text())
    _save_graph(pipe.graph, out)
    unused = out / "unused.safetensors"  # the model's tensors no stage holds (SplitResult.unused)
    if pipe.parts.unused:
        save_file({k: v.contiguous() for k, v in pipe.parts.unused.items()}, str(unused))
    else:
        unused.unlink(missing_ok=True)
    example = out / "example.safetensors"  # one minibatch as compiled: shape checks, default data
    if pipe.example_inputs is not None:
        save_tree(example, {"inputs": list(pipe.example_inputs), "target": pipe.example_target},
                  where="the example minibatch")
    else:
        example.unlink(missing_ok=True)
    meta = {
        "format": EXPORT_FORMAT, "name": pipe.name, "schedule": pipe.schedule_name,
        "microbatches": pipe.microbatches, "schedule_length": n, "per_minibatch": per,
        "stash": pipe.stash, "vertical_sync": pipe.vertical_sync, "seed": pipe.seed,
        "clip_grad_norm": pipe.clip_grad_norm, "autocast": pipe.autocast,
        "unbatched": list(pipe.unbatched), "whole_inputs": list(pipe.whole_inputs),
        "batch_dims": pipe.batch_dims.to_json(),
        "training_branches": list(pipe.training_branches),
        "data_inputs": list(pipe.parts.data_inputs),
        "output_refs": [[r.name, r.stage] for r in pipe.parts.output_refs],
        "output_spec": pytree.treespec_dumps(pipe.parts.output_spec),
        "ties": [{"name": t.name, "members": [list(m) for m in t.members]}
                 for t in pipe.parts.ties],
        "stages": stages_meta, "graph_stages": pipe.graph_stages,
        "unused": bool(pipe.parts.unused),
        "example": {"inputs": pipe.example_inputs is not None,
                    "target": pipe.example_target is not None},
        "input_shapes": None if pipe.input_shapes is None else pipe.input_shapes.to_json(),
        **_callables(pipe),
    }
    # the plan's nodes the split ran in another stage, and the graph's nodes the plan does not
    # name (made after planning): plan_file.py checks plan.json node by node against them
    meta["plan_moved"] = moved_nodes(pipe.plan, recorded_stages(meta))
    meta["plan_unnamed"] = unnamed_nodes(pipe.plan, recorded_stages(meta))
    meta["plan_gone"] = gone_nodes(pipe.plan, meta["graph_stages"])  # the split replaced them
    meta["plan_sha256"] = plan_digest(plan_text)  # the plan's predictions, checked whole
    code = {p.name: p.read_text() for p in [*out.glob("stage_*.py"), *out.glob("rank_*.py"),
                                           *out.glob("graph.py")]}
    meta["user_modules"] = save_user_modules([meta, records, list(code.values())], out)
    meta["modules"] = export_modules(out, meta, code)  # the user's modules load may import
    replace_text(out / "pipeline.json", json.dumps(meta, indent=1))  # the placeholder's place
    workers = pipe.plan.workers
    command = f"pdcompile run {shlex.quote(str(out))}"
    (out / "launch.sh").write_text(
        "#!/bin/sh\n# Train this pipeline on " + str(workers) + " local processes; add --nnodes "
        "and --master-addr for several machines.\nexec pdcompile run \"$(dirname \"$0\")\" "
        f"--nproc {workers} \"$@\"\n")
    (out / "launch.sh").chmod(0o755)
    (out / "README.md").write_text(
        f"# {pipe.name}: pipeline exported by pdcompile\n\n"
        f"Schedule `{pipe.schedule_name}`, configuration {pipe.plan.config} on {workers} "
        f"workers.\n\nRun it (the saved example minibatch, again and again; `--data "
        f"FILE.py:FUNCTION` for real data, `--steps N`):\n\n    {command}\n\nor `./launch.sh`. "
        f"Reload it in Python with `pdcompile.load({str(out)!r})`.\n\n"
        "The `.py` files here are code that `pdcompile run` and `pdcompile.load` run (the stage "
        "modules and the generated loop of each rank), and loading imports the modules that "
        "pipeline.json names: load only exports you trust. The other files are data "
        "(safetensors and JSON, no pickle). MANIFEST.json holds the size and SHA-256 of every "
        "file; `pdcompile verify` checks them without running anything.\n\n"
        f"```\n{pipe.summary()}\n```\n")
    seal_export(out)  # last: a folder whose writer was stopped has no (matching) manifest
    return out


def _save_stage(pipe: Exportable, program: StageProgram, module: fx.GraphModule, out: Path,
                records_out: list[dict[str, Any]]) -> dict[str, Any]:
    """Write one stage's source, weights, submodule records (also appended to `records_out`)
    and optimizer state; its meta."""
    i = program.index
    source, recorded = module_source(
        module, f"Stage{i}", doc=f"Stage {i} of {len(pipe.parts.stages)} of a pdcompile "
        f"pipeline of {pipe.name}: torch.fx code of the stage; weights in "
        f"stage_{i}.safetensors.")
    (out / f"stage_{i}.py").write_text(source)
    modules_file = out / f"stage_{i}_modules.safetensors"
    if recorded:
        tensors: dict[str, torch.Tensor] = {}
        records = {name: record_module(child, tensors=tensors, where=f"stage {i} submodule "
                                       f"{name!r}")[0] for name, child in recorded.items()}
        save_tree(modules_file, {"records": records, "tensors": tensors})
        records_out.append(records)
    else:
        modules_file.unlink(missing_ok=True)
    state, aliases = tensor_state(module)
    save_file(state, str(out / f"stage_{i}.safetensors"))
    rank = pipe.state(pipe.plan.stages[i].ranks[0], i)
    save_tree(out / f"optimizer_{i}.safetensors", rank.optimizer.state_dict(),
              where=f"the optimizer state of stage {i}")
    return {
        "inputs": [[r.name, r.stage] for r in program.inputs],
        "outputs": list(program.outputs),
        "receives": {str(k): list(v) for k, v in program.receives.items()},
        "sends": {str(k): list(v) for k, v in program.sends.items()},
        "param_names": {k: list(v) for k, v in program.param_names.items()},
        "buffer_names": {k: list(v) for k, v in program.buffer_names.items()},
        "param_order": list(rank.param_order),
        "aliases": aliases,
        "recorded_modules": sorted(recorded),
        "kinds": dict(program.kinds),
        "transient_buffers": list(program.transient_buffers),
        # frozen parameters (requires_grad=False): a loaded stage builds its layers anew, which
        # would train them
        "frozen": sorted(name for name, p in module.named_parameters(remove_duplicate=False)
                         if not p.requires_grad),
        # the stage's mode, and its layers in another (a BatchNorm frozen in eval mode inside a
        # training model): layers written as source are built anew in training mode
        "training": module.training,
        "other_mode": sorted(name for name, m in module.named_modules()
                             if name and m.training != module.training),
    }


def _callables(pipe: Exportable) -> dict[str, Any]:
    """pipeline.json's "loss_fn" (a reference, callable_ref) and "optimizers" (one recipe per
    stage, None for a stage without parameters); what cannot be written down is named under
    "not_saved" (load then asks for it) and warned about now."""
    out: dict[str, Any] = {"loss_fn": None, "optimizers": [], "not_saved": {}}
    if pipe.loss_fn is not None:
        try:
            out["loss_fn"] = reference(pipe.loss_fn)
        except NotReferable as err:
            out["not_saved"]["loss_fn"] = str(err)
    for index, stage in enumerate(pipe.plan.stages):
        rank = pipe.state(stage.ranks[0], index)
        if isinstance(rank.optimizer, NoParameters):
            out["optimizers"].append(None)
            continue
        named = dict(rank.module.named_parameters())
        try:
            recipe = OptimizerRecipe.of(rank.optimizer, rank.param_order,
                                        [named[n] for n in rank.param_order])
            out["optimizers"].append(recipe.to_dict())
        except NotReferable as err:
            out["optimizers"].append(None)
            out["not_saved"]["optimizer"] = f"{type(rank.optimizer).__name__}: {err}"
    lost = out["not_saved"]
    if lost:
        why = "; ".join(f"{what}: {reason}" for what, reason in lost.items())
        warnings.warn(f"the {' and '.join(lost)} cannot be saved in the export ({why}); "
                      "pdcompile.load will ask for it and `pdcompile run` cannot train it. "
                      + " ".join(UNSAVED_FIX[what] for what in lost), UserWarning, stacklevel=4)
    return out


def _save_graph(graph: fx.GraphModule | None, folder: Path) -> None:
    """The traced graph as source (graph.py) with its submodules recorded on the meta device
    (no weights: those live in the stages); best effort, the graph is informational. The stage
    of each of its nodes (`graph_stages` in pipeline.json) is recorded even where the graph
    cannot be saved: plan.json is checked against it (export/plan_file.py)."""
    for old in (folder / "graph.py", folder / "graph_modules.safetensors"):
        old.unlink(missing_ok=True)
    if graph is None:
        return
    try:
        light = copy_module(graph).to("meta")
        source, recorded = module_source(light, "Graph", doc="The traced model (structure only).")
        tensors: dict[str, torch.Tensor] = {}
        records = {name: record_module(child, tensors=tensors)[0]
                   for name, child in recorded.items()}
        save_tree(folder / "graph_modules.safetensors", {"records": records, "tensors": tensors})
        (folder / "graph.py").write_text(source)
    except Exception:  # e.g. a module attribute with no JSON form: the graph is optional
        (folder / "graph_modules.safetensors").unlink(missing_ok=True)


__all__ = ["Exportable", "export_pipeline"]
