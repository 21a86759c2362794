"""A received activation reaches the next stage uncopied only where nothing there may write it
(runtime/input_writes.py), and training is the same either way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn
from torch.overrides import TorchFunctionMode

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.runtime.input_writes import read_only_inputs
from tests.helpers.one_process import train_one_process

WIDTH = 8


class _Adds(nn.Module):
    """Writes its input in place, unseen by a trace that keeps it a leaf module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


class _Two(nn.Module):
    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x))


def _traced(first: nn.Module) -> fx.GraphModule:
    return fx.symbolic_trace(_Two(first))


@pytest.mark.parametrize(("first", "copied"), [
    (nn.Linear(WIDTH, WIDTH), False),
    (nn.ReLU(inplace=True), True),
    (nn.Tanh(), True),  # not on the allowlist: kept
    (_Adds(), True),
])
def test_a_graph_input_is_read_only_only_where_its_users_are_known_to_read_it(
        first: nn.Module, copied: bool) -> None:
    assert read_only_inputs(_traced(first)) == (frozenset() if copied else frozenset({0}))


def test_views_outputs_and_hooks_keep_the_copy() -> None:
    class Viewed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(-1, WIDTH).relu_()

    class Returned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), x

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.w)

    assert read_only_inputs(fx.symbolic_trace(Viewed())) == frozenset()
    assert read_only_inputs(fx.symbolic_trace(Returned())) == frozenset()
    assert read_only_inputs(fx.symbolic_trace(Functional())) == frozenset({0})
    hooked = _traced(nn.Linear(WIDTH, WIDTH))
    hooked.first.register_forward_pre_hook(lambda module, args: None)
    assert read_only_inputs(hooked) == frozenset()
    whole = _traced(nn.Linear(WIDTH, WIDTH))
    whole.register_forward_hook(lambda module, args, out: None)
    assert read_only_inputs(whole) == frozenset()
    assert read_only_inputs(nn.Linear(WIDTH, WIDTH)) == frozenset()  # not a graph: copied


class _Clones(TorchFunctionMode):
    """Counts copies of leaves that collect gradients (received activations: the transports'
    own copies are of detached tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.clone and args[0].is_leaf and args[0].requires_grad:
            self.count += 1
        return func(*args, **(kwargs or {}))


FIRSTS = {"linear": lambda: nn.Linear(WIDTH, WIDTH), "relu_inplace": lambda: nn.ReLU(True),
          "adds_in_place": _Adds, "tanh": nn.Tanh}


@settings(max_examples=12, deadline=None)
@given(first=st.sampled_from(sorted(FIRSTS)), schedule=st.sampled_from(["1f1b-flush", "gpipe"]),
       fuse=st.booleans())
def test_the_second_stage_gets_its_activation_uncopied_where_its_first_layer_reads_it(
        first: str, schedule: str, fuse: bool) -> None:
    """The model's second stage starts with `first`: a Linear layer (fused or not) reads the
    received activation as it is; a layer that writes its input in place, or one the runtime
    does not know, gets a copy. Either way two stages train as one process does."""
    torch.manual_seed(0)
    # stage 0 ends with a Linear layer, which keeps no output for its backward: one process
    # may change that output in place too
    model = nn.Sequential(nn.Linear(6, WIDTH), FIRSTS[first](), nn.Tanh(),
                          nn.Linear(WIDTH, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    gm = trace(copy.deepcopy(model))
    plan = manual_plan(gm, lambda node: int(node.op == "call_module" and int(str(node.target))
                                            >= 1))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(
                                 p, lr=0.1), schedule=schedule, microbatches=2, plan=plan,
                             fuse=fuse)
    counting = _Clones()
    with counting:
        losses = [pipe.step(x, target=y) for _ in range(2)]
    want, _ = train_one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), (x,), y,
                                F.cross_entropy, micro=2, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)
    if first == "linear":
        assert counting.count == 0, "the received activation was copied before a Linear"
    else:  # one per microbatch and minibatch
        assert counting.count == 4
