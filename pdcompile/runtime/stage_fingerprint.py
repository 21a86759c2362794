"""The fingerprint of what a stage runs, so that a checkpoint is resumed only by the same model.

Two models can have the same parameters (names, shapes, dtypes) and the same plan and still
compute different things: Linear-ReLU-Linear and Linear-Tanh-Linear, or the same layers called
in another order. A checkpoint of one fits the other's `load_state_dict`, so the plan alone
cannot tell them apart. The fingerprint is a SHA-256 over:

- the stage's graph, node by node: name, kind, target (functions by their qualified name) and
  arguments (other nodes by name, constants by their repr);
- every module the graph calls (`call_module`): its class and `extra_repr()` (so ReLU and Tanh,
  or LeakyReLU(0.1) and LeakyReLU(0.2), differ), and the graph of one that is itself traced;
- the state a checkpoint restores: every `state_dict` entry's name, shape and dtype, and the
  order of the parameters the optimizer holds (its state is stored by position).

It is the same in every process and for every fresh compile of the same model: no ids, memory
addresses (stripped from reprs), file paths or dict orders (JSON with sorted keys). Modules
that only hold parameters read with `get_attr` are left out: a compiled pipeline keeps the
user's `nn.Linear` there, an export loaded back a plain `nn.Module` holding the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def stage_fingerprint(module: torch.nn.Module, param_order: Sequence[str] = ()) -> str:
    """The SHA-256 (hex) of what `module` runs and holds (see the module docstring)."""
    text = json.dumps(describe(module, param_order), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def describe(module: torch.nn.Module, param_order: Sequence[str] = ()) -> dict[str, Any]:
    """The plain data the fingerprint hashes (readable, for a test or a report)."""
    return {"runs": _runs(module),
            "state": {name: [list(value.shape), str(value.dtype)] if isinstance(
                value, torch.Tensor) else _text(value)
                for name, value in module.state_dict().items()},
            "param_order": list(param_order)}


def _runs(module: torch.nn.Module) -> dict[str, Any]:
    """A module's computation: its graph and what the graph calls, or (not traced) its class."""
    kind = {"class": _qualified(type(module)), "config": _text(module.extra_repr())}
    if not isinstance(module, fx.GraphModule):
        return kind
    called = {}
    nodes = []
    for node in module.graph.nodes:
        nodes.append([node.name, node.op, _target(node), _arg(node.args), _arg(node.kwargs)])
        if node.op == "call_module":
            called[str(node.target)] = _runs(module.get_submodule(str(node.target)))
    return {"graph": nodes, "calls": called}


def _target(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return _qualified(node.target)


def _qualified(obj: Any) -> str:
    """`torch.relu` -> "torch.relu"; an op overload -> "aten.relu.default"."""
    if isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(obj)
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, type):  # MyFunction.apply: the class tells two Functions apart
        return f"{_qualified(owner)}.{getattr(obj, '__name__', '?')}"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    where = getattr(obj, "__module__", None)
    if name is None:
        return _text(repr(obj))
    return f"{where}.{name}" if where else str(name)


def _arg(value: Any) -> Any:
    """An argument of a node as plain data (nodes by name, containers kept, the rest repr)."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, list | tuple):
        return {type(value).__name__: [_arg(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_text(repr(k)), _arg(v)] for k, v in value.items()]}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)  # nan and inf are not JSON
    if callable(value) and not isinstance(value, torch.Tensor):
        return {"callable": _qualified(value)}
    return {"repr": _text(repr(value))}


def _text(value: Any) -> str:
    """A repr without memory addresses (they differ from one process to the next)."""
    return _ADDRESS.sub("", str(value))


__all__ = ["describe", "stage_fingerprint"]
