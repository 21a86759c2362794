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
from collections.abc import Callable
from typing import Any

import torch

from pdcompile.errors import PipelineInputError
from pdcompile.export.import_paths import NotReferable, find, import_path
from pdcompile.export.module_record import rebuild_module, record_module
from pdcompile.runtime.tensor_tree import TreeEncodeError, decode, encode


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
