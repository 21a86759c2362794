"""Front ends: which tool turns the model into the graph the passes work on.

- `fx` (the trace pass): torch.fx symbolic tracing with pdcompile's leaf policy. Fast, keeps
  modules as nodes (readable stage code), works on `meta` models.
- `export` (passes/export_frontend.py): torch.export, for models whose Python fx cannot trace
  (Hugging Face BERT and GPT-2, among others); aten operations, one node each.
- a model that is already an `fx.GraphModule` (say from transformers' own fx tracer) is taken
  as it is ("given").

`auto` tries fx and, where fx cannot trace the model or its graph outputs other tensors than
the model on the example inputs (passes/trace_check.py), torch.export (which records every
operation: `leaf_modules` then no longer apply); when both fail the error names fx's culprit and
fix and says why export failed too. The front end used is recorded on
the graph (`meta.get_frontend`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pdcompile.errors import PipelineInputError, TraceError
from pdcompile.meta import set_frontend, set_training_branches
from pdcompile.passes.attribute_names import check_attribute_names
from pdcompile.passes.dense_constants import densify_constants
from pdcompile.passes.export_frontend import export_graph
from pdcompile.passes.inference_cache import without_inference_cache
from pdcompile.passes.input_changes import refuse_input_changes
from pdcompile.passes.shapes import bind_inputs
from pdcompile.passes.trace import trace
from pdcompile.passes.trace_check import check_traced_outputs
from pdcompile.passes.training_branches import training_branches
from pdcompile.passes.training_flags import training_mode_calls
from pdcompile.runtime.precision import autocast_region

FRONTENDS = ("auto", "fx", "export")


@dataclass(frozen=True)
class Captured:
    """The graph of a model, the front end that made it, and the example inputs in the order
    of the graph's placeholders."""

    graph: fx.GraphModule
    frontend: str
    inputs: tuple[Any, ...]


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside the wrappers a training script may already have put around it:
    `torch.compile` (its OptimizedModule), `nn.DataParallel` and `DistributedDataParallel`. Their
    forwards take `*args, **kwargs` and dispatch elsewhere, which neither front end can capture;
    the pipeline trains the model they wrap (its parameters, named as the model names them)."""
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def capture(model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            *, leaf_modules: Iterable[type[nn.Module] | str] = (),
            frontend: str = "auto", autocast: str | None = None, batch_dim: int = 0
            ) -> Captured:
    """The graph of `model` called as `model(*args, **kwargs)` (see the module docstring);
    `autocast`: the dtype name of the region the pipeline will run its forwards in (None:
    none). fx traces inside that region, so that a forward that turns autocast off or on is
    seen (and taken by torch.export, which records it). `batch_dim`: the inputs' batch
    dimension, which torch.export leaves free where it cannot leave every size free."""
    if frontend not in FRONTENDS:
        raise PipelineInputError(f"unknown frontend {frontend!r}; choose one of "
                                 f"{', '.join(FRONTENDS)}")
    kwargs = dict(kwargs or {})
    check_attribute_names(model)
    if isinstance(model, fx.GraphModule):
        graph, used = _given(model, leaf_modules)
    else:
        _refuse_torchscript(model)
        with without_inference_cache(model, kwargs):
            graph, used = _captured(model, args, kwargs, list(leaf_modules), frontend,
                                    autocast, batch_dim)
    densify_constants(graph)
    set_frontend(graph, used)
    return Captured(graph, used, tuple(bind_inputs(graph, tuple(args), kwargs)))


def _refuse_torchscript(model: nn.Module) -> None:
    """A TorchScript module (torch.jit.script / torch.jit.trace) inside the model is refused:
    torch.fx traced through it to a call on its C++ object, whose parameters no stage held, so
    they were silently never trained; torch.export refuses its parameters."""
    scripted: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in scripted) or (
            scripted and scripted[0] == "")
        if isinstance(module, torch.jit.ScriptModule) and not inside:
            scripted.append(name)
    if scripted:
        names = ", ".join(repr(n) if n else "the model itself" for n in scripted[:4])
        raise TraceError(
            f"{type(model).__name__} holds TorchScript module(s) {names} (torch.jit.script or "
            "torch.jit.trace), whose parameters live in TorchScript, where "
            "no pipeline stage can train them; compile the model with those modules as plain "
            "nn.Modules (script afterwards if you need TorchScript)")


def _given(model: fx.GraphModule, leaf_modules: Iterable[type[nn.Module] | str]
           ) -> tuple[fx.GraphModule, str]:
    if list(leaf_modules):
        raise PipelineInputError("leaf_modules= applies to tracing, but the model is already "
                                 "an fx.GraphModule (taken as it is); drop leaf_modules=")
    return model, "given"


def _captured(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
              leaves: list[type[nn.Module] | str], frontend: str, autocast: str | None,
              batch_dim: int = 0) -> tuple[fx.GraphModule, str]:
    """The graph of a model that is not already one, and the front end that made it."""
    if frontend == "export":
        if leaves:
            raise PipelineInputError("leaf_modules= applies to torch.fx tracing; torch.export "
                                     "records every operation: drop leaf_modules= or use "
                                     "frontend='fx'")
        return _exported(model, args, kwargs, autocast, batch_dim), "export"
    try:
        with autocast_region(autocast, model):
            def traced() -> fx.GraphModule:
                return trace(model, leaf_modules=leaves, example_kwargs_names=list(kwargs),
                             num_positional=len(args),
                             none_inputs=_given_as_none(model, args, kwargs))

            gm = traced()
            refuse_input_changes(gm, type(model).__name__)  # before any run on the example
            check_traced_outputs(model, gm, args, kwargs, bind_inputs(gm, tuple(args), kwargs))
            set_training_branches(gm, training_branches(model, gm, traced))
            return gm, "fx"
    except TraceError as fx_error:
        if frontend == "fx":
            raise
        try:
            return _exported(model, args, kwargs, autocast, batch_dim), "export"
        except TraceError as export_error:
            if str(export_error) == str(fx_error):  # both refused it in the same words
                raise fx_error from None
            raise TraceError(f"{fx_error} (torch.export cannot capture it either: "
                             f"{export_error})") from None


def _exported(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
              autocast: str | None, batch_dim: int = 0) -> fx.GraphModule:
    """torch.export's graph of the model, with the operations only its training-mode capture
    holds recorded as fx's are (torch.export runs the forward's Python once too, so a branch on
    `self.training` is fixed in its graph as well)."""
    def exported() -> fx.GraphModule:
        return export_graph(model, args, kwargs, autocast=autocast, batch_dim=batch_dim)

    gm = exported()
    refuse_input_changes(gm, type(model).__name__)
    fixed = {call.split(" ")[0] for call in training_mode_calls(gm)}
    set_training_branches(gm, [branch for branch in training_branches(model, gm, exported)
                               if branch.split(" ")[0] not in fixed])
    return gm


def _given_as_none(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
                   ) -> list[str]:
    """The forward's parameters that the example inputs give as None."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return []  # the trace says what does not fit
    return [name for name, value in bound.items() if value is None]


__all__ = ["FRONTENDS", "Captured", "capture", "unwrapped"]
