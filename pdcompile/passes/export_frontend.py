"""The torch.export front end: models torch.fx cannot trace symbolically, as the same kind of graph.

`torch.fx.symbolic_trace` stops at Python that inspects values (Hugging Face BERT slices a
buffer by a traced size, GPT-2's forward is wrapped in decorators fx cannot see through).
`torch.export` runs the model on fake tensors instead and records the aten operations, so it
captures such models whole. This pass turns its ExportedProgram into a plain GraphModule like
the trace pass's: one placeholder per model input (named after the forward's parameters),
parameters and buffers under the model's own names (the model's own tensors, shared), read by
`get_attr`; the output flattened, with the model's output structure (a Hugging Face ModelOutput,
say) kept as a pytree spec beside the graph (`meta.set_output_spec`). Every dimension of every
tensor input is exported as free (`Dim.AUTO`), so that the graph runs on microbatches of any
size and sequences of any length, except where the model's code fixes or bounds a size: the
shapes it runs on are kept beside the graph (`meta.set_input_shapes`, passes/input_shapes.py),
so that a minibatch of a shape it cannot run on is refused in words. A size the model's code
tests more than `TESTS_BEFORE_FIXED` times is fixed at the example's as well: torch.export
simplifies each new test of a free size against the expressions of the earlier ones, which grow
through every padding and window partition (timm's Twins tests its image height about 600 times
and took minutes; fixed after 64 tests, seconds). A model that torch.export cannot capture with
every size free, or that loses its batch size so, is captured with only dimension 0 (the batch)
free.
"""

from __future__ import annotations

import inspect
import operator
import os
import re
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.experimental._config as symbolic_config
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pdcompile.errors import TraceError
from pdcompile.meta import set_input_shapes, set_output_spec
from pdcompile.passes.custom_functions import calling_module, custom_functions_seen
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.passes.module_hooks import module_hooks
from pdcompile.passes.quiet_logs import torch_export_quiet
from pdcompile.passes.reentrant_checkpoint import reentrant_checkpoints_as_calls
from pdcompile.passes.variadic_inputs import variadic_refusal
from pdcompile.runtime.grad_mode import detached

# torch's words for an output it cannot flatten
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")
# operations that only check what export assumed (dtypes, devices, shape guards)
_CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")
# tests of one free size (guards) after which torch.export fixes it at the example's: a sequence
# model tests its length a few times (BERT once, wav2vec2's convolutions 29 times), a vision
# model with windows its image sizes hundreds of times (see the module doc)
TESTS_BEFORE_FIXED = 64


class _UnkeptCalls(TorchFunctionMode):
    """What the forward did while torch.export ran it that its graph has no place for, each as
    "file:line" of the model's code: `Tensor.register_hook` (the hook changed the gradients in
    eager runs) and operations under `torch.inference_mode()` (export records them as if
    gradients were on: the region's layers trained, and gradients passed it). The pipeline
    trained without the one and with the other, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: list[str] = []
        self.inference: list[str] = []
        self._inference_at_start = torch.is_inference_mode_enabled()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.register_hook:
            self.hooks.append(_caller())
        elif not self.inference and torch.is_inference_mode_enabled() and \
                not self._inference_at_start:
            self.inference.append(_caller())
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame outside torch, as "file:line"."""
    caller = next((f for f in reversed(traceback.extract_stack()[:-2])
                   if not f.filename.startswith(_TORCH_DIR)), None)
    return f"{caller.filename}:{caller.lineno}" if caller else "?"


_TORCH_DIR = os.path.dirname(torch.__file__)


def _refuse_backward_hooks(model: nn.Module) -> None:
    """torch.export records the forward's operations only: a module's backward hooks
    (`register_full_backward_hook`, `register_full_backward_pre_hook`), which change the
    gradients, were dropped and the pipeline trained without them."""
    hooked = [(name or "the model itself", kinds) for name, module in model.named_modules()
              if (kinds := [k for k in module_hooks(module) if k.startswith("backward")])]
    if hooked:
        shown = ", ".join(f"{name} ({' and '.join(kinds)})" for name, kinds in hooked[:3])
        raise TraceError(f"{type(model).__name__} has backward hooks on {shown}, which "
                         "torch.export does not keep (its graph holds the forward only); use "
                         "frontend='fx' (which keeps those of submodules), or do their work in "
                         "forward or in the loss")


def export_graph(model: nn.Module, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None, *,
                 autocast: str | None = None, batch_dim: int = 0) -> fx.GraphModule:
    """Capture `model` called as `model(*args, **kwargs)` with torch.export (see module doc);
    `autocast`: the dtype name of the region the pipeline runs its forwards in (None: none);
    `batch_dim`: the dimension microbatches are cut along (compile's `batch_dim=`)."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"export_graph() takes an nn.Module, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError as err:
        raise TraceError(f"the example inputs do not fit {type(model).__name__}.forward: "
                         f"{err}") from None
    parameters = inspect.signature(model.forward).parameters
    for name, value in bound.items():
        star = parameters[name]
        if star.kind == star.VAR_KEYWORD and value:
            raise variadic_refusal(model, star, value)
        if star.kind == star.VAR_POSITIONAL and value:
            raise variadic_refusal(model, star, ())
        if isinstance(value, list | tuple | dict) and any(
                isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
            raise TraceError(f"input {name!r} of {type(model).__name__} is a "
                             f"{type(value).__name__} of tensors, which the torch.export front "
                             "end cannot take as one input; use frontend='fx' (which can), or "
                             "pass its tensors as separate inputs")
        if isinstance(value, list | tuple | dict) and not isinstance(value, torch.Size):
            # torch.export takes it as that many inputs of their own, which no minibatch names
            raise TraceError(f"input {name!r} of {type(model).__name__} is a "
                             f"{type(value).__name__} of plain values, which the torch.export "
                             "front end cannot take as one input; use frontend='fx' (which can), "
                             f"or leave {name!r} to its default or bind it with "
                             "functools.partial")
    _refuse_backward_hooks(model)
    with _UnkeptCalls() as unkept, reentrant_checkpoints_as_calls(), \
            custom_functions_seen(calling_module(model), as_operator=True) as functions:
        program = _export(model, tuple(args), kwargs, bound, batch_dim)
    if unkept.hooks:
        raise TraceError(f"{type(model).__name__}.forward registers a gradient hook on a tensor "
                         f"(Tensor.register_hook at {unkept.hooks[0]}), which torch.export "
                         "does not keep (its graph holds the forward only; torch.fx cannot trace "
                         "it); change the gradient in a torch.autograd.Function or in a "
                         "module's full backward hook instead")
    if unkept.inference:
        raise TraceError(f"{type(model).__name__}.forward runs operations under "
                         f"torch.inference_mode() (at {unkept.inference[0]}), which torch.export "
                         "records as if gradients were on; use torch.no_grad() there (both "
                         "front ends keep it), or frontend='fx'")
    if functions.calls:
        name, module = functions.calls[0]
        keep = (f"use frontend='fx' with the module that calls it, {module}, kept whole "
                f"(leaf_modules=[{module.split(' ')[0]}])" if module else
                "call it from a submodule and use frontend='fx' with that module kept whole "
                "(leaf_modules=[name])")
        raise TraceError(f"{type(model).__name__}.forward applies the autograd Function {name} "
                         "(a backward of its own) to other values than tensors alone, or is "
                         "a class no module holds by name (defined inside a function), which "
                         "torch.export would record as its forward's operations, with their "
                         "derivatives in place of its backward; define it at a module's top "
                         f"level and pass it tensors alone, or {keep}")
    unlifted = program.module()
    graph = unlifted.graph
    if autocast is None:
        _inline_autocast_off(unlifted, graph)
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            graph.erase_node(node)  # re-checks the input shapes: the pipeline does (input_shapes)
    for module in unlifted.modules():  # the regions kept as graphs of their own too
        if isinstance(module, fx.GraphModule):
            _drop_checks(module.graph)
            if module is not unlifted:
                module.recompile()
    _inline_grad_regions(unlifted, graph)
    _refuse_parameter_changes(unlifted, graph, type(model).__name__)
    out_spec = program.call_spec.out_spec
    graph._codegen = fx.graph.CodeGen()  # plain placeholders and a flat output tuple
    output = next(n for n in graph.nodes if n.op == "output")
    leaves = output.args[0]
    output.args = (tuple(leaves) if isinstance(leaves, list | tuple) else (leaves,),)
    graph.eliminate_dead_code()
    graph.lint()
    gm = fx.GraphModule(unlifted, graph, class_name=type(model).__name__)
    for name in [n for n, _ in gm.named_children() if n.startswith("_guards_fn")]:
        delattr(gm, name)
    _share_model_tensors(gm, model)
    gm.train(model.training)
    if out_spec is not None:
        set_output_spec(gm, out_spec)
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) == len(program.graph_signature.user_inputs):
        set_input_shapes(gm, InputShapes.of_program(
            program, dict(zip(program.graph_signature.user_inputs, inputs, strict=True))))
    return gm


# operations through which a value still is the tensor it was made from (same storage)
_ALIASES = ("aten.detach.", "aten.alias.", "aten.view.", "aten._unsafe_view.", "aten.t.",
            "aten.transpose.", "aten.permute.", "aten.slice.", "aten.select.", "aten.expand.")


def _refuse_parameter_changes(gm: fx.GraphModule, graph: fx.Graph, model: str) -> None:
    """A forward that changes a parameter in place (`nn.Embedding(max_norm=...)` renormalises
    its rows, through a detached alias) is refused: torch.export records the change as an
    operation on an alias, and a cut that puts another reader of the parameter in another stage
    gives that stage a copy the change never reaches, so the copies part silently. torch.fx
    keeps such a layer whole (a leaf module)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            if argument.is_write and isinstance(value, fx.Node):
                source = _aliased(value)
                if source.op == "get_attr" and source.target in params:
                    raise TraceError(
                        f"{model}.forward changes parameter {source.target!r} in place "
                        f"({node.target}, e.g. nn.Embedding(max_norm=...)), which the "
                        "torch.export front end cannot keep in step between stages; use "
                        "frontend='fx' (compile's default 'auto' does), or change the "
                        "parameter outside forward")


def _aliased(node: fx.Node) -> fx.Node:
    """The node a value aliases, through views and detaches."""
    while node.op == "call_function" and str(node.target).startswith(_ALIASES) and node.args \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _drop_checks(graph: fx.Graph) -> None:
    """The checks of what export assumed, which the graph does not need: a dtype checked
    inside a region kept as a graph of its own is what it was outside autocast, and
    `compile(autocast=...)` runs it under autocast."""
    for node in list(graph.nodes):
        if node.op == "call_function" and str(node.target).startswith(_CHECKS) \
                and not node.users:
            graph.erase_node(node)


def _inline_grad_regions(root: nn.Module, graph: fx.Graph) -> None:
    """torch.export keeps a `with torch.no_grad():` of the forward as a call of a submodule
    (`wrap_with_set_grad_enabled(False, submodule, *inputs)`), which no stage could be cut
    inside and no export could write. Its operations go into the graph in its place; with
    grad mode off, every input enters through `detached`, as the trace pass does, so nothing
    computed there requires a gradient (with grad mode on, as they are)."""
    region = torch.ops.higher_order.wrap_with_set_grad_enabled
    while True:
        call = next((n for n in graph.nodes
                     if n.op == "call_function" and n.target is region), None)
        if call is None:
            return
        enabled, holder, *inputs = call.args
        _inline_region(root, graph, call, holder, inputs, detach=not enabled)


def _inline_autocast_off(root: nn.Module, graph: fx.Graph) -> None:
    """torch.export keeps a `with torch.autocast(..., enabled=False):` of the forward (timm's
    EfficientViT keeps its attention in float32 so) as a call of a submodule
    (`wrap_with_autocast(device, dtype, False, cache, submodule, *inputs)`), which no export
    could write. Where the pipeline runs without autocast, turning it off changes nothing: its
    operations go into the graph in its place. Under `compile(autocast=...)`, and where the
    region turns autocast on, the submodule stays (it trains in this process; an export
    refuses it, in words)."""
    region = torch.ops.higher_order.wrap_with_autocast
    while True:
        call = next((n for n in graph.nodes if n.op == "call_function" and n.target is region
                     and len(n.args) > 4 and n.args[2] is False), None)
        if call is None:
            return
        holder, *inputs = call.args[4:]
        _inline_region(root, graph, call, holder, inputs, detach=False)


def _inline_region(root: nn.Module, graph: fx.Graph, call: fx.Node, holder: Any,
                   inputs: list[Any], *, detach: bool) -> None:
    """One region's call replaced by its submodule's operations (`detach`: every input enters
    through `detached`)."""
    assert isinstance(holder, fx.Node)
    sub = getattr(root, str(holder.target))
    env: dict[fx.Node, Any] = {}
    places = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(call):
        for place, value in zip(places, inputs, strict=True):
            env[place] = graph.call_function(detached, (value,)) if detach else value
        for node in sub.graph.nodes:
            if node.op == "get_attr":  # a tensor of the region's own: kept on the root
                name = f"{holder.target}_{node.target}".replace(".", "_")
                setattr(root, name, getattr(sub, str(node.target)))
                env[node] = graph.get_attr(name)
            elif node.op not in ("placeholder", "output"):
                env[node] = graph.node_copy(node, lambda n: env[n])
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    results = fx.map_arg(out, lambda n: env[n])
    for user in list(call.users):
        if user.target is operator.getitem and isinstance(results, list | tuple):
            user.replace_all_uses_with(results[user.args[1]])  # type: ignore[index]
            graph.erase_node(user)
    if call.users:
        call.replace_all_uses_with(results)
    graph.erase_node(call)
    if not holder.users:
        graph.erase_node(holder)
        delattr(root, str(holder.target))


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            bound: Mapping[str, Any], batch_dim: int = 0) -> torch.export.ExportedProgram:
    """torch.export of the model with every dimension of every tensor input free where the
    model allows (other sequence lengths, other batch sizes), each fixed after
    `TESTS_BEFORE_FIXED` tests; where export fails so or fixes the batch size, with only
    the batch dimension free (`batch_dim`, 0 unless compile was told another: microbatches are
    smaller than the example), the error of that attempt."""
    def free(dims: Callable[[torch.Tensor], Iterable[int]]) -> dict[str, Any]:
        return {name: {d: torch.export.Dim.AUTO for d in dims(value) if d < value.dim()}
                if isinstance(value, torch.Tensor) and value.dim() else None
                for name, value in bound.items()}

    every_size: torch.export.ExportedProgram | None = None
    try:
        with torch_export_quiet(), symbolic_config.patch(  # type: ignore[attr-defined]
                symbol_guard_limit_before_specialize=TESTS_BEFORE_FIXED):  # made at import
            every_size = torch.export.export(model, args, kwargs, strict=False,
                                             dynamic_shapes=free(lambda v: range(v.dim())))
    except Exception:
        pass  # some sizes cannot be free: try the batch alone, and report that attempt
    if every_size is not None and not _batch_fixed(every_size, batch_dim):
        return every_size
    try:  # the batch alone free, with no limit on its tests
        with torch_export_quiet():
            batch_only = torch.export.export(model, args, kwargs, strict=False,
                                             dynamic_shapes=free(lambda v: (batch_dim,)))
    except Exception as err:
        if every_size is not None:
            return every_size
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        unknown = _UNKNOWN_OUTPUT.search(reason)
        if unknown:
            raise TraceError(f"the output of {type(model).__name__} holds a {unknown.group(1)}, "
                             "which no stage can send (neither a tensor nor a tuple, list, dict "
                             "or dataclass of tensors): return only tensors from forward, or "
                             "wrap the model in a module that does") from None
        raise TraceError(f"torch.export cannot capture {type(model).__name__}: "
                         f"{type(err).__name__}: {reason}") from None
    if every_size is not None and _batch_fixed(batch_only, batch_dim):
        return every_size  # the model's code fixes its batch size: keep the other sizes free
    return batch_only


def _batch_fixed(program: torch.export.ExportedProgram, batch_dim: int = 0) -> bool:
    """Whether the program fixed the batch dimension of an input whose example has 2 or more
    there (torch.export fixes a size of 1 anyway): microbatches would be refused."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    user = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and node.name in user and isinstance(value, torch.Tensor) \
                and value.dim() > batch_dim and is_concrete_int(value.shape[batch_dim]) \
                and value.shape[batch_dim] >= 2:
            return True  # a size fixed after the fact is a SymInt of a constant
    return False


def _share_model_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point the graph's parameters and buffers at the model's own tensors (as the trace pass
    does), so that training the pipeline's source and naming its weights work alike."""
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        try:
            holder = gm.get_submodule(owner) if owner else gm
        except AttributeError:
            continue
        if attr in holder._parameters:
            holder._parameters[attr] = param
    for module_name, module in model.named_modules(remove_duplicate=False):
        try:
            holder = gm.get_submodule(module_name) if module_name else gm
        except AttributeError:
            continue
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr in holder._buffers:
                holder._buffers[attr] = buffer
                if attr in module._non_persistent_buffers_set:
                    holder._non_persistent_buffers_set.add(attr)


__all__ = ["export_graph"]
