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

The samples lie along dimension 0 unless compile's `batch_dim=` says otherwise (`BatchDims`): a
sequence-first model (`nn.TransformerEncoder` at `batch_first=False`, an `nn.LSTM` without
`batch_first`, fed `(seq, batch, d)`) names dimension 1, for every input or per input by name,
and its target's (`target_batch_dim=`). Every rule above then reads that dimension: the batch
size, which inputs hold samples, and where inputs and target are cut.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError


@dataclass(frozen=True)
class BatchDims:
    """Where the samples lie: `inputs[name]` for an input named there, else `default`; the
    target's tensors along `target`. `given`: whether the user named them (compile's
    `batch_dim=`), which spares the model compile's check that it treats the samples of
    dimension 0 apart (passes/batch_check.py)."""

    default: int = 0
    inputs: Mapping[str, int] = field(default_factory=dict)
    target: int = 0
    given: bool = False

    def of(self, name: str) -> int:
        """The dimension input `name` is cut along."""
        return self.inputs.get(name, self.default)

    def to_json(self) -> dict[str, Any]:
        """As an export's pipeline.json keeps it (`from_json` reads it back)."""
        return {"default": self.default, "inputs": dict(self.inputs), "target": self.target,
                "given": self.given}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> BatchDims:
        """What `to_json` wrote (None, an export from before the option: dimension 0)."""
        if not data:
            return BATCH_FIRST
        return cls(int(data.get("default", 0)),
                   {str(k): int(v) for k, v in dict(data.get("inputs", {})).items()},
                   int(data.get("target", 0)), bool(data.get("given", True)))


BATCH_FIRST = BatchDims()


def checked_batch_dims(batch_dim: Any, target_batch_dim: Any,
                       inputs: Collection[str] | None) -> BatchDims:
    """compile's `batch_dim=` (None: dimension 0, checked at compile; an int for every input;
    a mapping {input name: dimension}, the others along 0) and `target_batch_dim=` (None: an
    int `batch_dim`, else 0); names checked against `inputs` (None: not yet known)."""
    def natural(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PipelineInputError(
                f"{what}={value!r}: give the dimension that holds the samples as an integer "
                "0 or more (e.g. batch_dim=1 for (seq, batch, ...) inputs, as "
                "nn.TransformerEncoder and nn.LSTM take them without batch_first)")
        return value

    per_input: dict[str, int] = {}
    if batch_dim is None:
        default, given = 0, False
    elif isinstance(batch_dim, Mapping):
        default, given = 0, True
        for name, dim in batch_dim.items():
            if inputs is not None and name not in inputs:
                raise PipelineInputError(
                    f"batch_dim={dict(batch_dim)!r}: {name!r} is not an input of the model; "
                    f"name inputs among {', '.join(inputs) or 'none'} (e.g. "
                    f"batch_dim={{{next(iter(inputs), 'x')!r}: 1}}), or give one integer for "
                    "all")
            per_input[name] = natural(dim, f"batch_dim[{name!r}]")
    else:
        default, given = natural(batch_dim, "batch_dim"), True
    target = (default if isinstance(batch_dim, int) else 0) if target_batch_dim is None \
        else natural(target_batch_dim, "target_batch_dim")
    return BatchDims(default, per_input, target, given)


def batch_size(named: Mapping[str, Any], whole: Collection[str] = (),
               dims: BatchDims = BATCH_FIRST) -> int | None:
    """The minibatch's batch size (see module doc; the inputs named in `whole` left out);
    None where no input has the dimension that holds its samples."""
    for name, value in named.items():
        if name in whole:
            continue
        dim = dims.of(name)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
                return int(leaf.shape[dim])
    return None


def check_dims_held(named: Mapping[str, Any], whole: Collection[str], dims: BatchDims,
                    target: Any = None) -> None:
    """Refuse a `batch_dim=` the example cannot hold: an input named in it (or, for one int, every
    input) whose tensors have no such dimension, or a target (where given) whose tensors lack
    `dims.target`. Left alone, such an input went whole to every microbatch, silently (and the
    error came at the first step, or in a worker of `pdcompile run`, in the loss's words)."""
    def shapes(value: Any) -> list[tuple[int, ...]]:
        return [tuple(leaf.shape) for leaf in pytree.tree_leaves(value)
                if isinstance(leaf, torch.Tensor) and leaf.dim()]

    if dims.given:
        named_inputs = [n for n in dims.inputs if n in named and n not in whole]
        for name in named_inputs:
            held = shapes(named[name])
            if held and all(len(shape) <= dims.of(name) for shape in held):
                raise PipelineInputError(
                    f"batch_dim[{name!r}]={dims.of(name)}: input {name!r} has shape "
                    f"{held[0]}, which has no dimension {dims.of(name)}; name the dimension "
                    f"that holds its samples (0 to {len(held[0]) - 1}), or unbatched="
                    f"({name!r},) if it holds none")
        others = {n: v for n, v in named.items() if n not in dims.inputs and n not in whole}
        if not dims.inputs and others and batch_size(others, (), dims) is None \
                and any(shapes(v) for v in others.values()):
            listed = ", ".join(f"{n} {shapes(v)[0]}" for n, v in others.items() if shapes(v))
            raise PipelineInputError(
                f"batch_dim={dims.default}: no input has dimension {dims.default} ({listed}); "
                "give the dimension that holds the samples (e.g. batch_dim=1 for (seq, batch, "
                "...) inputs)")
    held = shapes(target)
    if held and any(len(shape) <= dims.target for shape in held):
        raise PipelineInputError(
            f"target_batch_dim={dims.target}: the example target has shape "
            f"{next(s for s in held if len(s) <= dims.target)}, which has no dimension "
            f"{dims.target}; compile with target_batch_dim= naming the target's batch dimension "
            "(e.g. target_batch_dim=0 for class labels of shape (batch,))")


def inferred_whole(named: Mapping[str, Any], whole: Collection[str] = (),
                   dims: BatchDims = BATCH_FIRST) -> tuple[str, ...]:
    """The inputs (besides `whole`) of tensors with dimensions of which none holds samples."""
    batch = batch_size(named, whole, dims)
    out = []
    for name, value in named.items():
        shaped = [leaf for leaf in pytree.tree_leaves(value)
                  if isinstance(leaf, torch.Tensor) and leaf.dim()]
        if name not in whole and shaped and not any(
                holds_samples(v, batch, dims.of(name)) for v in shaped):
            out.append(name)
    return tuple(out)


def misread_batch(named: Mapping[str, Any], target: Any, whole: Collection[str] = (),
                  given: Collection[str] = (), dims: BatchDims = BATCH_FIRST) -> str | None:
    """Why the batch size read from the inputs cannot be the minibatch's (None where it can):
    the target and another input (not named by the user, `given`) hold another count of
    samples than the first input's first dimension, so the first input holds none (a mask
    first in the forward's parameters)."""
    if dims.given or dims.target:  # the user said where the samples lie
        return None
    held = [leaf for leaf in pytree.tree_leaves(target)
            if isinstance(leaf, torch.Tensor) and leaf.dim()]
    batch = batch_size(named, whole, dims)
    if not held or batch is None or int(held[0].shape[0]) == batch:
        return None
    samples = int(held[0].shape[0])
    first = next(name for name, value in named.items() if name not in whole
                 and batch_size({name: value}, (), dims) is not None)
    others = [name for name, value in named.items() if name not in given and any(
        holds_samples(leaf, samples, dims.of(name)) for leaf in pytree.tree_leaves(value))]
    if not others:
        return None
    return (f"input {first!r} comes first, so its first dimension ({batch}) was taken as the "
            f"batch size, but the target and input {others[0]!r} hold {samples} samples; if "
            f"{first!r} holds no samples, compile with unbatched=({first!r},)")


def holds_samples(value: Any, batch: int | None, dim: int = 0) -> bool:
    """Whether `value` is cut along dimension `dim` in a minibatch of `batch` samples (None:
    any tensor with that dimension is, as a target is)."""
    return isinstance(value, torch.Tensor) and value.dim() > dim and (
        batch is None or int(value.shape[dim]) == batch)


def cut(value: Any, m: int, name: str, *, batch: int | None, index: int, why: str,
        dim: int = 0) -> list[Any]:
    """`value` as `m` microbatches: each tensor that holds samples (`holds_samples`) cut along
    dimension `dim` into parts differing by at most one; in a list, tuple or dict (any
    pytree) each leaf so; anything else given whole to every part."""
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) != 1 or leaves[0] is not value:
        parts = [cut(leaf, m, name, batch=batch, index=index, why=why, dim=dim)
                 for leaf in leaves]
        return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
    if not holds_samples(value, batch, dim):
        return [value] * m
    if value.shape[dim] == 0:  # nothing to train on, whatever the microbatch count
        raise PipelineInputError(f"minibatch {index}: {name} is empty (batch size 0); give "
                                 f"it at least {m} sample{'s' if m > 1 else ''}, or leave the "
                                 "empty minibatch out of the stream")
    if value.shape[dim] < m:
        raise PipelineInputError(f"minibatch {index}: {name} has batch size "
                                 f"{value.shape[dim]}, too small to cut into {m} {why}; give "
                                 f"it at least {m} samples, or compile with fewer microbatches")
    return list(torch.tensor_split(value, m, dim=dim))


def cut_inputs(named: Mapping[str, Any], m: int, *, index: int, why: str,
               whole: Collection[str] = (), dims: BatchDims = BATCH_FIRST
               ) -> list[dict[str, Any]]:
    """Inputs by name as `m` microbatches of inputs by name (see module doc); those named in
    `whole` given whole to each."""
    batch = batch_size(named, whole, dims)
    parts = {name: [value] * m if name in whole else
             cut(value, m, f"input {name!r}", batch=batch, index=index, why=why,
                 dim=dims.of(name))
             for name, value in named.items()}
    return [{name: parts[name][i] for name in named} for i in range(m)]


def cut_target(target: Any, m: int, *, index: int, why: str, dim: int = 0) -> list[Any]:
    """A target as `m` microbatches: every tensor of it that has dimension `dim` cut along it
    (one without it is refused: compile's `target_batch_dim=` names another)."""
    for leaf in pytree.tree_leaves(target):
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.dim() <= dim:
            raise PipelineInputError(
                f"minibatch {index}: the target has shape {tuple(leaf.shape)}, which has no "
                f"dimension {dim} to cut its samples along (target_batch_dim={dim}); compile "
                "with target_batch_dim= naming the target's batch dimension (e.g. "
                "target_batch_dim=0 for class labels of shape (batch,))")
    return cut(target, m, "the target", batch=None, index=index, why=why, dim=dim)


def first_microbatch(named: Mapping[str, Any], m: int, whole: Collection[str] = (),
                     dims: BatchDims = BATCH_FIRST) -> dict[str, Any]:
    """The first (largest) of the `m` microbatches of inputs by name, unchecked."""
    batch = batch_size(named, whole, dims)

    def first(value: Any, dim: int) -> Any:
        if not holds_samples(value, batch, dim):
            return value
        return value.narrow(dim, 0, -(-value.shape[dim] // m))

    return {name: value if name in whole else
            pytree.tree_map(functools.partial(first, dim=dims.of(name)), value)
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


__all__ = ["BATCH_FIRST", "BatchDims", "batch_size", "checked_batch_dims", "checked_whole",
           "cut", "cut_inputs", "cut_target", "first_microbatch", "holds_samples",
           "inferred_whole", "misread_batch"]
