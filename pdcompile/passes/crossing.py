"""Structured values that cross stages: sent as their pytree leaves, rebuilt by the receiver.

Only tensors, Python numbers and sizes travel between stages. A module may return a richer value,
e.g. a Hugging Face `BaseModelOutputWithPoolingAndCrossAttentions` or any container registered
with `torch.utils._pytree`; when such a value is used by a later stage, the split pass has the
producing stage flatten it (`flatten_value`) and send its leaves, and the consuming stage rebuild
it (`rebuild_value`) from the leaves and the structure written down as text (`spec_text`). The
functions are called from the generated stage code, so they live at module level.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from torch.utils import _pytree as pytree


def flatten_value(value: Any) -> tuple[Any, ...]:
    """The pytree leaves of `value`, in order."""
    return tuple(pytree.tree_leaves(value))


def rebuild_value(leaves: list[Any], spec: str) -> Any:
    """The value whose structure `spec` (from `spec_text`) describes, with these leaves."""
    return pytree.tree_unflatten(list(leaves), load_spec(spec))


def spec_text(spec: pytree.TreeSpec) -> str:
    """The structure as JSON text (`treespec_dumps`); ValueError naming the type that cannot be
    written down (a container registered without `serialized_type_name`)."""
    try:
        return pytree.treespec_dumps(spec)
    except Exception as err:
        raise ValueError(f"its structure ({spec}) cannot be written down: {err}") from None


def load_spec(text: str) -> pytree.TreeSpec:
    """`treespec_loads`, importing the modules that register the types it names first (a worker
    process that has not imported, say, transformers yet)."""
    try:
        return pytree.treespec_loads(text)
    except Exception:
        for name in sorted(_type_names(json.loads(text))):
            module = name.rpartition(".")[0]
            if module:
                try:
                    importlib.import_module(module)
                except ImportError:
                    pass
        return pytree.treespec_loads(text)


def _type_names(tree: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(tree, dict):
        if isinstance(tree.get("type"), str):
            found.add(tree["type"])
        for child in tree.values():
            found |= _type_names(child)
    elif isinstance(tree, list):
        for child in tree:
            found |= _type_names(child)
    return found


__all__ = ["flatten_value", "load_spec", "rebuild_value", "spec_text"]
