"""A dropped weight version's storage is the next version's, where nothing else holds it.

(That stashing still follows PipeDream's semantics is test_async_semantics.)
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from pdcompile.runtime.stash import WeightVersions
from pdcompile.runtime.tensor_reuse import only_held_here
from tests.helpers.blocks import batches, build, make_model


class _Clones(TorchDispatchMode):
    """Counts aten.clone calls by output shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:
            self.shapes.append(tuple(out.shape))
        return out


def _master() -> dict[str, torch.Tensor]:
    weight = torch.nn.Parameter(torch.randn(3, 4))
    return {"a.weight": weight, "b.weight": weight,  # tied: one tensor under two names
            "a.bias": torch.nn.Parameter(torch.randn(3))}


def _update(master: dict[str, torch.Tensor], versions: WeightVersions) -> None:
    with torch.no_grad():
        for p in {id(p): p for p in master.values()}.values():
            p.add_(1.0)
    versions.advance()


def test_the_next_version_is_copied_into_the_dropped_ones_tensors() -> None:
    master = _master()
    versions = WeightVersions(master, copy=True)
    first = versions.acquire(0)
    kept = {name: id(t) for name, t in first.items()}
    versions.release(0)
    del first
    _update(master, versions)
    second = versions.acquire(1)
    assert {name: id(t) for name, t in second.items()} == kept  # the same tensors, reused
    assert second["a.weight"] is second["b.weight"]  # still one tensor for the tied names
    for name, t in second.items():
        assert torch.equal(t, master[name]) and t is not master[name]
        assert t.requires_grad and t.is_leaf and t.grad is None


@pytest.mark.parametrize("holder", ["python", "detached", "graph", "view", "grad"])
def test_a_dropped_version_that_something_still_holds_is_left_alone(holder: str) -> None:
    master = _master()
    versions = WeightVersions(master, copy=True)
    first = versions.acquire(0)
    old = first["a.weight"].detach().clone()
    held: Any = {
        "python": lambda t: t,
        "detached": lambda t: t.detach(),
        "graph": lambda t: (t * t).sum(),  # saves t itself
        "view": lambda t: t[0],
        "grad": lambda t: None,
    }[holder](first["a.weight"])
    if holder == "grad":  # a gradient not collected: the tensor is not fit to reuse
        first["a.weight"].grad = torch.ones(3, 4)
    versions.release(0)
    del first
    _update(master, versions)
    second = versions.acquire(1)
    assert torch.equal(second["a.weight"], master["a.weight"])
    if holder == "grad":
        return
    if holder == "graph":
        held.backward()  # the graph still computes with the values it saw
        return  # an overwritten saved tensor fails autograd's version check above
    assert torch.equal(held, old if holder != "view" else old[0])  # the old values still
    assert held.data_ptr() != second["a.weight"].data_ptr()


def test_a_finished_run_keeps_no_spare() -> None:
    master = _master()
    versions = WeightVersions(master, copy=True)
    versions.acquire(0)
    versions.release(0)
    versions.clear()
    assert versions._spare == {}


def test_only_held_here_counts_every_kind_of_holder() -> None:
    box = {"t": torch.randn(2, 2, requires_grad=True)}
    assert only_held_here(box, "t")
    assert not only_held_here(box, "missing")
    for hold in (lambda t: t, lambda t: t.detach(), lambda t: t[0], lambda t: (t * 2).sum()):
        other = hold(box["t"])
        assert not only_held_here(box, "t")
        del other
        assert only_held_here(box, "t")


@settings(max_examples=6, deadline=None)
@given(minibatches=st.integers(3, 10), stages=st.sampled_from([2, 4]))
def test_asynchronous_1f1b_clones_weights_only_to_fill_the_pipeline(minibatches: int,
                                                                   stages: int) -> None:
    """A stage with k minibatches in flight holds at most k versions: after its first k
    snapshots, every new one reuses a dropped one's tensors (the old runtime cloned every
    stage's weights at every update). The losses are those of the same pipeline whose stash
    clones every version."""
    model = make_model()
    pipe = build(copy.deepcopy(model), stages, None, schedule="1f1b")
    data = batches(minibatches)
    counter = _Clones()
    with counter:
        losses = pipe.train(data)
    weights = counter.shapes.count((6, 6))  # the blocks' weights; activations are (4, 6)
    in_flight = {rt.stage: rt.versions.peak for rt in pipe.last_runtimes.values()}
    blocks = 4 // stages  # Linear(6, 6) weights per stage
    assert weights <= blocks * sum(peak for stage, peak in in_flight.items()
                                   if stage < stages - 1)
    fresh = build(model, stages, None, schedule="1f1b")
    clone_all = WeightVersions._drop_if_unused

    def drop_without_spare(self: WeightVersions, version: int) -> None:
        clone_all(self, version)
        self._spare = {}

    WeightVersions._drop_if_unused = drop_without_spare  # type: ignore[method-assign]
    try:
        expected = fresh.train(data)
    finally:
        WeightVersions._drop_if_unused = clone_all  # type: ignore[method-assign]
    assert torch.equal(torch.as_tensor(losses), torch.as_tensor(expected))
    for a, b in zip(pipe.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
