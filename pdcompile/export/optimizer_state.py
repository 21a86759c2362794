"""A stage's saved optimizer state fitted to its optimizer: one check for the loader, which fits
it to the optimizer it builds, and for the check that loads nothing (`pdcompile verify`,
export/checked.py), which fits it to the same optimizer built over parameters of the stage's
shapes alone (meta tensors: no memory).

torch's `load_state_dict` takes any tree whose groups have the optimizer's lengths: a table
or a tensor of another shape in place of Adam's exp_avg (one byte of the file changed, under a
manifest written again) loaded and failed at the first step; and verify passed any state the
loader refused, as only the loader fitted it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import DamagedFileError

# torch.optim's per-parameter buffers that always have the parameter's shape
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                           "square_avg", "acc_delta", "sum", "grad_avg", "exp_inf", "ax",
                           "prev", "step_size"})


def fit_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, path: Path) -> None:
    """Load `state` (read from `path`) into `optimizer` and check its values; one line naming
    the file otherwise."""
    try:
        optimizer.load_state_dict(state)
        _check_state_values(optimizer)
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedFileError(f"{path} does not fit the stage's {type(optimizer).__name__} "
                               f"optimizer ({detail}); export the pipeline again, or pass the "
                               "optimizer it was saved with") from None


def _check_state_values(optimizer: torch.optim.Optimizer) -> None:
    """No value of a parameter's optimizer state a table or text, and torch.optim's buffers
    tensors of the parameter's shape (ValueError otherwise): a number in place of Adam's
    exp_avg loaded and was broadcast over the parameter at the first step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                wrong = isinstance(value, dict | str | bytes) or (
                    # None: SGD without momentum keeps momentum_buffer None
                    key in _PARAM_SHAPED and value is not None
                    and (not isinstance(value, torch.Tensor) or value.shape != param.shape))
                if wrong:
                    shown = tuple(value.shape) if isinstance(value, torch.Tensor) else \
                        type(value).__name__
                    raise ValueError(f"state {key!r} of a parameter of shape "
                                     f"{tuple(param.shape)} is {shown}")


__all__ = ["fit_optimizer_state"]
