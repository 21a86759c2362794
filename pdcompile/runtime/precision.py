"""Mixed precision: the stages' forwards (and the loss) under `torch.autocast`.

`compile(..., autocast=torch.bfloat16)` runs every stage's forward, recomputation and the loss
in the autocast region a one-process training loop would put around `model(x)` and the loss:
the same operations in lower precision, the weights and their gradients in float32. The
messages between stages then carry what autocast made (bfloat16 activations, say), so their
shapes are worked out under it too. Kept in exports, so `pdcompile run` trains the same way.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from pdcompile.errors import PipelineInputError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check_autocast(value: Any) -> str | None:
    """`autocast` as given (None, a dtype or its name), as the dtype's name; a
    PipelineInputError naming the choices otherwise."""
    if value is None:
        return None
    for name, dtype in DTYPES.items():
        if value is dtype or value == name:
            return name
    raise PipelineInputError(f"autocast must be one of torch.bfloat16, torch.float16 (or "
                             f"their names), or None, got {value!r}")


def autocast_region(name: str | None, module: torch.nn.Module | None = None
                    ) -> AbstractContextManager[Any]:
    """The autocast region of dtype `name` on the device `module`'s weights are on (CPU
    without weights); nothing for None."""
    if name is None:
        return nullcontext()
    device = next((p.device for p in module.parameters()), None) if module is not None else None
    return torch.autocast(device_type=(device or torch.device("cpu")).type, dtype=DTYPES[name])


__all__ = ["DTYPES", "autocast_region", "check_autocast"]
