"""Batch check: a model whose inputs are cut along dimension 0 treats those rows apart.

Microbatches (and replicas' shares) cut every input that holds samples along its batch
dimension, 0 unless compile's `batch_dim=` names another. A sequence-first model
(`nn.TransformerEncoder` at its default `batch_first=False`, an `nn.LSTM` without
`batch_first`, fed `(seq, batch, d)`) cut along dimension 0 is cut along the sequence: its
attention or recurrence sees a piece of each sequence, and the pipeline trains another function
without a word. So, where the user did not name the batch dimension and the pipeline will cut,
compile runs the model in evaluation mode (dropout off, BatchNorm on its running statistics,
no gradients, random state and buffers left as they were) on the example minibatch and on its
two halves along dimension 0: outputs whose rows differ from the whole's are refused, naming the
inputs and the fix. Output tensors that do not hold the example's rows (a loss over the batch,
a (batch, batch) similarity) are not compared, nor is a model whose output differs between two
runs of the whole (noise in evaluation mode), nor a batch of one. Values are compared with a
tolerance (1e-3 of the output's largest magnitude): kernels round differently at another batch
size, while rows that read other rows differ at the scale of the values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError
from pdcompile.runtime.evaluation import evaluation_mode
from pdcompile.runtime.microbatch_cut import batch_size, cut_inputs, holds_samples

RELATIVE_TOLERANCE = 1e-3
SEED = 0


def check_samples_apart(model: nn.Module, named: Mapping[str, Any],
                        call: Callable[[Mapping[str, Any]], Any],
                        whole: Sequence[str] = ()) -> None:
    """Raise PipelineInputError where `model`, run by `call(inputs by name)`, gives the rows of
    the example minibatch `named` (its inputs by name; those in `whole` given whole) other
    outputs when they come in two halves along dimension 0 (see module doc). Forwards that fail
    on a half, and models or inputs on the meta device, are not this check's to explain."""
    batch = batch_size(named, whole)
    if batch is None or batch < 2:
        return
    tensors = [t for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves(
        dict(named))) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        return
    halves = cut_inputs(named, 2, index=0, why="halves", whole=whole)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with evaluation_mode([model]):
            try:
                full = _run(call, named)
                parts = [_run(call, half) for half in halves]
            except Exception:
                return
            if _rows_agree(full, parts, batch):
                return
            try:  # noise in evaluation mode: no two runs agree, so rows cannot be compared
                torch.manual_seed(SEED + 1)
                again = call(named)
            except Exception:
                return
            if not _same(full, again):
                return
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    cut = [name for name, value in named.items() if name not in whole and any(
        holds_samples(leaf, batch) for leaf in pytree.tree_leaves(value))]
    shapes = ", ".join(f"{name!r} {_shape(named[name])}" for name in cut)
    raise PipelineInputError(
        f"{type(model).__name__} mixes the rows of dimension 0 of input"
        f"{'s' if len(cut) > 1 else ''} {shapes}: its output on the example's two halves along "
        "dimension 0 differs from its output on the whole example (in eval mode), so cutting "
        "them into microbatches there would train another function. If the samples lie along "
        "another dimension (a sequence-first model: nn.TransformerEncoder or nn.LSTM without "
        f"batch_first, fed (seq, batch, ...)), compile with batch_dim=1 (or batch_dim="
        f"{{{cut[0]!r}: 1}}; target_batch_dim= for the target); if {cut[0]!r} holds no "
        f"samples, compile with unbatched=({cut[0]!r},)")


def _run(call: Callable[[Mapping[str, Any]], Any], named: Mapping[str, Any]) -> Any:
    torch.manual_seed(SEED)
    return call(named)


def _rows_agree(full: Any, parts: list[Any], batch: int) -> bool:
    """Whether the output tensors of the whole that hold its rows (dimension 0 of size `batch`)
    equal the halves' outputs joined along dimension 0."""
    leaves, spec = pytree.tree_flatten(full)
    halves = [pytree.tree_flatten(part) for part in parts]
    if any(s != spec for _, s in halves):
        return True  # another structure: not this check's to explain
    for index, leaf in enumerate(leaves):
        pieces = [h[index] for h, _ in halves]
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == batch
                and all(isinstance(p, torch.Tensor) and p.dim() == leaf.dim()
                        and p.shape[1:] == leaf.shape[1:] for p in pieces)
                and sum(p.shape[0] for p in pieces) == batch):
            continue  # not the whole's rows (a mean over the batch, a (batch, batch) matrix)
        if not _close(torch.cat(pieces), leaf):
            return False
    return True


def _same(first: Any, second: Any) -> bool:
    a, spec_a = pytree.tree_flatten(first)
    b, spec_b = pytree.tree_flatten(second)
    return spec_a == spec_b and all(
        not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and x.shape == y.shape
                                            and _close(y, x))
        for x, y in zip(a, b, strict=True))


def _close(value: torch.Tensor, want: torch.Tensor) -> bool:
    if not (value.is_floating_point() or value.is_complex()):
        return bool(torch.equal(value, want))
    value, want = value.double(), want.double()
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return bool(torch.allclose(value, want, rtol=RELATIVE_TOLERANCE,
                               atol=RELATIVE_TOLERANCE * scale + 1e-12, equal_nan=True))


def _shape(value: Any) -> str:
    leaves = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return f"({', '.join(map(str, leaves[0].shape))})" if leaves else ""


__all__ = ["check_samples_apart"]
