"""Where a captured graph fixed training-mode behaviour at capture time.

`model.eval()` switches dropout off and BatchNorm to its running statistics by flipping
`module.training`. A graph keeps that switch only where the operation stayed a module
(`nn.Dropout`, `nn.BatchNorm2d` as fx leaf modules); where it became a function call the mode
was read once, at capture, and written into the call: `F.dropout(x, p, self.training)` traced
by torch.fx, every batch norm and dropout of a torch.export graph (`aten.batch_norm(...,
training=True, ...)`), attention with `dropout_p=0.1 if self.training else 0.0`. Such a graph
computes training mode whatever its modules say, so evaluating with it would be silently wrong.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

# the arguments that carry the mode in torch's functional and aten signatures
_FLAGS = ("training", "train")
# dropout probabilities (F.dropout's p, an RNN's dropout between layers): at 0 both modes agree
_PROBABILITIES = ("p", "dropout")
_ATTENTION_DROPOUT = "dropout_p"
# operations that only exist in training mode (no flag to read)
_TRAINING_ONLY = ("_batch_norm_with_update", "native_dropout")


def training_mode_calls(gm: fx.GraphModule) -> list[str]:
    """The nodes of `gm` whose training-mode behaviour is fixed in the graph, each as
    "node (operation)"; empty where switching the modules to eval mode switches the graph."""
    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _operation_name(node.target)
        if any(name.startswith(only) or f".{only}" in name for only in _TRAINING_ONLY):
            found.append(f"{node.name} ({name})")
            continue
        arguments = _arguments(node, gm)
        if arguments is None:
            continue
        flag = next((arguments[k] for k in _FLAGS if k in arguments), False)
        if flag is True and all(arguments.get(k, 1) != 0 for k in _PROBABILITIES):
            found.append(f"{node.name} ({name}, training=True)")
        elif _positive(arguments.get(_ATTENTION_DROPOUT)):
            found.append(f"{node.name} ({name}, dropout_p={arguments[_ATTENTION_DROPOUT]})")
    return found


def _arguments(node: fx.Node, gm: fx.GraphModule) -> dict[str, Any] | None:
    """The call's arguments by name, where torch knows the signature."""
    try:
        normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an operation torch cannot normalise has no known flag
        return None
    return None if normalized is None else dict(normalized.kwargs)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _operation_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module and "aten" not in str(target) else str(target)


__all__ = ["training_mode_calls"]
