"""The fingerprint of what a stage runs, so that a checkpoint is resumed only by the same model.

Two models can have the same parameters (names, shapes, dtypes) and the same plan and still
compute different things: Linear-ReLU-Linear and Linear-Tanh-Linear, or the same layers called
in another order. A checkpoint of one fits the other's `load_state_dict`, so the plan alone
cannot tell them apart. A stage's print (`stage_print`, what a checkpoint stores) has two parts:

- strict (`strict`, a SHA-256): what must match for the checkpoint's numbers to mean the same
  thing: every `state_dict` entry's name, shape and dtype, the order of the parameters the
  optimizer holds (its state is stored by position), and the graph's structure, node by node:
  name, kind, the attribute, module or method it names, and its arguments (other nodes by name,
  plain constants), in every traced module it calls;
- drifting (`drifting`, readable text): what may change for the same model when torch does:
  each called module's class and `extra_repr()` (so ReLU and Tanh, or LeakyReLU(0.1) and
  LeakyReLU(0.2), differ here), each function's qualified name (`torch.relu`,
  `aten.relu.default`) and the reprs of other constants.

A resume whose strict part differs is refused; one whose drifting part alone differs is refused
unless the user says it is the same model (backends/distributed_checkpoint.py). Both are the
same in every process and for every fresh compile of the same model: no ids, memory addresses
(stripped from reprs), file paths or dict orders. Modules that only hold parameters read with
`get_attr` are left out: a compiled pipeline keeps the user's `nn.Linear` there, an export
loaded back a plain `nn.Module` holding the same tensors. `stage_fingerprint` is the single hash
of both that checkpoints stored before the split (still compared with theirs).
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


def stage_print(module: torch.nn.Module, param_order: Sequence[str] = ()) -> dict[str, Any]:
    """What a checkpoint stores of a stage: {"strict": SHA-256 hex, "drifting": {"modules":
    {path: class and settings}, "functions": {node: qualified name}, "constants": {node:
    reprs}}} (see the module docstring)."""
    drifting: dict[str, dict[str, str]] = {"modules": {}, "functions": {}, "constants": {}}
    strict = {"graph": _structure(module, "", drifting),
              "state": describe(module, param_order)["state"],
              "param_order": list(param_order)}
    text = json.dumps(strict, sort_keys=True, separators=(",", ":"))
    return {"strict": hashlib.sha256(text.encode()).hexdigest(), "drifting": drifting}


def _structure(module: torch.nn.Module, prefix: str,
               drifting: dict[str, dict[str, str]]) -> Any:
    """A module's graph with every name that may drift replaced by its kind (the names go to
    `drifting`, keyed by where they sit); a module that is not traced: None."""
    if not isinstance(module, fx.GraphModule):
        return None
    nodes = []
    for node in module.graph.nodes:
        where = f"{prefix}{node.name}"
        target = node.target if isinstance(node.target, str) else "<function>"
        if not isinstance(node.target, str):
            drifting["functions"][where] = _qualified(node.target)
        constants: list[str] = []
        args = _strict_arg((node.args, node.kwargs), constants)
        if constants:
            drifting["constants"][where] = " ".join(constants)
        called = None
        if node.op == "call_module":
            sub = module.get_submodule(str(node.target))
            path = f"{prefix}{node.target}"
            drifting["modules"].setdefault(
                path, f"{_qualified(type(sub))}({_text(sub.extra_repr())})")
            called = _structure(sub, f"{path}.", drifting)
        nodes.append([node.name, node.op, target, args, called])
    return nodes


def _strict_arg(value: Any, constants: list[str]) -> Any:
    """`_arg` with functions and other reprs (which may drift) left as their kind; their text
    appended to `constants`."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, list | tuple):
        return {type(value).__name__: [_strict_arg(v, constants) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_strict_arg(k, constants), _strict_arg(v, constants)]
                         for k, v in value.items()]}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)
    if callable(value) and not isinstance(value, torch.Tensor):
        constants.append(_qualified(value))
        return "<callable>"
    constants.append(_text(repr(value)))
    return "<constant>"


def first_drift(saved: Any, mine: dict[str, dict[str, str]]) -> str:
    """The first difference between a saved drifting part and this stage's, in words."""
    if not isinstance(saved, dict):
        return "the checkpoint records none of its layers' names"
    for part, what in (("modules", "module"), ("functions", "operation at node"),
                       ("constants", "constant at node")):
        theirs = saved.get(part) if isinstance(saved.get(part), dict) else {}
        for key in [*mine[part], *(k for k in theirs if k not in mine[part])]:
            if theirs.get(key) != mine[part].get(key):
                return (f"{what} {key!r} was {theirs.get(key, 'absent')!r} in the checkpoint, is "
                        f"{mine[part].get(key, 'absent')!r} now")
    return "its layers' names are recorded otherwise"


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


__all__ = ["describe", "first_drift", "stage_fingerprint", "stage_print"]
