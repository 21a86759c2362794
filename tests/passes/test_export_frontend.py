"""The torch.export front end.

How much torch.export reasons about free sizes: a size the model's code tests again and again
(padding to whole windows, stage after stage, as timm's Twins, TinyViT and MobileViTv2 do) is
fixed at the example's after `TESTS_BEFORE_FIXED` tests, so that the tests stop growing with the
model's depth (before, every dimension stayed free and torch.export simplified hundreds of ever
longer expressions: minutes for those models); a batch size tested so often stays free, its
tests kept and checked on every microbatch (passes/input_shapes.py; it was fixed at the
example's).

A `with torch.autocast(..., enabled=False):` in forward (timm's EfficientViT) is inlined where the
pipeline runs without autocast, so that the pipeline exports (it was refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.meta import get_input_shapes
from pdcompile.passes.export_frontend import TESTS_BEFORE_FIXED, export_graph
from tests.helpers.autocast_models import FloatAttention
from tests.helpers.transparency import check, momentum


class Windowed(nn.Module):
    """Stages that halve the image, pad it to whole windows, mix each window and crop back: each
    stage tests the sizes anew, on longer expressions (fx cannot trace its `if`)."""

    def __init__(self, stages: int, window: int = 3) -> None:
        super().__init__()
        self.window = window
        self.down = nn.ModuleList(nn.Conv2d(4, 4, 2, stride=2) for _ in range(stages))
        self.mix = nn.ModuleList(nn.Linear(window * window, window * window)
                                 for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws = self.window
        for down, mix in zip(self.down, self.mix, strict=True):
            x = down(x)
            b, c, h, w = x.shape
            pad_h, pad_w = (ws - h % ws) % ws, (ws - w % ws) % ws
            if pad_h > 0 or pad_w > 0:
                x = F.pad(x, (0, pad_w, 0, pad_h))
            rows, cols = (h + pad_h) // ws, (w + pad_w) // ws
            x = x.reshape(b, c, rows, ws, cols, ws).permute(0, 2, 4, 1, 3, 5)
            x = mix(x.reshape(b * rows * cols, c, ws * ws))
            x = x.reshape(b, rows, cols, c, ws, ws).permute(0, 3, 1, 4, 2, 5)
            x = x.reshape(b, c, rows * ws, cols * ws)[:, :, :h, :w]
        return x.mean((2, 3))


def _tests_per_size(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many tests (guards) torch.export made of each size symbol while capturing `gm`."""
    value = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    return {str(s): n for s, n in value.fake_mode.shape_env.symbol_guard_counter.items()}


def test_sizes_tested_stage_after_stage_are_fixed_and_the_tests_stop_growing() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 24, 24)
    counts = []
    for stages in (2, 3):
        gm = export_graph(Windowed(stages), (x,))
        assert get_input_shapes(gm).describe("x") == "(any, 4, 24, 24) float32", stages
        tests = _tests_per_size(gm)
        assert max(tests.values()) <= TESTS_BEFORE_FIXED + 2, tests  # 107 for a free height
        counts.append(sum(tests.values()))
    assert counts[1] == counts[0]  # more stages, no more tests (before: more by half)


def test_sizes_tested_a_few_times_stay_free() -> None:
    gm = export_graph(Windowed(1, window=1), (torch.randn(2, 4, 48, 48),))
    batch, channels, height, width = get_input_shapes(gm).inputs["x"].dims
    assert channels == 4 and all(isinstance(d, str) for d in (batch, height, width))


class BatchTested(nn.Module):
    """Tests its batch size more often than `TESTS_BEFORE_FIXED` (and its width once)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        for size in range(3, TESTS_BEFORE_FIXED + 20):
            if x.shape[0] == size:
                y = y * 2
        return y


def test_a_batch_size_tested_more_often_escapes_the_limit_but_not_its_tests() -> None:
    """torch.export keeps the batch free (the limit does not fix it), but the model doubles
    its output at batches 3 to 83, which the graph recorded at 2 does not: each of those tests
    is kept (input_shapes.InputShapes.tests), so the batch stays free outside 3 to 83, per
    microbatch (before, the batch was fixed at the example's)."""
    gm = export_graph(BatchTested(), (torch.randn(2, 5),))
    value = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    assert isinstance(value.shape[0], torch.SymInt)  # free in torch.export's graph
    shapes = get_input_shapes(gm)
    assert shapes.describe("x") == "(any, 5) float32"
    assert sorted(t[2] for t in shapes.tests) == list(range(3, TESTS_BEFORE_FIXED + 20))

    def refusal(batch: int, micro: int) -> str | None:
        x = torch.zeros(batch, 5)
        return shapes.refusal({"x": x}, {"x": x.tensor_split(micro)[0]}, microbatches=micro)

    assert refusal(2, 1) is None and refusal(84, 1) is None and refusal(168, 2) is None
    assert refusal(4, 2) is None  # microbatches of 2
    assert refusal(3, 1) is not None and refusal(83, 1) is not None
    assert refusal(6, 2) == (
        "input 'x' is (6, 5) float32 but the model, as torch.export captured it, runs on "
        "(any, 5) float32: dimension 0 of 'x' is 3 per microbatch (a minibatch of 6 "
        "cut into 2); the model was captured for sizes where x.shape[0] != 3, which its code "
        "tests: pass sizes where that holds or compile the pipeline at the sizes to train on")


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def test_a_model_with_fixed_image_sizes_trains_like_one_process_and_refuses_others() -> None:
    torch.manual_seed(0)
    model, x, target = Windowed(3), torch.randn(4, 4, 48, 48), torch.randint(0, 4, (4,))
    pipe = check((model, (x,), target, _loss), schedule="1f1b-flush", micro=2, plan=[1, 1])
    other: Any = torch.randn(4, 4, 40, 48)
    with pytest.raises(PipelineInputError) as info:
        pipe.step(other, target=target)
    assert str(info.value) == (
        "minibatch 0: input 'x' is (4, 4, 40, 48) float32 but the model, as torch.export "
        "captured it, runs on (any, 4, 48, 48) float32: the model's code depends on the size "
        "of dimension 2, so torch.export fixed it at 48; pass that size or compile the pipeline "
        "at the size to train on")
    assert pdcompile.meta.get_frontend(pipe.graph) == "export"


def test_autocast_turned_off_in_forward_is_inlined_and_exports(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, target = FloatAttention(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    pipe = check((model, (x,), target, F.cross_entropy), schedule="1f1b-flush", micro=2,
                 plan=[1, 1], frontend="export")
    assert not [n for n in pipe.graph.graph.nodes if n.op == "call_function"
                and "wrap_with_autocast" in str(n.target)]
    pipe.export(str(tmp_path / "pipe"))  # refused before: a region kept as a graph of its own
    loaded = pdcompile.load(str(tmp_path / "pipe"), optimizer=momentum)
    torch.testing.assert_close(loaded.evaluate(x), pipe.evaluate(x), rtol=0, atol=0)


class _InferenceGate(nn.Module):
    """A gate computed under torch.inference_mode(): no gradient for `gate`, none through it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        with torch.inference_mode():
            g = torch.sigmoid(self.gate(h)).mean(-1, keepdim=True)
        return self.out(h * g.clone())


def test_an_inference_mode_region_is_refused_naming_its_line() -> None:
    """torch.export recorded the region as if gradients were on: `gate` trained and gradients
    passed the gate (the pipeline's weights differed from one process after one update)."""
    from pdcompile.errors import TraceError

    with pytest.raises(TraceError, match=r"under torch.inference_mode\(\) \(at "
                                         r".*test_export_frontend.py:\d+\).*torch.no_grad\(\)"):
        export_graph(_InferenceGate(), (torch.randn(4, 8),))


class _Flagged(nn.Module):
    """A model taking a container of plain values (`flags=(1, 2)`) beside its tensor."""

    def __init__(self, key: Any) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)
        self.key = key

    def forward(self, x: torch.Tensor, flags: Any) -> torch.Tensor:
        return self.a(x) * flags[self.key]


@pytest.mark.parametrize("flags", [(1, 2), [1, 2], {"k": 2}])
def test_a_container_of_plain_values_is_refused_naming_the_input(flags: Any) -> None:
    """torch.export rejected it with a mismatch of `dynamic_shapes` that named neither the way
    out nor pdcompile's part; the fx front end takes it and trains."""
    from pdcompile.errors import TraceError

    x = torch.randn(4, 8)
    key = "k" if isinstance(flags, dict) else 1
    with pytest.raises(TraceError, match=rf"input 'flags' of _Flagged is a "
                                         rf"{type(flags).__name__} of plain values, which the "
                                         r"torch.export front end cannot take as one input; "
                                         r"use frontend='fx'"):
        export_graph(_Flagged(key), (x, flags))
    pipe = pdcompile.compile(_Flagged(key), example_inputs=(x, flags), loss_fn=F.cross_entropy,
                             stages=2, schedule="1f1b-flush", microbatches=2, cost="analytic")
    assert pipe.step(x, flags, target=torch.randint(0, 3, (4,))) > 0
