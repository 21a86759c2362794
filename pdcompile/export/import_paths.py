"""Import paths: "package.module:Qual.name" of a function or class, and the object back.

What an export writes instead of pickling a callable or a class (callable_ref, module_record,
optimizer_recipe): reading it back imports the module it names, as an `import` line would.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdcompile.util.attr_path import get_path


class NotReferable(ValueError):
    """A callable with no import path (the message says why and what to do)."""


def import_path(obj: Any) -> str:
    """"package.module:Qual.name" of a function or class that can be imported back as is."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    what = getattr(obj, "__name__", None) or type(obj).__name__
    if not module or not qualname:
        raise NotReferable(f"{what!r} has no module and name to import it by")
    if qualname.rpartition(".")[2] == "<lambda>":
        raise NotReferable("it is a lambda")
    if "<locals>" in qualname:
        raise NotReferable(f"{qualname.replace('.<locals>', '')} is defined inside a function")
    if module == "__main__":
        raise NotReferable(f"{qualname} is defined in the script run as __main__, which "
                           "another process cannot import")
    path = f"{module}:{qualname}"
    try:
        found = find(path)
    except (ImportError, AttributeError):
        raise NotReferable(f"{path} cannot be imported back") from None
    if found is not obj and getattr(found, "__func__", found) is not obj:
        raise NotReferable(f"{path} names another object")
    return path


def find(path: str) -> Any:
    """The object at "package.module:Qual.name" (ImportError / AttributeError if none)."""
    module_name, _, qualname = path.partition(":")
    return get_path(importlib.import_module(module_name), qualname)


__all__ = ["NotReferable", "find", "import_path"]
