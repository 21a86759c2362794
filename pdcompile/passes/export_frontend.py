"""The torch.export front end: models torch.fx cannot trace symbolically, as the same kind of graph.

`torch.fx.symbolic_trace` stops at Python that inspects values (Hugging Face BERT slices a
buffer by a traced size, GPT-2's forward is wrapped in decorators fx cannot see through).
`torch.export` runs the model on fake tensors instead and records the aten operations, so it
captures such models whole. This pass turns its ExportedProgram into a plain GraphModule like
the trace pass's: one placeholder per model input (named after the forward's parameters),
parameters and buffers under the model's own names (the model's own tensors, shared), read by
`get_attr`; the output flattened, with the model's output structure (a Hugging Face ModelOutput,
say) kept as a pytree spec beside the graph (`meta.set_output_spec`). Dimension 0 of every
tensor input is exported as dynamic, so that the graph runs on microbatches of any size.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pdcompile.errors import TraceError
from pdcompile.meta import set_output_spec

# operations that only check what export assumed (dtypes, devices, shape guards)
_CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")


def export_graph(model: nn.Module, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """Capture `model` called as `model(*args, **kwargs)` with torch.export (see module doc)."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"export_graph() takes an nn.Module, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError as err:
        raise TraceError(f"the example inputs do not fit {type(model).__name__}.forward: "
                         f"{err}") from None
    # dimension 0 (the batch) of every tensor input may change: microbatches are smaller
    shapes = {name: {0: torch.export.Dim.AUTO}
              if isinstance(value, torch.Tensor) and value.dim() else None
              for name, value in bound.items()}
    try:
        program = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=shapes,
                                      strict=False)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TraceError(f"torch.export cannot capture {type(model).__name__}: "
                         f"{type(err).__name__}: {reason}") from None
    unlifted = program.module()
    graph = unlifted.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            graph.erase_node(node)  # re-checks the input shapes export saw: none to check
        elif node.op == "call_function" and str(node.target).startswith(_CHECKS) \
                and not node.users:
            graph.erase_node(node)
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
    return gm


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
