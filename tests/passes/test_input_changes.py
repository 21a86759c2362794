"""A forward that changes its input in place is refused under both front ends, naming the input
and the fix, before compile runs the model on the example (passes/input_changes.py). Before, one
process changed the caller's tensor (a second step given it saw the change) while the pipeline
changed its own copy of each microbatch: from the second step on the two trained on different
inputs, silently; and compile's own runs of the model changed the user's example twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import TraceError
from tests.helpers.one_process import assert_two_stages_train_like_one_process

CHANGES = ("add_", "relu_", "iadd", "functional_inplace", "module_inplace", "view_mul_",
           "setitem")


class ChangesInput(nn.Module):
    """Changes its input `x` (or a view of it) in place in one of the ways of CHANGES, first or
    after a layer has read it; `copy`: changes a copy (x * 1) instead."""

    def __init__(self, change: str, after_layer: bool, copy: bool = False) -> None:
        super().__init__()
        self.change, self.after_layer, self.copy = change, after_layer, copy
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) if self.after_layer else None
        if self.copy:
            x = x * 1.0
        if self.change == "add_":
            x.add_(1.0)
        elif self.change == "relu_":
            x.relu_()
        elif self.change == "iadd":
            x += 1.0
        elif self.change == "functional_inplace":
            F.relu(x, inplace=True)
        elif self.change == "module_inplace":
            self.relu(x)
        elif self.change == "view_mul_":
            x[:, :2].mul_(0.5)
        else:
            x[0] = 0.0
        return self.out(torch.tanh(self.inp(x)) + (h if h is not None else 0.0))


@settings(max_examples=12, deadline=None)
@given(change=st.sampled_from(CHANGES), after_layer=st.booleans(),
       frontend=st.sampled_from(["fx", "export"]))
def test_a_change_of_an_input_in_place_is_refused_naming_it(change: str, after_layer: bool,
                                                            frontend: str) -> None:
    x = torch.randn(4, 8)
    before = x.clone()
    with pytest.raises(TraceError, match=r"ChangesInput.forward changes its input 'x' in place"
                                         r".*change a copy instead"):
        pdcompile.compile(ChangesInput(change, after_layer), example_inputs=(x,), stages=2,
                          cost="analytic", frontend=frontend)
    assert torch.equal(x, before)  # refused before any run of the model on the example


@pytest.mark.parametrize("change", ["add_", "view_mul_", "module_inplace"])
def test_a_change_of_a_copy_of_the_input_trains_like_one_process(change: str) -> None:
    torch.manual_seed(0)
    assert_two_stages_train_like_one_process(ChangesInput(change, True, copy=True).double())
