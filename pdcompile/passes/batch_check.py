"""Batch check: a sequence-first model is not cut along its sequence without a word.

Microbatches (and replicas' shares) cut every input that holds samples along its batch
dimension, 0 unless compile's `batch_dim=` names another. A sequence-first model
(`nn.TransformerEncoder` at its default `batch_first=False`, an `nn.LSTM` without
`batch_first`, fed `(seq, batch, d)`) cut along dimension 0 is cut along the sequence: its
attention or recurrence sees a piece of each sequence, and the pipeline trains another function
without a word. So, where the user did not name the batch dimension and the pipeline will cut,
compile runs the model in evaluation mode (dropout off, BatchNorm on its running statistics,
no gradients, random state and buffers left as they were) on the example minibatch and on its
two halves along dimension 0. Where the halves' outputs, joined, equal the whole's, the rows of
dimension 0 are apart: nothing more is run (three forwards' worth in all). Where they differ
and the model gives the same output twice (no noise in evaluation mode), where no output
holds those rows (a sequence classifier's last state), or where a half raises (a (batch, seq)
padding mask left whole beside features cut along their sequence), it runs on the halves along dimension 1
(an input whose size there is not the batch along dimension 0, a (batch, seq) padding mask):
if those agree, the layout is sequence-first and compile refuses, naming the inputs and the
fix (batch_dim=1, or a batch_dim per input). A model that mixes its rows whichever way is left
alone: it mixes its samples by design (attention over the batch, a batch-size scale, an in-batch
statistic), and microbatches change what it computes as one process's accumulation would.
Output tensors that the halves do not cut (a loss over the batch, a (batch, batch)
similarity) are not compared, nor a batch of one. Values are compared with a tolerance (1e-3
of the output's largest magnitude): kernels round differently at another batch size, while
rows that read other rows differ at the scale of the values."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError
from pdcompile.runtime.evaluation import evaluation_mode
from pdcompile.runtime.microbatch_cut import (
    BATCH_FIRST,
    BatchDims,
    batch_size,
    cut_inputs,
    holds_samples,
)

RELATIVE_TOLERANCE = 1e-3
SEED = 0


def check_samples_apart(model: nn.Module, named: Mapping[str, Any],
                        call: Callable[[Mapping[str, Any]], Any],
                        whole: Sequence[str] = ()) -> None:
    """Raise PipelineInputError where `model`, run by `call(inputs by name)`, gives the rows of
    dimension 0 of the example minibatch `named` (its inputs by name; those in `whole` given
    whole) other outputs when they come in two halves, while it treats the rows of dimension
    1 apart: a sequence-first layout (see module doc). Forwards that fail on a half, and models
    or inputs on the meta device, are not this check's to explain."""
    batch = batch_size(named, whole)
    if batch is None or batch < 2:
        return
    tensors = [t for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves(
        dict(named))) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        return
    cut = [name for name, value in named.items() if name not in whole and any(
        holds_samples(leaf, batch) for leaf in pytree.tree_leaves(value))]
    across = _across(named, whole, cut)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with evaluation_mode([model]):
            rows = None if across is None else _apart(call, named, whole, BATCH_FIRST)
            if rows in ("apart", None):
                return
            if _apart(call, named, whole, across) != "apart":
                return  # mixed whichever way: by design (attention over the batch)
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    shapes = ", ".join(f"{name!r} {_shape(named[name])}" for name in cut)
    fix = "batch_dim=1" if set(across.inputs.values()) == {1} else \
        f"batch_dim={dict(across.inputs)!r}"
    assert across is not None
    seen = ("fails on the halves of dimension 0 of input"
            f"{'s' if len(cut) > 1 else ''} {shapes} but keeps the rows of dimension 1 apart "
            "(in eval mode, the example's two halves along dimension 1 give the whole's output, "
            "its halves along dimension 0 raise)") if rows == "failed" else (
        f"mixes the rows of dimension 0 of input{'s' if len(cut) > 1 else ''} {shapes} but "
        "keeps those of dimension 1 apart (in eval mode, the example's two halves along "
        "dimension 1 give the whole's output, its halves along dimension 0 do not)")
    raise PipelineInputError(
        f"{type(model).__name__} {seen}: a sequence-first layout (nn.TransformerEncoder or "
        "nn.LSTM without batch_first, fed (seq, batch, ...)), which microbatches cut along "
        "dimension 0 would cut along the sequence, training another function. Compile with "
        f"{fix} (target_batch_dim= for the target's), or batch_dim=0 to cut dimension 0 all "
        f"the same; if {cut[0]!r} holds no samples, compile with unbatched=({cut[0]!r},)")


def _across(named: Mapping[str, Any], whole: Sequence[str], cut: Sequence[str]
            ) -> BatchDims | None:
    """The cut along dimension 1 of the first input that holds samples: each input cut along
    dimension 1 where its size there is that batch, else along 0 where that is (a (batch,
    seq) padding mask beside (seq, batch, d) features); None where it would leave one of `cut`
    (cut along dimension 0) whole: the rows of dimension 0 then mix through it, whichever
    layout (`y * z.mean()`)."""
    first = next((leaf for name in cut for leaf in pytree.tree_leaves(named[name])
                  if isinstance(leaf, torch.Tensor) and leaf.dim() > 1), None)
    if first is None or first.shape[1] < 2:
        return None
    batch = int(first.shape[1])
    dims: dict[str, int] = {}
    for name, value in named.items():
        leaves = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        if name in whole or not leaves:
            continue
        for dim in (1, 0):
            if any(holds_samples(leaf, batch, dim) for leaf in leaves):
                dims[name] = dim
                break
    if any(name not in dims for name in cut):
        return None
    return BatchDims(default=0, inputs=dims, given=True)


def _apart(call: Callable[[Mapping[str, Any]], Any], named: Mapping[str, Any],
           whole: Sequence[str], dims: BatchDims) -> str | None:
    """How the model treats the rows along `dims` (see module doc): "apart" (its outputs on
    the two halves, joined, equal its output on the whole), "mixed" (they differ, and two runs
    of the whole agree), "uncut" (no output holds those rows: a mean over the batch, the last
    state of a sequence), "failed" (the whole runs, a half raises: a (batch, seq) mask left
    whole beside features cut along their sequence); None where that cannot be told (the
    whole fails, noise)."""
    whole = [*whole, *(name for name in named if name not in dims.inputs)] if dims.given \
        else list(whole)
    batch = batch_size(named, whole, dims)
    if batch is None or batch < 2:
        return None
    try:
        halves = cut_inputs(named, 2, index=0, why="halves", whole=whole, dims=dims)
        full = _run(call, named)
    except Exception:
        return None
    try:
        parts = [_run(call, half) for half in halves]
    except Exception:
        return "failed"
    agree = _rows_agree(full, parts)
    if agree is None:
        return "uncut"
    if agree:
        return "apart"
    try:  # noise in evaluation mode: no two runs agree, so rows cannot be compared
        torch.manual_seed(SEED + 1)
        again = call(named)
    except Exception:
        return None
    return "mixed" if _same(full, again) else None


def _run(call: Callable[[Mapping[str, Any]], Any], named: Mapping[str, Any]) -> Any:
    torch.manual_seed(SEED)
    return call(named)


def _rows_agree(full: Any, parts: list[Any]) -> bool | None:
    """Whether the output tensors of the whole that the halves cut along one dimension equal
    the halves' joined along it (None: no output was cut, such as a mean over the batch)."""
    leaves, spec = pytree.tree_flatten(full)
    halves = [pytree.tree_flatten(part) for part in parts]
    if any(s != spec for _, s in halves):
        return None  # another structure: not this check's to explain
    compared = False
    for index, leaf in enumerate(leaves):
        pieces = [h[index] for h, _ in halves]
        dim = _joined_dim(leaf, pieces)
        if dim is None:
            continue  # not the whole's rows (a mean over the batch, a (batch, batch) matrix)
        compared = True
        if not _close(torch.cat(pieces, dim), leaf):
            return False
    return True if compared else None


def _joined_dim(leaf: Any, pieces: list[Any]) -> int | None:
    """The one dimension along which `pieces` join into `leaf`'s shape (None: none)."""
    if not isinstance(leaf, torch.Tensor) or not all(
            isinstance(p, torch.Tensor) and p.dim() == leaf.dim() for p in pieces):
        return None
    differ = [d for d in range(leaf.dim()) if any(p.shape[d] != leaf.shape[d] for p in pieces)]
    if len(differ) != 1 or sum(p.shape[differ[0]] for p in pieces) != leaf.shape[differ[0]]:
        return None
    return differ[0]


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
