"""Reading an export: `load_pipeline` (what `pdcompile.load` calls) rebuilds the Pipeline from
its folder, with the same weights, optimizer state and generated code; the stage and rank files
are imported as code (see the package docstring), everything else is read as data.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import DamagedFileError, PdcompileError, PipelineInputError
from pdcompile.export.callable_ref import resolve
from pdcompile.export.files import (
    UNSAVED_FIX,
    checked_source,
    folder_path,
    read_file,
    read_meta,
)
from pdcompile.export.integrity import FIX, MANIFEST_NAME, code_files
from pdcompile.export.module_record import rebuild_module
from pdcompile.export.ops_tracer import OpsTracer
from pdcompile.export.optimizer_recipe import OptimizerRecipe
from pdcompile.export.optimizer_state import fit_optimizer_state
from pdcompile.export.plan_file import export_plan, schedule_misfit
from pdcompile.export.rank_code import check_rank_code
from pdcompile.export.signing import unsigned_reason
from pdcompile.export.trust import check_imports
from pdcompile.export.user_modules import load_user_modules
from pdcompile.export.verified_files import ExportFiles, read_export
from pdcompile.meta import set_stage
from pdcompile.passes.crossing import flatten_value, load_spec, rebuild_value
from pdcompile.passes.dense_constants import densify_constants
from pdcompile.passes.inplace import changed_alias, clone_leaves, set_item
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.passes.size_tests import SizeTestError
from pdcompile.passes.split import SplitResult, StageProgram, TiedParameter, ValueRef
from pdcompile.pipeline import OptimizerFactory, Pipeline
from pdcompile.runtime import function_call  # noqa: F401 - registers the operator stage code calls
from pdcompile.runtime.conv_grads import conv_deferrable
from pdcompile.runtime.grad_mode import detached
from pdcompile.runtime.linear_grads import linear_accumulate
from pdcompile.runtime.microbatch_cut import BatchDims, checked_whole
from pdcompile.runtime.rank_state import NoParameters, RankState
from pdcompile.schedule.ir import Schedule
from pdcompile.util.attr_path import get_path, set_path
from pdcompile.util.module_file import exec_module_source


def _whole(folder: Path, meta: dict[str, Any], key: str, default: Sequence[str]
           ) -> tuple[str, ...]:
    """pipeline.json's inputs given whole to every microbatch (`key`: those the user named,
    or all), checked against the pipeline's inputs."""
    try:
        return checked_whole(meta.get(key, default), meta["data_inputs"])
    except PipelineInputError:
        raise DamagedFileError(f"{folder / 'pipeline.json'} has {key}={meta.get(key)!r}, "
                               "which are not all inputs of the pipeline; export the pipeline "
                               "again") from None


def _batch_dims(folder: Path, meta: dict[str, Any]) -> BatchDims:
    """pipeline.json's batch dimensions (none recorded: dimension 0, as exports made before
    compile took `batch_dim=`), checked against the pipeline's inputs."""
    try:
        dims = BatchDims.from_json(meta.get("batch_dims"))
    except (TypeError, ValueError, AttributeError):
        dims = None
    if dims is None or any(name not in meta["data_inputs"] for name in dims.inputs) or min(
            (dims.default, dims.target, *dims.inputs.values())) < 0:
        raise DamagedFileError(f"{folder / 'pipeline.json'} has batch_dims="
                               f"{meta.get('batch_dims')!r}, which are not dimensions of the "
                               "pipeline's inputs; export the pipeline again")
    return dims


def load_pipeline(path: str | Path, *, loss_fn: Callable[..., torch.Tensor] | None = None,
                  optimizer: OptimizerFactory | None = None, trust: bool = False) -> Pipeline:
    """A Pipeline from an exported folder: same weights, optimizer state and generated code.
    `loss_fn` / `optimizer`: use these instead of the recorded ones (or where none could be
    recorded). Every file is first checked against the export's manifest, and the modules it
    names against its trust boundary (export/trust.py; `trust=True` lifts that check)."""
    folder = folder_path(path, "pdcompile.load")
    if not isinstance(trust, bool):  # trust="no" is a true value: it lifted the check
        raise PipelineInputError(f"pdcompile.load(trust={trust!r}): give True or False")
    if folder.exists() and not folder.is_dir():
        raise PipelineInputError(f"{str(folder)!r} is a file, not an export folder; name a "
                                 "folder written by `pdcompile export` or Pipeline.export(path)")
    read_meta(folder)  # JSON only: its format is named before anything else
    files = read_export(folder)  # every file read once, checked: nothing is read again
    meta = read_meta(folder, files.text("pipeline.json"))
    code = {name: checked_source(files.text(name), folder / name)
            for name in code_files(files.manifest, "")}
    records = {name: read_file(folder / name, lambda _, n=name: files.tree(n))
               for name in files.manifest.files if name.endswith("_modules.safetensors")}
    check_imports(folder, meta, code, trust=trust, trees=records,
                  manifest_data=files.manifest.data)
    try:
        return _rebuild(folder, meta, files, code, loss_fn=loss_fn, optimizer=optimizer)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        named = isinstance(err, PdcompileError) and str(folder) in str(err)
        unsigned = None if named else unsigned_reason(folder, MANIFEST_NAME,
                                                      files.manifest.data)
        if unsigned is None:  # named already, or this user's own export: raised as it is
            raise
        detail = str(err).splitlines()[0] if str(err) else ""
        if not isinstance(err, PdcompileError):
            detail = f"{type(err).__name__}: {detail}"
        raise DamagedFileError(
            f"{folder / 'pipeline.json'} does not fit the export's other files or this "
            f"pdcompile ({detail}); it was loaded with trust=True, and "
            f"{unsigned.removeprefix('it ')}: edited by hand or written by another tool; "
            "export the pipeline again") from None


def _rebuild(folder: Path, meta: dict[str, Any], files: ExportFiles, code: dict[str, str], *,
             loss_fn: Callable[..., torch.Tensor] | None,
             optimizer: OptimizerFactory | None) -> Pipeline:
    """The Pipeline of a checked export (load_pipeline): its files read and its code run."""
    plan = export_plan(files, meta)  # fitted to pipeline.json and schedule.txt
    lost = [k for k in meta.get("not_saved", {}) if {"loss_fn": loss_fn,
                                                     "optimizer": optimizer}.get(k) is None]
    if lost:
        why = "; ".join(f"{k}: {meta['not_saved'][k]}" for k in lost)
        raise PipelineInputError(
            f"the {' and '.join(lost)} of {folder} could not be saved at export ({why}); pass "
            f"it again: pdcompile.load(path, {', '.join(k + '=...' for k in lost)}). "
            + " ".join(UNSAVED_FIX[k] for k in lost))
    load_user_modules(meta.get("user_modules", {}), folder, read=files.data)  # before what
    # names them
    if loss_fn is None and meta.get("loss_fn") is not None:
        loss_fn = resolve(meta["loss_fn"], what="loss function")
    recipes = [None if r is None else OptimizerRecipe.from_dict(r) for r in meta["optimizers"]]
    factory = optimizer or next((r for r in recipes if r is not None), None)
    programs = [_load_stage(files, i, s, code) for i, s in enumerate(meta["stages"])]
    parts = SplitResult(
        stages=programs, data_inputs=tuple(meta["data_inputs"]),
        output_refs=tuple(ValueRef(n, s) for n, s in meta["output_refs"]),
        output_spec=load_spec(meta["output_spec"]),  # imports the modules of its types
        ties=tuple(TiedParameter(t["name"], tuple((int(s), str(n)) for s, n in t["members"]))
                   for t in meta["ties"]),
        unused=_load_unused(files) if meta.get("unused") else {})
    graph = _load_graph(files, meta.get("graph_stages", {}), len(programs), code)
    pipe = Pipeline(graph=graph, plan=plan, parts=parts, schedule=meta["schedule"],
                    microbatches=meta["microbatches"], loss_fn=loss_fn, optimizer=factory,
                    stash=meta["stash"], vertical_sync=meta["vertical_sync"], name=meta["name"],
                    clip_grad_norm=meta.get("clip_grad_norm"), autocast=meta.get("autocast"),
                    unbatched=_whole(folder, meta, "unbatched", ()),
                    batch_dim=_batch_dims(folder, meta))
    pipe.training_branches = tuple(str(n) for n in meta.get("training_branches", ()))
    # kept as recorded (checked by export_plan): exported again, plan.json is checked against
    # the same nodes, whether or not the graph could be rebuilt, and under the same names
    pipe.recorded_graph_stages = dict(meta.get("graph_stages", {}))
    for state in pipe.states():
        stage_meta = meta["stages"][state.stage]
        recipe = recipes[state.stage]
        if optimizer is not None or recipe is None:
            fresh = pipe._rank_state(state.rank, state.stage, state.module,
                                     param_order=stage_meta["param_order"])
        else:
            named = dict(state.module.named_parameters())
            order = tuple(stage_meta["param_order"])
            fresh = RankState(state.rank, state.stage, state.module, recipe.build(named), order)
        pipe.replace_state(fresh)
        _load_optimizer_state(fresh.optimizer, files, f"optimizer_{state.stage}.safetensors")
    if isinstance(meta.get("seed"), int):
        pipe.seed = meta["seed"]
    # the inputs the compiled pipeline gave whole to every microbatch, as it found them
    pipe.whole_inputs = _whole(folder, meta, "whole_inputs", pipe.unbatched)
    if files.has("example.safetensors"):
        example = read_file(folder / "example.safetensors",
                            lambda _: files.tree("example.safetensors"))
        pipe.example_inputs, pipe.example_target = tuple(example["inputs"]), example["target"]
    if meta.get("input_shapes") is not None:  # the shapes a graph from torch.export runs on
        try:
            pipe.input_shapes = InputShapes.from_json(meta["input_shapes"])
        except SizeTestError as err:  # a test the loader will not evaluate: say why
            raise DamagedFileError(f"{folder / 'pipeline.json'} is altered (input_shapes: "
                                   f"{err}); export the pipeline again") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            raise DamagedFileError(f"{folder / 'pipeline.json'} is altered (input_shapes "
                                   "malformed); export the pipeline again") from None
    sources = {int(name[len("rank_"):-len(".py")]): code[name]
               for name in code_files(files.manifest, "rank_")}
    schedule = _exported_schedule(folder, files, meta, pipe)
    # each rank file is the code the pipeline generates from that schedule (rank_code.py)
    check_rank_code(folder, sources, pipe.rank_sources(pipe.schedule_length(),
                                                       pipe.per_minibatch))
    if sources and schedule.ranks == sorted(sources):
        pipe.use_sources(sources, schedule.microbatches, pipe.per_minibatch)
    return pipe


def _exported_schedule(folder: Path, files: ExportFiles, meta: dict[str, Any],
                       pipe: Pipeline) -> Schedule:
    """schedule.txt (the order the rank files were generated from), checked to be the schedule
    the loaded pipeline makes of its plan (kept: the pipeline does not build it again), so
    that the rank code runs the plan the pipeline reports and prices; one line naming
    plan.json and schedule.txt otherwise (they were edited apart)."""
    stored = read_file(folder / "schedule.txt",
                       lambda _: Schedule.from_text(files.text("schedule.txt")))
    n, per = pipe.schedule_length(), pipe.per_minibatch
    misfit = schedule_misfit(stored, meta, n, per)
    if misfit is None:
        try:
            built = pipe.schedule(n, per)
        except PdcompileError as err:
            misfit = f"its plan makes no schedule ({str(err).splitlines()[0]})"
        else:
            if built.to_text() != stored.to_text():
                misfit = ("the schedule its plan makes is not the one the rank files were "
                          "generated from")
    if misfit is not None:
        raise DamagedFileError(f"{folder / 'plan.json'} and {folder / 'schedule.txt'} do not "
                               f"fit the export's other files: {misfit} (altered, or another "
                               f"export's); {FIX}")
    return stored


def _load_optimizer_state(optimizer: torch.optim.Optimizer, files: ExportFiles,
                          name: str) -> None:
    """Load a stage's optimizer state; a file that does not fit the optimizer is named
    (export/optimizer_state.py: the check verify runs too)."""
    path = files.folder / name
    state = read_file(path, lambda _: files.tree(name))
    if isinstance(optimizer, NoParameters):
        return
    fit_optimizer_state(optimizer, state, path)


# functions an exported stage calls that stay calls when it is traced back: traced through, the
# fused Linear (and a deferrable convolution) would bake in the plain path, `detached` would see a
# Proxy, not a tensor, and return it as it is (the model's no_grad lost), and the split's own calls
# (`flatten_value`, `rebuild_value` of a structured value crossing a cut, `changed_alias`,
# `set_item`, `clone_leaves` of an in-place change) would run on a Proxy (a tuple flattened to
# one leaf: "tuple index out of range" on load). The loader's tracers keep them by name, so the
# generated code need not register them with `torch.fx.wrap` (see `_unregistered`).
_KEPT_CALLS = (linear_accumulate, conv_deferrable, detached, flatten_value, rebuild_value,
               changed_alias, set_item, clone_leaves)


class _LeafTracer(OpsTracer):
    """Traces a loaded stage class: its direct children stay calls, as in the exported code.
    Buffers are graph values (an in-place change of one from constants alone, `ema.mul_(0.9)`,
    would otherwise run once on the real buffer while tracing and be left out of the graph)."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return "." not in module_qualified_name


def _unregistered(graph: fx.Graph) -> fx.Graph:
    """The traced graph with its `_KEPT_CALLS` plain calls, as in a compiled pipeline's graphs.
    fx marks a call kept by `autowrap_functions` "is_wrapped", and the code of a GraphModule made
    from it then calls `torch.fx.wrap(name)` each time it is compiled (an export writes that call
    into the stage file too, run at each import): each adds an entry, keyed by the code's own
    globals so never the same, to fx's process-wide table of wrapped functions, never removed,
    that every later trace in the process patches in and out (each load of a pipeline sending
    an LSTM's state across a cut added 9; after 300 loads a load took 6.8 times as long). These
    calls need no mark: the loader's tracers keep them by name. A function the model itself
    wraps with `torch.fx.wrap` keeps its mark: its stage file's `wrap` is what keeps it."""
    kept = set(_KEPT_CALLS)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in kept:
            node.meta.pop("is_wrapped", None)
    return graph


def _load_unused(files: ExportFiles) -> dict[str, torch.Tensor]:
    """The model's tensors that no stage holds (export/write.py), each in its own memory."""
    return read_file(files.folder / "unused.safetensors",
                     lambda _: files.tensors("unused.safetensors"))


def _load_stage(files: ExportFiles, index: int, meta: dict[str, Any],
                code: dict[str, str]) -> StageProgram:
    folder = files.folder
    source = _import(folder / f"stage_{index}.py", code, f"stage{index}")
    extra = {}
    if meta["recorded_modules"]:
        extra = _read_records(files, f"stage_{index}_modules.safetensors")
    stage = getattr(source, f"Stage{index}")(extra)
    # each tensor read into its own (aligned) memory, as checked against the manifest
    tensors = read_file(folder / f"stage_{index}.safetensors",
                        lambda _: files.tensors(f"stage_{index}.safetensors"))
    plain = {n for n in tensors if n not in dict(stage.named_parameters())
             and n not in dict(stage.named_buffers())}
    for n in plain:  # tensor constants read by get_attr
        setattr(stage, n, tensors.pop(n))
    transient = meta.get("transient_buffers", [])
    for n in transient:  # persistent=False buffers: not in state dicts, so set directly
        if n in tensors:
            set_path(stage, n, tensors.pop(n))
    missing, unexpected = stage.load_state_dict(tensors, strict=False, assign=True)
    missing = [m for m in missing if m not in meta["aliases"] and m not in transient]
    if missing or unexpected:
        raise DamagedFileError(f"{folder / f'stage_{index}.safetensors'} does not match "
                               f"stage_{index}.py (missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}); export the pipeline again")
    for alias, primary in meta["aliases"].items():
        set_path(stage, alias, get_path(stage, primary))
    for name in meta.get("frozen", []):  # absent from exports written before it was kept
        get_path(stage, name).requires_grad_(False)
    _set_modes(stage, meta, folder / "pipeline.json")
    graph = _unregistered(_LeafTracer(autowrap_functions=_KEPT_CALLS).trace(stage))
    module = fx.GraphModule(stage, graph, class_name=f"Stage{index}")
    module.training = stage.training
    densify_constants(module)  # the trace above bakes constants again
    return StageProgram(
        index=index, module=module,
        inputs=tuple(ValueRef(n, s) for n, s in meta["inputs"]),
        outputs=tuple(meta["outputs"]),
        receives={int(k): tuple(v) for k, v in meta["receives"].items()},
        sends={int(k): tuple(v) for k, v in meta["sends"].items()},
        param_names={k: tuple(v) for k, v in meta["param_names"].items()},
        buffer_names={k: tuple(v) for k, v in meta["buffer_names"].items()},
        kinds=dict(meta.get("kinds", {})), transient_buffers=tuple(transient))


def _set_modes(stage: torch.nn.Module, meta: dict[str, Any], where: Path) -> None:
    """The stage's training mode and its layers' own, as exported (exports written before the
    modes were kept: all in training mode, as they were loaded then)."""
    training = bool(meta.get("training", True))
    stage.train(training)
    layers = dict(stage.named_modules())
    for name in meta.get("other_mode", []):
        if name not in layers:
            raise DamagedFileError(f"{where} is altered (stage layer {name!r} in other_mode "
                                   "does not exist); export the pipeline again")
        layers[name].training = not training


class _AllLeaves(OpsTracer):
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


def _load_graph(files: ExportFiles, stages: dict[str, int], count: int,
                code: dict[str, str]) -> fx.GraphModule | None:
    """The exported graph (weights on the meta device), every node with its "pd.stage"."""
    if not stages or "graph.py" not in code:
        return None
    source = _import(files.folder / "graph.py", code, "graph")  # its errors are the export's
    try:  # the graph is informational: one that cannot be rebuilt or traced is left out
        root = source.Graph(_read_records(files, "graph_modules.safetensors", device="meta"))
        traced = _unregistered(_AllLeaves(autowrap_functions=_KEPT_CALLS).trace(root))
        graph = fx.GraphModule(root, traced, class_name="Graph")
    except Exception:
        return None
    for node in graph.graph.nodes:
        if node.op == "output":
            set_stage(node, count - 1)
        elif node.name in stages:
            set_stage(node, stages[node.name])
        else:
            inputs = [int(n.meta.get("pd.stage", 0)) for n in node.all_input_nodes]
            set_stage(node, max(inputs, default=0))
    return graph


def _read_records(files: ExportFiles, name: str, *, device: str = "cpu"
                  ) -> dict[str, torch.nn.Module]:
    """The submodules recorded beside a stage (or the graph), rebuilt (module_record)."""
    path = files.folder / name
    stored = read_file(path, lambda _: files.tree(name))
    try:
        return {name: rebuild_module(record, stored["tensors"], device=device)
                for name, record in stored["records"].items()}
    except (KeyError, TypeError, ValueError) as err:
        raise DamagedFileError(f"{path} is altered or not a file pdcompile wrote "
                               f"({type(err).__name__}: {err}); export the pipeline again") \
            from None


def _import(path: Path, code: dict[str, str], tag: str) -> types.ModuleType:
    """Run an exported Python file, from its text as checked against the manifest (`code`)."""
    name = f"pdcompile_export_{abs(hash(str(path.resolve())))}_{tag}"
    text = code.get(path.name)
    try:
        module = None if text is None else exec_module_source(text, path, name)
    except ImportError as err:
        raise PipelineInputError(f"{path} imports {err.name or err}, which cannot be imported "
                                 "here; install it (the machine that exported had it)") from None
    except Exception as err:
        line = getattr(err, "lineno", None)
        where = f", line {line}" if line else ""
        raise DamagedFileError(f"{path} cannot be imported ({type(err).__name__}{where}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}); export the "
                               "pipeline again") from None
    if module is None:
        raise DamagedFileError(f"{path} is missing from the export; export the pipeline again")
    return module


__all__ = ["load_pipeline"]
