"""Front ends: a given GraphModule as it is, inputs bound by name (also through **kwargs), and
torch.export for what torch.fx cannot trace; `auto` picks, errors name both when both fail; a
forward that turns autocast off under `compile(autocast=...)` is taken by torch.export."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError, TraceError
from pdcompile.meta import get_frontend
from pdcompile.passes.frontend import capture
from tests.helpers.autocast_models import FloatAttention
from tests.helpers.one_process import train_one_process

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def reference_steps(model: nn.Module, inputs: Any, target: torch.Tensor,
                    loss_fn: Any, micro: int, steps: int = 2) -> list[float]:
    """Single-process gradient accumulation over the same microbatches (SGD, lr 0.1)."""
    opt = SGD(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for index, part in enumerate(target.chunk(micro)):
            if isinstance(inputs, dict):
                out = model(**{k: v.chunk(micro)[index] for k, v in inputs.items()})
            else:
                out = model(*(v.chunk(micro)[index] for v in inputs))
            loss = loss_fn(out, part)
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        losses.append(total)
    return losses


def assert_trains_like(model: nn.Module, pipe: pdcompile.pipeline.Pipeline, inputs: Any,
                       target: torch.Tensor, loss_fn: Any, micro: int = 2) -> None:
    args = (inputs,) if isinstance(inputs, dict) else tuple(inputs)
    losses = [pipe.step(*args, target=target) for _ in range(2)]
    assert losses == pytest.approx(reference_steps(model, inputs, target, loss_fn, micro),
                                   abs=1e-6)
    state = pipe.state_dict()
    assert set(state) == set(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else -x  # data-dependent: fx cannot trace it


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.gate = Gate()
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x)).relu())


class KeepGate(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, Gate) or super().is_leaf_module(m, module_qualified_name)


def test_a_graph_module_is_taken_as_it_is() -> None:
    model = Gated()
    gm = fx.GraphModule(model, KeepGate().trace(model))  # like transformers' own fx tracer
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(gm, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             optimizer=SGD, schedule="1f1b-flush", microbatches=2, stages=2)
    assert pipe.graph is gm and get_frontend(pipe.graph) == "given"
    assert_trains_like(copy.deepcopy(model), pipe, (x,), y, nn.functional.cross_entropy)
    with pytest.raises(PipelineInputError, match="already an fx.GraphModule"):
        pdcompile.compile(gm, example_inputs=(x,), stages=2, leaf_modules=[Gate])


class KeywordModel(nn.Module):
    """A Hugging Face-like signature: defaults and **kwargs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False, **kwargs: Any) -> torch.Tensor:
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.head(h.mean(dim=1))


def test_inputs_by_name_bind_a_kwargs_signature() -> None:
    model = KeywordModel()
    ids = torch.randint(0, 20, (4, 5))
    mask = torch.ones(4, 5)
    mask[:, 3:] = 0
    inputs = {"attention_mask": mask, "input_ids": ids}
    y = torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                             loss_fn=nn.functional.cross_entropy, optimizer=SGD,
                             schedule="1f1b-flush", microbatches=2, stages=2)
    assert get_frontend(pipe.graph) == "fx"
    assert pipe.parts.data_inputs == ("input_ids", "attention_mask")  # the forward's order
    assert_trains_like(model, pipe, inputs, y, nn.functional.cross_entropy)
    with pytest.raises(PipelineInputError, match="takes the inputs input_ids, attention_mask"):
        pipe.step({"input_ids": ids}, target=y)


class OnlyKwargs(nn.Module):
    def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
        return kwargs["x"] * 2


def test_a_forward_of_only_kwargs_is_named_as_written() -> None:
    with pytest.raises(TraceError, match=r"takes only \*\*kwargs"):
        pdcompile.compile(OnlyKwargs(), example_inputs=(torch.randn(2),), stages=1,
                          frontend="fx")


class Sliced(nn.Module):
    """Slices a buffer by a size read from the input, as BERT does with token_type_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.randn(16, 8), persistent=False)
        self.embed = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.positions[: x.shape[1]]
        return self.head(self.mid(h).tanh().mean(dim=1))


def test_export_front_end_takes_what_fx_cannot_trace() -> None:
    model = Sliced()
    x, y = torch.randn(8, 6, 4), torch.randint(0, 3, (8,))
    with pytest.raises(TraceError, match="slice indices must be integers"):
        pdcompile.compile(model, example_inputs=(x,), stages=2, frontend="fx")
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=nn.functional.cross_entropy, optimizer=SGD,
                             schedule="1f1b-flush", microbatches=4, stages=2)
    assert get_frontend(pipe.graph) == "export"
    with torch.no_grad():  # the batch dimension stays free: any batch size runs
        for batch in (8, 3):
            torch.testing.assert_close(pipe(x[:batch]), model(x[:batch]))
    assert_trains_like(model, pipe, (x,), y, nn.functional.cross_entropy, micro=4)


def test_when_both_front_ends_fail_the_error_names_both() -> None:
    with pytest.raises(TraceError) as info:
        pdcompile.compile(Gated(), example_inputs=(torch.randn(4, 4),), stages=2)
    message = str(info.value)
    assert "module 'gate' (Gate)" in message and "leaf_modules=['gate']" in message
    assert "torch.export cannot capture it either" in message
    # the fix the message gives works
    pipe = pdcompile.compile(Gated(), example_inputs=(torch.randn(4, 4),), stages=2,
                             leaf_modules=["gate"])
    assert get_frontend(pipe.graph) == "fx"


def test_front_end_arguments_that_do_not_fit() -> None:
    with pytest.raises(PipelineInputError, match="unknown frontend 'jit'; choose one of auto"):
        pdcompile.compile(Gated(), example_inputs=(torch.randn(4, 4),), stages=2,
                          frontend="jit")
    with pytest.raises(PipelineInputError, match="leaf_modules= applies to torch.fx tracing"):
        pdcompile.compile(Sliced(), example_inputs=(torch.randn(2, 3, 4),), stages=2,
                          frontend="export", leaf_modules=[nn.Linear])


@pytest.mark.parametrize("wrap", ["torch.compile", "DataParallel"])
def test_a_wrapped_model_is_compiled_as_the_model_it_wraps(wrap: str) -> None:
    """A training script's torch.compile or DataParallel wrapper (their forwards take *args and
    **kwargs, which neither front end could capture: both failed) is looked through: the
    pipeline trains the wrapped model's own parameters, under its own names."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model = torch.compile(inner) if wrap == "torch.compile" else nn.DataParallel(inner)
    device = inner[0].weight.device  # DataParallel on a one-GPU machine moves it to the GPU
    x, y = torch.randn(8, 8, device=device), torch.randint(0, 3, (8,), device=device)
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             stages=[1, 1], schedule="1f1b-flush", microbatches=2)
    assert set(pipe.state_dict()) == set(inner.state_dict())
    before = inner[0].weight.detach().clone()
    pipe.step(x, target=y)
    assert not torch.equal(pipe.state_dict()["0.weight"], before)


class _RenormalisedEmbedding(nn.Module):
    """nn.Embedding(max_norm=...) renormalises the rows it reads, in place, in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, max_norm=1.0)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(ids).mean(1))))


def test_a_parameter_changed_in_place_by_forward_is_refused_by_torch_export() -> None:
    """torch.export records the renormalisation on a detached alias of the weight; a cut gave
    another stage a copy of the weight the change never reached, and the copies parted
    silently (the pipeline's weight differed from one process after one step)."""
    model = _RenormalisedEmbedding()
    ids = torch.randint(0, 20, (8, 5))
    with pytest.raises(TraceError, match=r"changes parameter 'embed.weight' in place.*"
                                         r"embedding_renorm_.*frontend='fx'"):
        capture(model, (ids,), frontend="export")
    assert capture(model, (ids,), frontend="auto").frontend == "fx"  # a leaf module: whole


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x))


class _WithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.inner = torch.jit.script(_Block())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(torch.tanh(self.first(x))))


@pytest.mark.parametrize("frontend", ["fx", "export", "auto"])
def test_a_torchscript_module_is_refused_naming_it(frontend: str) -> None:
    """torch.fx traced through a scripted submodule to a call on its C++ object: the pipeline
    ran it, but its parameters were in no stage, so they were never trained (silently)."""
    with pytest.raises(TraceError, match=r"TorchScript module\(s\) 'inner' \(torch.jit"):
        pdcompile.compile(_WithScripted(), example_inputs=(torch.randn(4, 8),), stages=2,
                          frontend=frontend)


def test_autocast_turned_off_in_forward_stays_off_under_compiles_autocast(tmp_path: Path,
                                                                          ) -> None:
    """fx traced the model outside autocast, saw no change, and the pipeline ran the float32
    attention in bfloat16 without a word; traced inside the pipeline's region, fx sees the
    forward turn it off, and torch.export records the region: trains as one process does."""
    torch.manual_seed(0)
    model, x, y = FloatAttention(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), optimizer=SGD,
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule="1f1b-flush", microbatches=2, autocast=torch.bfloat16)
    assert get_frontend(pipe.graph) == "export"
    losses = [pipe.step(x, target=y) for _ in range(3)]
    want, *_ = train_one_process(model, SGD(model.parameters()), (x,), y,
                                 nn.functional.cross_entropy, micro=2, steps=3,
                                 autocast=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value)
    with pytest.raises(PipelineInputError, match=r"torch.autocast block .* cannot write yet"):
        pipe.export(str(tmp_path / "out"))


class PastNamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.a(x) + rest[0]


class IntoKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return self.a(x) * extra["scale"]


@pytest.mark.parametrize("frontend", ["fx", "export", "auto"])
def test_inputs_through_star_parameters_are_refused_naming_the_fix(frontend: str) -> None:
    """forward(self, x, *rest) given (x, z) trained silently on z's first row under fx (its
    one placeholder for `rest` was fed z, and rest[0] read a row); an input reaching **extra
    was 'a name forward does not take' under fx, and torch.export advised frontend='fx'."""
    x, z = torch.randn(4, 4), torch.randn(4, 3)
    with pytest.raises(TraceError, match=r"^inputs past x would reach PastNamed\.forward only "
                                         r"through \*rest, which neither front end takes as "
                                         r"inputs of the graph: give each input a parameter of "
                                         r"its own, e\.g\. forward\(self, x, y, \.\.\., \*rest\)$"):
        pdcompile.compile(PastNamed(), example_inputs=(x, z), stages=1, frontend=frontend)
    with pytest.raises(TraceError, match=r"^'scale' would reach IntoKwargs\.forward only through "
                                         r"\*\*extra, .* e\.g\. forward\(self, x, scale, "
                                         r"\*\*extra\)$"):
        pdcompile.compile(IntoKwargs(), example_inputs={"x": x, "scale": z}, stages=1,
                          frontend=frontend)
