"""A minibatch cut into microbatches: which inputs hold samples, and how each is cut.

An input holds samples when its first dimension is the minibatch's batch size: that of the
first tensor of at least one dimension among the inputs (in the forward's order, the leaves of
a list or dict input in pytree order). Such an input is cut along its first dimension; any other
value goes whole to every microbatch, as the model reads it whole in one process: a number, a
0-d tensor (a temperature), a mask of fixed shape (seq, seq), per-class weights (k,). Inputs by
position and by name follow this one rule (before, every tensor of at least one dimension was
cut: a shape error, or a silent wrong result where the sizes happened to fit). The rule is
applied once to the example minibatch, and the inputs it finds whole stay whole in every
minibatch (`inferred_whole`), so that a short last batch of an epoch whose size happens to be a
mask's (seq) does not cut the mask. Sizes alone cannot tell a whole input whose first dimension
equals the example's batch size (k classes at batch size k) from one that holds samples: such
inputs are named by the user (compile's `unbatched=`). Names in `whole` are never cut. A target
is cut whole (every tensor of at least one dimension), as a loss reads it per sample.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError


def batch_size(named: Mapping[str, Any], whole: Collection[str] = ()) -> int | None:
    """The minibatch's batch size (see module doc; the inputs named in `whole` left out);
    None where no input has a dimension."""
    for name, value in named.items():
        if name in whole:
            continue
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim():
                return int(leaf.shape[0])
    return None


def inferred_whole(named: Mapping[str, Any], whole: Collection[str] = ()) -> tuple[str, ...]:
    """The inputs (besides `whole`) of tensors with dimensions of which none holds samples."""
    batch = batch_size(named, whole)
    out = []
    for name, value in named.items():
        shaped = [leaf for leaf in pytree.tree_leaves(value)
                  if isinstance(leaf, torch.Tensor) and leaf.dim()]
        if name not in whole and shaped and not any(holds_samples(v, batch) for v in shaped):
            out.append(name)
    return tuple(out)


def misread_batch(named: Mapping[str, Any], target: Any, whole: Collection[str] = (),
                  given: Collection[str] = ()) -> str | None:
    """Why the batch size read from the inputs cannot be the minibatch's (None where it can):
    the target and another input (not named by the user, `given`) hold another count of
    samples than the first input's first dimension, so the first input holds none (a mask
    first in the forward's parameters)."""
    held = [leaf for leaf in pytree.tree_leaves(target)
            if isinstance(leaf, torch.Tensor) and leaf.dim()]
    batch = batch_size(named, whole)
    if not held or batch is None or int(held[0].shape[0]) == batch:
        return None
    samples = int(held[0].shape[0])
    first = next(name for name, value in named.items() if name not in whole
                 and batch_size({name: value}) is not None)
    others = [name for name, value in named.items() if name not in given and any(
        holds_samples(leaf, samples) for leaf in pytree.tree_leaves(value))]
    if not others:
        return None
    return (f"input {first!r} comes first, so its first dimension ({batch}) was taken as the "
            f"batch size, but the target and input {others[0]!r} hold {samples} samples; if "
            f"{first!r} holds no samples, compile with unbatched=({first!r},)")


def holds_samples(value: Any, batch: int | None) -> bool:
    """Whether `value` is cut along its first dimension in a minibatch of `batch` samples
    (None: any tensor of at least one dimension is, as a target is)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and (
        batch is None or int(value.shape[0]) == batch)


def cut(value: Any, m: int, name: str, *, batch: int | None, index: int, why: str
        ) -> list[Any]:
    """`value` as `m` microbatches: each tensor that holds samples (`holds_samples`) cut along
    its first dimension into parts differing by at most one; in a list, tuple or dict (any
    pytree) each leaf so; anything else given whole to every part."""
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) != 1 or leaves[0] is not value:
        parts = [cut(leaf, m, name, batch=batch, index=index, why=why) for leaf in leaves]
        return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
    if not holds_samples(value, batch):
        return [value] * m
    if value.shape[0] == 0:  # nothing to train on, whatever the microbatch count
        raise PipelineInputError(f"minibatch {index}: {name} is empty (batch size 0); give "
                                 f"it at least {m} sample{'s' if m > 1 else ''}, or leave the "
                                 "empty minibatch out of the stream")
    if value.shape[0] < m:
        raise PipelineInputError(f"minibatch {index}: {name} has batch size {value.shape[0]}, "
                                 f"too small to cut into {m} {why}; give it at least {m} "
                                 "samples, or compile with fewer microbatches")
    return list(torch.tensor_split(value, m))


def cut_inputs(named: Mapping[str, Any], m: int, *, index: int, why: str,
               whole: Collection[str] = ()) -> list[dict[str, Any]]:
    """Inputs by name as `m` microbatches of inputs by name (see module doc); those named in
    `whole` given whole to each."""
    batch = batch_size(named, whole)
    parts = {name: [value] * m if name in whole else
             cut(value, m, f"input {name!r}", batch=batch, index=index, why=why)
             for name, value in named.items()}
    return [{name: parts[name][i] for name in named} for i in range(m)]


def cut_target(target: Any, m: int, *, index: int, why: str) -> list[Any]:
    """A target as `m` microbatches: every tensor of it of at least one dimension cut."""
    return cut(target, m, "the target", batch=None, index=index, why=why)


def first_microbatch(named: Mapping[str, Any], m: int, whole: Collection[str] = ()
                     ) -> dict[str, Any]:
    """The first (largest) of the `m` microbatches of inputs by name, unchecked."""
    batch = batch_size(named, whole)
    return {name: value if name in whole else
            pytree.tree_map(lambda v: v[:-(-v.shape[0] // m)] if holds_samples(v, batch)
                            else v, value)
            for name, value in named.items()}


def checked_whole(names: Any, inputs: Collection[str]) -> tuple[str, ...]:
    """compile's `unbatched=`: names of the model's inputs (one name alone as a string; None as
    none, as the other options take it)."""
    given = (names,) if isinstance(names, str) else () if names is None else names
    try:
        given = tuple(given)
    except TypeError:
        given = (given,)
    for name in given:
        if not isinstance(name, str) or name not in inputs:
            raise PipelineInputError(
                f"unbatched={names!r}: {name!r} is not an input of the model; name the inputs "
                f"that hold no samples among {', '.join(inputs) or 'none'} (e.g. "
                "unbatched=('mask',))")
    return given


__all__ = ["batch_size", "checked_whole", "cut", "cut_inputs", "cut_target",
           "first_microbatch", "holds_samples", "inferred_whole", "misread_batch"]
