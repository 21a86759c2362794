"""Example models: paper sizes, training on this CPU, trace, shapes and costs from every source."""

from __future__ import annotations

import importlib
import time
from types import ModuleType

import pytest
import torch

from pdcompile.cost.node_costs import annotate_costs, to_cost_graph, total_cost
from pdcompile.meta import get_cost, get_shape
from pdcompile.models import MODELS
from pdcompile.passes.shapes import annotate_shapes
from pdcompile.passes.trace import trace


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"pdcompile.models.{name}")


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied parameter once


@pytest.mark.parametrize(
    ("name", "options", "millions"),
    [
        ("vgg16", {"width": 1, "image_size": 224, "num_classes": 1000}, 138.358),
        ("resnet50", {"width": 1, "image_size": 224, "num_classes": 1000}, 25.557),
        ("alexnet", {"width": 1, "image_size": 224, "num_classes": 1000}, 61.101),
        ("gpt2", {"size": "gpt2"}, 124.440),
        ("gpt2", {"size": "xl", "batch_size": 1}, 1557.611),
    ],
)
def test_full_sizes_on_meta_match_the_papers(name: str, options: dict[str, object],
                                             millions: float) -> None:
    model, inputs = _module(name).factory(device="meta", **options)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert _params(model) / 1e6 == pytest.approx(millions, abs=0.001)
    assert all(t.device.type == "meta" for t in inputs)


def test_gpt2_xl_shape() -> None:
    model, (idx,) = _module("gpt2").factory(size="xl", device="meta")
    assert len(model.h) == 48 and model.wte.weight.shape == (50257, 1600)
    assert model.h[0].attn.heads == 25 and idx.shape == (4, 1024)
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("name", MODELS)
def test_default_size_trains_on_this_cpu(name: str) -> None:
    module = _module(name)
    model, inputs = module.factory()
    target = module.make_target(inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.eval()  # dropout off, so that the loss on a fixed batch must fall
    losses, seconds = [], []
    for _ in range(4):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = module.loss_fn(model(*inputs), target)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert min(seconds) < 1.0, f"{name}: a training step takes {min(seconds):.2f}s"


@pytest.mark.parametrize("name", MODELS)
def test_traces_shapes_and_costs_by_every_source(name: str) -> None:
    model, inputs = _module(name).factory(batch_size=2)
    model.eval()
    gm = trace(model)
    torch.testing.assert_close(gm(*inputs), model(*inputs))
    annotate_shapes(gm, inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert get_shape(output)[0].shape == tuple(model(*inputs).shape)
    compute = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function",
                                                      "call_method")]
    param_bytes = _params(model) * 4
    for source in ("measured", "analytic"):
        annotate_costs(gm, inputs, source=source, warmup=0, repeats=1)
        total = total_cost(gm)
        assert total.params == param_bytes, source  # shared parameters counted once
        assert total.fwd > 0 and total.bwd > 0 and total.keep > 0
        assert all(get_cost(n).source == source for n in compute)
        graph = to_cost_graph(gm, name=name)
        assert graph.number_of_nodes() == len(gm.graph.nodes) - 1
    assert total.flops_fwd > 0 and total.flops_bwd > total.flops_fwd


def test_multi_input_model_keeps_both_inputs() -> None:
    model, inputs = _module("gnmt").factory(batch_size=2)
    gm = trace(model)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["src", "tgt"]
    assert len(inputs) == 2
    lstms = [n for n in gm.graph.nodes if n.op == "call_module"
             and isinstance(gm.get_submodule(str(n.target)), torch.nn.LSTM)]
    assert len(lstms) == 8  # 4 encoder + 4 decoder layers, each one node


def test_batchnorm_buffers_in_resnet() -> None:
    model, inputs = _module("resnet50").factory(batch_size=2, blocks=(1, 1, 1, 1))
    gm = trace(model.train())
    before = model.bn1.running_mean.clone()
    gm(*inputs)
    assert not torch.equal(before, model.bn1.running_mean)  # the model's own buffer moved
