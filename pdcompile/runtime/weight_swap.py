"""Run a stage module with a stashed weight version in place of its live parameters.

This is what `torch.func.functional_call(module, tensors, args)` does with a dict that names
every parameter (tied names included): each parameter slot (`owner._parameters[attr]`) holds
the version's tensor for the call and gets the live parameter back afterwards, even when the
call raises. `functional_call` finds the slots again at every call (it walks the module tree,
checks ties, builds accessors): about 350 Python calls a forward on a stage of 4 Linear layers,
which weight stashing pays for every minibatch (docs/runtime-profile.md). Here the slots are
found once per runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class ParameterSlots:
    """Where each named parameter of `module` lives: its owning submodule and attribute."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str]) -> None:
        self.module = module
        self._slots: list[tuple[torch.nn.Module, str, str]] = []
        for name in names:
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path) if path else module
            if attr not in owner._parameters:
                raise KeyError(f"{name!r} is not a parameter of the stage module")
            self._slots.append((owner, attr, name))

    def call(self, tensors: Mapping[str, torch.Tensor], args: Sequence[Any]) -> Any:
        """`module(*args)` with `tensors[name]` in place of every named parameter."""
        saved: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for owner, attr, name in self._slots:
                slots = owner._parameters
                saved.append((slots, attr, slots[attr]))
                slots[attr] = tensors[name]  # type: ignore[assignment]  # as functional_call
            return self.module(*args)
        finally:
            for slots, attr, live in reversed(saved):
                slots[attr] = live


__all__ = ["ParameterSlots"]
