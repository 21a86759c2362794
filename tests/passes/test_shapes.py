"""Shapes pass and the node.meta accessors: shapes on real, fake and meta models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.errors import MetaMissingError, PipelineInputError
from pdcompile.meta import (
    NodeCost,
    NodeShape,
    TensorShape,
    get_cost,
    get_shape,
    get_stage,
    set_cost,
    set_stage,
)
from pdcompile.models import gnmt, gpt2
from pdcompile.passes.shapes import annotate_shapes
from pdcompile.passes.trace import trace


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.bn(self.conv(x)) * scale
        return y, y.flatten(1).half()


class Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x) + 1


def _shapes(gm: torch.fx.GraphModule) -> dict[str, NodeShape]:
    return {n.name: get_shape(n) for n in gm.graph.nodes}


def test_every_node_gets_shape_and_dtype() -> None:
    gm = trace(Net())
    annotate_shapes(gm, (torch.randn(2, 3, 5, 5), torch.tensor(2.0)))
    shapes = _shapes(gm)
    assert shapes["x"] == (TensorShape((2, 3, 5, 5), "float32"),)
    assert shapes["conv"] == (TensorShape((2, 8, 5, 5), "float32"),)
    assert shapes["half"] == (TensorShape((2, 200), "float16"),)
    assert shapes["output"] == shapes["mul"] + shapes["half"]
    assert shapes["half"].nbytes == 2 * 200 * 2
    assert str(shapes["conv"]) == "float32[2, 8, 5, 5]"


def test_int_values_have_empty_shape() -> None:
    model, inputs = gpt2.factory(layers=1, d=16, heads=2, vocab_size=50, seq_len=8)
    gm = trace(model)
    annotate_shapes(gm, inputs)
    sizes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert sizes and all(get_shape(n) == () for n in sizes)
    assert get_shape(gm.graph.find_nodes(op="output")[0]) == (TensorShape((4, 8, 50), "float32"),)


def test_meta_model_is_shaped_without_memory() -> None:
    model, inputs = gpt2.factory(size="gpt2", batch_size=2, seq_len=128, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    gm = trace(model)
    annotate_shapes(gm, inputs)
    out = get_shape(gm.graph.find_nodes(op="output")[0])
    assert out == (TensorShape((2, 128, 50257), "float32"),)


def test_lstm_tuple_outputs_are_flattened() -> None:
    model, inputs = gnmt.factory(batch_size=2, src_len=5, tgt_len=4, hidden=16, layers=2)
    gm = trace(model)
    annotate_shapes(gm, inputs)
    bidir = get_shape(next(n for n in gm.graph.nodes if n.target == "encoder.bidir"))
    # (output, (h, c)) of a bidirectional LSTM with hidden 8 per direction
    assert [t.shape for t in bidir] == [(2, 5, 16), (2, 2, 8), (2, 2, 8)]


def test_keyword_inputs() -> None:
    class Keyed(nn.Module):
        def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return x if bias is None else x + bias

    gm = trace(Keyed(), example_kwargs_names=["bias"])
    annotate_shapes(gm, (torch.randn(3, 1),), {"bias": torch.randn(1, 4)})
    assert get_shape(gm.graph.find_nodes(op="output")[0])[0].shape == (3, 4)
    with pytest.raises(PipelineInputError, match="does not take"):
        annotate_shapes(gm, (torch.randn(3, 1),), {"nope": torch.randn(1)})
    with pytest.raises(PipelineInputError, match="no example value for input 'x'"):
        annotate_shapes(gm, ())


def test_data_dependent_shape_falls_back_to_real_run() -> None:
    gm = trace(Nonzero())
    annotate_shapes(gm, (torch.tensor([0.0, 1.0, 2.0]),))
    assert get_shape(gm.graph.find_nodes(op="output")[0])[0].shape == (2, 1)


def test_wrong_input_names_the_node() -> None:
    gm = trace(Net())
    with pytest.raises(PipelineInputError) as info:
        annotate_shapes(gm, (torch.randn(2, 4, 5, 5), torch.tensor(1.0)))
    assert "'conv'" in str(info.value) and "float32[2, 4, 5, 5]" in str(info.value)
    with pytest.raises(PipelineInputError, match="3 example inputs"):
        annotate_shapes(gm, (torch.randn(1), torch.randn(1), torch.randn(1)))


def test_accessors_say_which_pass_to_run() -> None:
    gm = trace(Net())
    node = next(iter(gm.graph.nodes))
    with pytest.raises(MetaMissingError, match="annotate_shapes"):
        get_shape(node)
    with pytest.raises(MetaMissingError, match="annotate_costs"):
        get_cost(node)
    with pytest.raises(MetaMissingError, match="stage"):
        get_stage(node)
    cost = NodeCost(fwd=1.0, bwd=2.0, act=3.0, params=4.0, keep=5.0)
    set_cost(node, cost)
    set_stage(node, 2)
    assert get_cost(node) is cost and get_stage(node) == 2
    assert node.meta["pd.cost"] is cost and node.meta["pd.stage"] == 2
    with pytest.raises(AttributeError):
        cost.fwd = 3.0  # type: ignore[misc]
