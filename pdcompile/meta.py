"""Typed, namespaced `node.meta` entries written by the passes, and their accessors.

Keys: "pd.shape" -> NodeShape and "pd.tree" -> ValueTree (written by passes.shapes), "pd.cost"
-> NodeCost (cost.node_costs), "pd.stage" -> int (the partitioner / api). Reading a key the writing
pass has not set raises MetaMissingError saying which pass to run, never a bare KeyError. On the
GraphModule itself (`gm.meta`): "pd.output_spec" -> the pytree spec of the model's output where
the graph returns it flattened (passes.export_frontend); "pd.frontend" -> "fx", "export" or
"given" (passes.frontend); "pd.input_shapes" -> the input shapes the graph runs on, where the
front end knows them (passes.input_shapes.InputShapes, from passes.export_frontend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import MetaMissingError

SHAPE_KEY = "pd.shape"
COST_KEY = "pd.cost"
STAGE_KEY = "pd.stage"
TREE_KEY = "pd.tree"
OUTPUT_SPEC_KEY = "pd.output_spec"
FRONTEND_KEY = "pd.frontend"
TRAINING_BRANCHES_KEY = "pd.training_branches"
INPUT_SHAPES_KEY = "pd.input_shapes"

_ITEM_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32 (the string form stored in TensorShape)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorShape:
    """Shape and dtype of one tensor (dtype as a string such as 'float32')."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element (unknown dtypes count 4)."""
        return _ITEM_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.numel * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(s) for s in self.shape)}]"


class NodeShape(tuple[TensorShape, ...]):
    """The tensors a node produces, flattened in pytree order (empty for non-tensor values such
    as the int of `x.size(0)`). A tuple of TensorShape with a few conveniences."""

    __slots__ = ()

    def __new__(cls, tensors: Any = ()) -> NodeShape:
        return super().__new__(cls, tuple(tensors))

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors the node outputs."""
        return sum(t.nbytes for t in self)

    def __str__(self) -> str:
        if not self:
            return "-"
        return str(self[0]) if len(self) == 1 else "(" + ", ".join(str(t) for t in self) + ")"

    def __repr__(self) -> str:
        return f"NodeShape({tuple(self)!r})"


@dataclass(frozen=True)
class ValueTree:
    """The structure of a node's output: its pytree spec and the kind of every leaf ("tensor",
    "int", "float", "bool", "size", "NoneType", or another type's name), so that the split pass
    knows, before anything runs, what a stage would send."""

    spec: Any
    kinds: tuple[str, ...]

    @property
    def is_leaf(self) -> bool:
        """True when the value is one leaf (a tensor, a number...), not a container."""
        return bool(self.spec.is_leaf())


@dataclass(frozen=True)
class NodeCost:
    """What one node costs per minibatch: `fwd`/`bwd` seconds, `act` bytes of its output,
    `params` bytes of the parameters it owns (a parameter shared by several nodes is owned by
    the first one that uses it, so sums count it once), `keep` bytes autograd saves for its
    backward (parameters excluded). `flops_fwd`/`flops_bwd` where known (analytic source),
    `source` says where the times come from ("measured", "analytic", "imported"). `wgrad`: the
    seconds of `bwd` that compute weight gradients the runtime can defer (a fused Linear's dW
    and db: runtime/linear_grads.py), 0 for every other node."""

    fwd: float
    bwd: float
    act: float
    params: float
    keep: float
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    source: str = ""
    wgrad: float = 0.0


def _node_name(node: Any) -> str:
    return str(getattr(node, "name", node))


def _written(node: Any, key: str, what: str, writer: str) -> Any:
    """node.meta[key]; raises MetaMissingError naming the pass `writer` that writes it."""
    value = node.meta.get(key)
    if value is None:
        raise MetaMissingError(f"node {_node_name(node)!r} has no {what}; run {writer} first")
    return value


def get_shape(node: Any) -> NodeShape:
    """node.meta["pd.shape"]; raises MetaMissingError if the shapes pass has not run."""
    return _written(node, SHAPE_KEY, "shape",  # type: ignore[no-any-return]
                    "pdcompile.passes.shapes.annotate_shapes(gm, example_inputs)")


def set_shape(node: Any, shape: NodeShape) -> None:
    """Write node.meta["pd.shape"]."""
    node.meta[SHAPE_KEY] = shape


def has_shape(node: Any) -> bool:
    """Whether the shapes pass has annotated this node."""
    return SHAPE_KEY in node.meta


def set_tree(node: Any, tree: ValueTree) -> None:
    """Write node.meta["pd.tree"]."""
    node.meta[TREE_KEY] = tree


def get_tree(node: Any) -> ValueTree | None:
    """node.meta["pd.tree"], or None where the shapes pass has not run (callers that can do
    without it check later, when values exist)."""
    value = node.meta.get(TREE_KEY)
    return value if isinstance(value, ValueTree) else None


def get_cost(node: Any) -> NodeCost:
    """node.meta["pd.cost"]; raises MetaMissingError if the cost pass has not run."""
    return _written(node, COST_KEY, "cost",  # type: ignore[no-any-return]
                    "pdcompile.cost.node_costs.annotate_costs(gm, example_inputs)")


def set_cost(node: Any, cost: NodeCost) -> None:
    """Write node.meta["pd.cost"]."""
    node.meta[COST_KEY] = cost


def has_cost(node: Any) -> bool:
    """Whether the cost pass has annotated this node."""
    return COST_KEY in node.meta


def get_stage(node: Any) -> int:
    """node.meta["pd.stage"]; raises MetaMissingError if no plan has been applied."""
    value = node.meta.get(STAGE_KEY)
    if value is None:
        raise MetaMissingError(f"node {_node_name(node)!r} has no stage; partition the graph "
                               "first (pdcompile.compile, or set_stage from a Plan)")
    return int(value)


def set_stage(node: Any, stage: int) -> None:
    """Write node.meta["pd.stage"]."""
    node.meta[STAGE_KEY] = int(stage)


def has_stage(node: Any) -> bool:
    """Whether a stage has been assigned to this node."""
    return STAGE_KEY in node.meta


def set_output_spec(gm: Any, spec: Any) -> None:
    """Record on a GraphModule that its flat output tuple stands for this pytree structure."""
    gm.meta[OUTPUT_SPEC_KEY] = spec


def get_output_spec(gm: Any) -> Any:
    """The pytree spec recorded by `set_output_spec`, or None where the graph's output is the
    model's own structure (the trace pass)."""
    return getattr(gm, "meta", {}).get(OUTPUT_SPEC_KEY)


def set_frontend(gm: Any, frontend: str) -> None:
    """Record which front end made the GraphModule ("fx", "export", "given")."""
    gm.meta[FRONTEND_KEY] = frontend


def get_frontend(gm: Any) -> str:
    """The front end recorded by `set_frontend`; "fx" for graphs from the trace pass alone."""
    return str(getattr(gm, "meta", {}).get(FRONTEND_KEY, "fx"))


def set_training_branches(gm: Any, nodes: Sequence[str]) -> None:
    """Record the graph's nodes that only a training-mode capture holds
    (passes/training_branches.py)."""
    gm.meta[TRAINING_BRANCHES_KEY] = tuple(nodes)


def get_training_branches(gm: Any) -> tuple[str, ...]:
    """The nodes recorded by `set_training_branches` (none where nothing was recorded)."""
    return tuple(getattr(gm, "meta", {}).get(TRAINING_BRANCHES_KEY, ()))


def set_input_shapes(gm: Any, shapes: Any) -> None:
    """Record on a GraphModule the input shapes it runs on (passes.input_shapes.InputShapes)."""
    gm.meta[INPUT_SHAPES_KEY] = shapes


def get_input_shapes(gm: Any) -> Any:
    """The input shapes recorded by `set_input_shapes`, or None where the front end does not
    know them (fx traces run on any shape the model's code accepts)."""
    return getattr(gm, "meta", {}).get(INPUT_SHAPES_KEY)
