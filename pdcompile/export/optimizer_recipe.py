"""An optimizer as data: its class, its hyper-parameters and its parameter groups.

`compile(optimizer=...)` takes any callable `params -> Optimizer` (a lambda, a partial, a
function). An export cannot keep the callable, so it keeps what the callable made: for each
stage, `type(opt)` by import path, `opt.defaults` and every param group's hyper-parameters
with the names of its parameters. `build` makes the same optimizer again over the named
parameters of a loaded stage; its state (momentum, Adam moments) travels separately.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.errors import PipelineInputError
from pdcompile.export.import_paths import NotReferable, find, import_path
from pdcompile.runtime.tensor_tree import TreeEncodeError, decode, encode


@dataclass(frozen=True)
class OptimizerRecipe:
    """`cls` ("torch.optim.sgd:SGD"), `defaults` and `groups` (hyper-parameters, and under
    "params" the names of the group's parameters), values as `tensor_tree.encode` writes them.
    """

    cls: str
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, names: Sequence[str],
           params: Sequence[torch.nn.Parameter]) -> OptimizerRecipe:
        """The recipe of `optimizer`, whose parameters are `params`, named `names`.
        Raises NotReferable when the optimizer's class or a hyper-parameter cannot be
        written down."""
        path = import_path(type(optimizer))
        name_of = {id(p): n for n, p in zip(names, params, strict=True)}
        groups = []
        try:
            for g in optimizer.param_groups:
                unknown = [p for p in g["params"] if id(p) not in name_of]
                if unknown:
                    raise NotReferable("it holds parameters that are not the stage's")
                hyper = {k: v for k, v in g.items() if k != "params"}
                groups.append({"params": [name_of[id(p)] for p in g["params"]],
                               **encode(hyper, where="a param group")})
            defaults = encode(dict(optimizer.defaults), where="the optimizer's defaults")
        except TreeEncodeError as err:
            raise NotReferable(str(err)) from None
        return cls(path, defaults, groups)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The class, imported (a clear error if it cannot be)."""
        try:
            found = find(self.cls)
        except (ImportError, AttributeError) as err:
            raise PipelineInputError(f"the optimizer class {self.cls!r} cannot be imported "
                                     f"({err}); install the package that defines it, or pass "
                                     "optimizer= again") from None
        if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
            raise PipelineInputError(f"{self.cls!r} is not a torch.optim.Optimizer class")
        return found

    def _constructor_keywords(self, optimizer: type[torch.optim.Optimizer]) -> dict[str, Any]:
        """The defaults the constructor accepts as keywords (the rest are set afterwards)."""
        defaults = decode(self.defaults)
        try:
            accepted = inspect.signature(optimizer.__init__).parameters
        except (TypeError, ValueError):
            return dict(defaults)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            return dict(defaults)
        return {k: v for k, v in defaults.items() if k in accepted}

    def build(self, named: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over the parameters called `named` (same class, groups, settings)."""
        optimizer_cls = self.optimizer_class()
        groups = []
        for group in self.groups:
            missing = [n for n in group["params"] if n not in named]
            if missing:
                raise PipelineInputError(f"the recorded {self.cls} optimizer names parameters "
                                         f"the stage does not have ({missing[:3]})")
            hyper = decode({k: v for k, v in group.items() if k != "params"})
            groups.append({"params": [named[n] for n in group["params"]], **hyper})
        optimizer = optimizer_cls(groups, **self._constructor_keywords(optimizer_cls))
        optimizer.defaults.update(decode(self.defaults))
        return optimizer

    def __call__(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """As an optimizer factory: the same class and defaults over `params`, one group."""
        optimizer_cls = self.optimizer_class()
        optimizer = optimizer_cls(params, **self._constructor_keywords(optimizer_cls))
        optimizer.defaults.update(decode(self.defaults))
        return optimizer

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (pipeline.json)."""
        return {"class": self.cls, "defaults": self.defaults, "groups": self.groups}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerRecipe:
        """Inverse of `to_dict`."""
        return cls(str(data["class"]), dict(data["defaults"]), list(data["groups"]))


__all__ = ["OptimizerRecipe"]
