"""Errors from the model's own code: one line naming the stage, node, sizes and the way out."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError, TraceError
from pdcompile.passes.trace import trace


def test_batchnorm_on_one_sample_microbatches_names_stage_node_and_sizes() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Linear(8, 2))
    x = torch.randn(4, 4)
    with pytest.raises(PipelineInputError) as info:
        pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                          schedule="1f1b-flush", microbatches=4, stages=2)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("stage 1 fails in node '_3' (module '3', BatchNorm1d)")
    assert "Expected more than 1 value per channel" in message
    assert "microbatches hold 1 sample (a minibatch of 4 cut into 4)" in message
    assert "fewer microbatches" in message
    # the same model with 2 samples per microbatch compiles and trains
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             schedule="1f1b-flush", microbatches=2, stages=2)
    assert pipe.step(x, target=torch.randint(0, 2, (4,))) > 0


def _generated_child() -> fx.GraphModule:
    """A GraphModule whose generated code turns a tensor into a bool (control flow)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    total = graph.call_method("sum", (x,))
    positive = graph.call_function(operator.gt, (total, 0))
    graph.output(graph.call_function(bool, (positive,)))
    return fx.GraphModule(nn.Module(), graph)


class UsesGenerated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.check = _generated_child()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.check(x)


def test_trace_error_in_generated_code_points_at_no_file() -> None:
    with pytest.raises(TraceError) as info:
        trace(UsesGenerated())
    message = str(info.value)
    assert "<eval_with_key" not in message  # it used to be joined to the working folder
    assert "module 'check'" in message
    assert "pdcompile.compile(..., leaf_modules=['check'])" in message
