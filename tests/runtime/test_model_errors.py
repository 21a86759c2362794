"""Errors from the model's own code: one line naming the stage, node, sizes and the way out."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
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


class _Contrastive(nn.Module):
    """CLIP's contrastive loss (transformers' `contrastive_loss`): every sample's logits
    against every other's, labels `torch.arange(len(logits))` (`by_len`) or of
    `logits.shape[0]`. torch.export turns `len()` into the example's batch size."""

    def __init__(self, by_len: bool) -> None:
        super().__init__()
        self.text, self.image = nn.Linear(6, 8), nn.Linear(6, 8)
        self.by_len = by_len

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.text(x) @ self.image(y).t()
        count = len(logits) if self.by_len else logits.shape[0]
        return nn.functional.cross_entropy(logits, torch.arange(count))


@settings(max_examples=4, deadline=None)
@given(micro=st.sampled_from([2, 3]), per=st.integers(1, 3))
def test_a_batch_size_export_fixed_is_named_with_the_fix(micro: int, per: int) -> None:
    """A model that reads its batch size with len() is captured by torch.export with that
    size as a constant: cut into microbatches, it fails in its loss. The error names the input,
    the fixed size and the fix; it once advised larger minibatches (which fail the same)."""
    batch = micro * per + micro  # at least 2 samples a microbatch
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    with pytest.raises(PipelineInputError) as info:
        pdcompile.compile(_Contrastive(by_len=True), example_inputs=(x, y),
                          loss_fn=lambda out, _: out, schedule="1f1b-flush", microbatches=micro,
                          stages=2, cost="analytic")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"torch.export fixed the batch size of input 'x' at {batch}" in message, message
    assert f"a microbatch of {batch // micro} contradicts" in message
    assert "x.size(0)" in message and "microbatches=1" in message
    assert "larger minibatches" not in message
    # the way out: the size read as logits.shape[0] stays free, and microbatches run
    pipe = pdcompile.compile(_Contrastive(by_len=False), example_inputs=(x, y),
                             loss_fn=lambda out, _: out, schedule="1f1b-flush",
                             microbatches=micro, stages=2, cost="analytic")
    assert pipe.step(x, y, target=torch.zeros(batch)) > 0
