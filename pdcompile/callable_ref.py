"""Functions named by import path: how an export records a loss function without pickling it.

    reference(torch.nn.functional.cross_entropy)
        -> {"function": "torch.nn.functional:cross_entropy"}
    reference(functools.partial(F.cross_entropy, label_smoothing=0.1))
        -> {"partial": {"function": ...}, "args": [], "keywords": {"label_smoothing": 0.1}}
    reference(torch.nn.CrossEntropyLoss(weight=w))
        -> {"module": {class, attributes, parameters, buffers, children}}  (module_record)

`resolve` imports the module a reference names and returns the object it finds there (as the
`import` lines of the exported Python files do). A lambda, a function defined inside another
one, or one defined in a script run as `__main__` has no import path: `reference` raises
`NotReferable` saying which, and what to write instead.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from pdcompile.errors import PipelineInputError
from pdcompile.runtime.tensor_tree import TreeEncodeError, decode, encode


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
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def reference(fn: Any) -> dict[str, Any]:
    """The JSON reference of `fn` (module docstring); `NotReferable` if it has none."""
    if isinstance(fn, functools.partial):
        try:
            return {"partial": reference(fn.func), "args": encode(list(fn.args)),
                    "keywords": encode(dict(fn.keywords))}
        except TreeEncodeError as err:
            raise NotReferable(f"a functools.partial argument cannot be written as data "
                               f"({err})") from None
    if isinstance(fn, torch.nn.Module):
        from pdcompile.module_record import record_module

        try:
            record, _ = record_module(fn, values=True)
        except PipelineInputError as err:
            raise NotReferable(str(err)) from None
        return {"module": record}
    return {"function": import_path(fn)}


def resolve(ref: dict[str, Any], *, what: str) -> Callable[..., Any]:
    """The callable a reference names; `what` names it in the error if it cannot be found."""
    try:
        if "partial" in ref:
            return functools.partial(resolve(ref["partial"], what=what), *decode(ref["args"]),
                                     **decode(ref["keywords"]))
        if "module" in ref:
            from pdcompile.module_record import rebuild_module

            return rebuild_module(ref["module"])
        found = find(ref["function"])
    except (ImportError, AttributeError) as err:
        raise PipelineInputError(f"the {what} {ref.get('function', ref)!r} cannot be imported "
                                 f"({err}); install the package that defines it, or pass the "
                                 f"{what} again") from None
    except (KeyError, TypeError, ValueError) as err:
        raise PipelineInputError(f"the recorded {what} is malformed ({type(err).__name__}: "
                                 f"{err})") from None
    if not callable(found):
        raise PipelineInputError(f"the {what} {ref['function']!r} is not callable")
    return found  # type: ignore[no-any-return]


__all__ = ["NotReferable", "find", "import_path", "reference", "resolve"]
