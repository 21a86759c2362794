"""The shapes of a run's messages, known ahead: what a receiver allocates before data arrives.

One home for them: `message_table` turns one microbatch's stage outputs into the shapes and
dtypes of every message it sends (keyed by the tags of microbatch 0), and `spec_function` turns
tables into the `Tag -> [TensorSpec]` function the stage runtime and the transports read. The
local backend needs one table per run; the distributed backend one per microbatch shape (a
short last minibatch, another sequence length).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pdcompile.runtime.stage_runtime import SpecFn, StageIO, _carries_grad, _encode
from pdcompile.runtime.transport import Tag, TensorSpec

MessageTable = Mapping[Tag, list[TensorSpec]]


def message_table(stages: Sequence[StageIO], values: Mapping[tuple[int, str], Any]
                  ) -> dict[Tag, list[TensorSpec]]:
    """Shapes and dtypes of every message of one microbatch, from its stage outputs `values`
    ((stage, name) -> value), keyed by the tags of microbatch 0. Gradients flow back only for
    floating-point and complex tensors (values that cross as numbers or sizes get none)."""
    out: dict[Tag, list[TensorSpec]] = {}
    for program in stages:
        for dst, names in program.sends.items():
            acts = [_encode(values[program.index, n], n) for n in names]
            out[Tag("act", program.index, dst, 0)] = [
                TensorSpec(tuple(t.shape), t.dtype) for t in acts]
            out[Tag("grad", dst, program.index, 0)] = [
                TensorSpec(tuple(t.shape), t.dtype) for t, n in zip(acts, names, strict=True)
                if _carries_grad(t) and n not in program.kinds]
    return out


def spec_function(table_of: Callable[[int], MessageTable], vertical_sync: bool) -> SpecFn:
    """Tag -> the shapes of that message, microbatch m's read from `table_of(m)`; under
    vertical sync every activation message carries the weight version number too."""
    version = [TensorSpec((), torch.int64)] if vertical_sync else []

    def specs(tag: Tag) -> list[TensorSpec]:
        found = list(table_of(tag.microbatch)[Tag(tag.kind, tag.src_stage, tag.dst_stage, 0)])
        return found + version if tag.kind == "act" else found

    return specs


__all__ = ["MessageTable", "message_table", "spec_function"]
