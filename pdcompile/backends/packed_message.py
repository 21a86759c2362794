"""A message of several tensors as one buffer, so that it crosses gloo as one transfer.

gloo moves every `isend` as three transfers (the sender's notice, the receiver's notice, the
data), each a wake-up of its I/O threads, which on a small machine take their CPU from the
ranks' compute (docs/runtime-profile.md, third and fourth rounds). A message whose tensors are
packed into one byte buffer costs one `isend` and one copy of its bytes on the sender; the
receiver reads its tensors as views of the buffer (no copy). Both sides decide from the shapes
alone (`packs`), so they always agree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from pdcompile.runtime.transport import TensorSpec

_ALIGN = 16  # every tensor starts on a multiple of it, so a byte view can be any dtype's view
# above it, copying a message costs more than the transfers it saves (runtime-profile.md)
PACK_LIMIT = 4 << 20


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _offsets(specs: Sequence[TensorSpec]) -> tuple[tuple[int, ...], int]:
    """Where each tensor starts in the buffer, and the buffer's size in bytes."""
    return _layout(tuple(specs))


@functools.lru_cache(maxsize=256)
def _layout(specs: tuple[TensorSpec, ...]) -> tuple[tuple[int, ...], int]:
    """`_offsets`, once per message shape: a run sends the same few shapes every microbatch,
    and each message asked for its layout three times (about 10 Python calls a time)."""
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + _nbytes(spec)
    return tuple(offsets), end


def packs(specs: Sequence[TensorSpec]) -> bool:
    """Whether a message of these tensors travels as one buffer: several tensors, together at
    most PACK_LIMIT bytes."""
    return len(specs) > 1 and _offsets(specs)[1] <= PACK_LIMIT


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), tensor.dtype)


def pack(tensors: Sequence[torch.Tensor],
         specs: Sequence[TensorSpec] | None = None) -> torch.Tensor:
    """One byte buffer holding `tensors` (as `unpack` reads them back); `specs`: theirs, where
    the caller has them already."""
    offsets, size = _offsets([spec_of(t) for t in tensors] if specs is None else specs)
    device = tensors[0].device
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for tensor, start in zip(tensors, offsets, strict=True):
        raw = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        buffer[start:start + raw.numel()].copy_(raw)
    return buffer


def empty_packed(specs: Sequence[TensorSpec], device: torch.device) -> torch.Tensor:
    """A receive buffer for a packed message of `specs`."""
    return torch.empty(_offsets(specs)[1], dtype=torch.uint8, device=device)


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The tensors of a packed message: views of `buffer`, valid once its data has arrived."""
    offsets, _ = _offsets(specs)
    return [buffer[start:start + _nbytes(spec)].view(spec.dtype).view(spec.shape)
            for spec, start in zip(specs, offsets, strict=True)]


__all__ = ["PACK_LIMIT", "empty_packed", "pack", "packs", "spec_of", "unpack"]
