"""Inputs that would reach forward only through `*args` or `**kwargs`: neither front end makes
them inputs of the graph (torch.fx names a placeholder per parameter, and the torch.export
front end binds one tensor tree per parameter), so both refuse them in the same words, naming
the parameter to add. Before, fx said the forward did not take the name, and torch.export
advised frontend='fx', which failed too."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from torch import nn

from pdcompile.errors import TraceError


def variadic_refusal(model: nn.Module, star: inspect.Parameter, names: Iterable[str]
                     ) -> TraceError:
    """The error for inputs `names` given to `model` through its `**kwargs` parameter `star`
    (or any given through its `*args`)."""
    params = inspect.signature(model.forward).parameters.values()
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    given = sorted(names)
    prefix = "**" if star.kind == star.VAR_KEYWORD else "*"
    added = [n for n in given if n not in named] if star.kind == star.VAR_KEYWORD else \
        ["y", "..."] if named else ["x", "y", "..."]
    wanted = ", ".join([*named, *added])
    what = ", ".join(map(repr, given)) if star.kind == star.VAR_KEYWORD else \
        f"inputs past {', '.join(named)}" if named else "the inputs"
    return TraceError(
        f"{what} would reach {type(model).__name__}.forward only through {prefix}{star.name}, "
        "which neither front end takes as inputs of the graph: give each input a parameter of "
        f"its own, e.g. forward(self, {wanted}, {prefix}{star.name})")


__all__ = ["variadic_refusal"]
