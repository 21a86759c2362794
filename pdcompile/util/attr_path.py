"""Dotted attribute paths, "encoder.layer.3.weight": read or set the attribute they name on a
module (or any object), as fx's get_attr targets and state-dict names spell them."""

from __future__ import annotations

from typing import Any


def get_path(root: Any, path: str) -> Any:
    """`root.<path>`, one attribute at a time (AttributeError naming the first missing one)."""
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value


def set_path(root: Any, path: str, value: Any) -> None:
    """Set `root.<path>` to `value` on the object that holds its last attribute."""
    owner, _, attr = path.rpartition(".")
    setattr(get_path(root, owner) if owner else root, attr, value)


__all__ = ["get_path", "set_path"]
