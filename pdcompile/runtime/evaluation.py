"""Evaluation mode: a forward pass as `model.eval()` runs it, on a pipeline's weights, that
leaves everything as it found it.

A compiled pipeline trains its stage graphs in the mode the model was captured in. Validation
needs the other mode (dropout off, BatchNorm on its running statistics), no gradients, and no
side effects: a validation pass must not move a replica's BatchNorm statistics or the random
state the next training step draws from. `Pipeline.evaluate` uses these helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def evaluation_mode(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within: every module (and submodule) in eval mode, no gradients, the CPU random state
    forked; afterwards each module is back in its own mode (a model may hold frozen BatchNorm
    layers in eval mode inside a training model: one `model.train(True)` would lose that)."""
    modes = {m: m.training for root in modules for m in root.modules()}
    try:
        for module in modes:
            module.training = False
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def evaluate_model(model: nn.Module, state: Mapping[str, torch.Tensor], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> Any:
    """`model(*args, **kwargs)` in evaluation mode with its parameters and buffers replaced by
    `state` (the pipeline's, under the model's names); buffers are copied first, so that nothing
    the forward writes reaches the pipeline."""
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    # a tied parameter by its first name only: functional_call ties the others to it, and
    # refuses two values for names the model ties
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    tied_again = {name for name, param in model.named_parameters(remove_duplicate=False)
                  if first[id(param)] != name}
    values = {name: value.clone() if name in buffers else value for name, value in state.items()
              if name not in tied_again}
    with evaluation_mode([model]):
        return torch.func.functional_call(model, values, tuple(args), dict(kwargs),
                                          tie_weights=True, strict=False)


__all__ = ["evaluate_model", "evaluation_mode"]
