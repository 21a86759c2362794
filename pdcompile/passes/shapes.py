"""Shapes pass: shape and dtype of every node's output, propagated on fake tensors.

The graph runs under torch's FakeTensorMode, so no real memory is used: a model built on the
`meta` device (GPT-2 XL, say) is shaped without allocating its weights. Writes "pd.shape" and
"pd.tree" (the output's pytree structure and the kind of each leaf: what a stage would send).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves

from pdcompile.errors import PipelineInputError
from pdcompile.meta import NodeShape, TensorShape, ValueTree, dtype_name, set_shape, set_tree


def shape_of(value: Any) -> NodeShape:
    """The NodeShape of a value: its tensor leaves in pytree order."""
    return NodeShape(TensorShape(tuple(int(s) for s in t.shape), dtype_name(t.dtype))
                     for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def tree_of(value: Any) -> ValueTree:
    """The ValueTree of a value: its pytree spec and the kind of each leaf."""
    leaves, spec = tree_flatten(value)
    return ValueTree(spec, tuple(_kind(leaf) for leaf in leaves))


def _kind(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return "tensor"
    if isinstance(leaf, torch.Size):
        return "size"
    return type(leaf).__name__


def bind_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any],
                example_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """One value per placeholder, in graph order: positional inputs first, then keyword inputs
    by name, then the placeholder's default. Raises PipelineInputError on a mismatch."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [str(n.target).lstrip("*") for n in placeholders]
    kwargs = dict(example_kwargs or {})
    if len(example_inputs) > len(placeholders):
        raise PipelineInputError(f"{len(example_inputs)} example inputs given but the traced "
                                 f"model takes {len(placeholders)} ({', '.join(names)}); inputs "
                                 "that fill parameters with defaults need "
                                 f"trace(model, num_positional={len(example_inputs)})")
    values: list[Any] = list(example_inputs)
    for node, name in zip(placeholders[len(values):], names[len(values):], strict=True):
        if name in kwargs:
            values.append(kwargs.pop(name))
        elif node.args:
            values.append(node.args[0])
        else:
            raise PipelineInputError(f"no example value for input {name!r}; pass it in "
                                     f"example_inputs or example_kwargs={{{name!r}: ...}}")
    if kwargs:
        raise PipelineInputError(f"example_kwargs names {sorted(kwargs)}, which the traced model "
                                 f"does not take as inputs ({', '.join(names)}); trace with "
                                 "example_kwargs_names=[...] to keep keyword inputs")
    return values


class _ShapeInterpreter(fx.Interpreter):
    """Runs every node and records the NodeShape of its output; `failure` explains a failing
    node in one line (fx appends its own notes to the exception itself)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.failure: str | None = None

    def run_node(self, n: fx.Node) -> Any:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        try:
            result = super().run_node(n)
        except Exception as err:
            if self.failure is None:
                inputs = ", ".join(str(shape_of(self.env[a])) for a in n.all_input_nodes
                                   if a in self.env)
                what = f"node {n.name!r} ({n.op} {_target_name(n)})"
                if isinstance(err, (DataDependentOutputException, DynamicOutputShapeException)):
                    self.failure = (f"{what}: its output depends on tensor values, which "
                                    "meta/fake tensors do not have; build the model and inputs "
                                    "on a real device, or make that part depend on shapes only")
                else:
                    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
                    self.failure = (f"{what} fails on inputs {inputs or '(none)'}: {reason}; "
                                    "check that example_inputs have the shapes and dtypes the "
                                    "model expects")
            raise
        set_shape(n, shape_of(result))
        set_tree(n, tree_of(result))
        return result


def _target_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def annotate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    example_kwargs: dict[str, Any] | None = None) -> fx.GraphModule:
    """Write "pd.shape" on every node of `gm` (placeholders and output included); returns `gm`.

    Runs on fake tensors; inputs and parameters may be real, meta or fake. If an operation has
    no fake implementation (a data-dependent output size) and everything is real, it falls back
    to running the graph for real under no_grad.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = bind_inputs(gm, tuple(example_inputs), example_kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _ShapeInterpreter(gm)
    try:
        with mode:
            fake_values = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                           for v in values]
            fake.run(*fake_values)
        return gm
    except Exception as err:
        failure = fake.failure or f"shapes cannot be propagated: {err}"
    real = all(not isinstance(v, torch.Tensor) or v.device.type != "meta" for v in values)
    real = real and all(p.device.type != "meta" for p in gm.parameters())
    if real:
        interpreter = _ShapeInterpreter(gm)
        try:
            with torch.no_grad():
                interpreter.run(*values)
            return gm
        except Exception:
            failure = interpreter.failure or failure
    raise PipelineInputError(failure)
