"""Trace pass: leaf policy, inputs and outputs of every kind, shared state, clear errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from pdcompile.errors import PipelineInputError, TraceError
from pdcompile.meta import get_frontend
from pdcompile.passes.trace import trace
from tests.helpers.buffer_models import RunningCentre
from tests.helpers.transparency import check


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.bn(self.a(x) + self.b(y))
        return h.relu(), h.sum(dim=1)


class WithKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float = 2.0) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return y * scale


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.gate = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.pre(x))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        z, _ = self.attn(y, y, y)
        return z


def _ops(gm: torch.fx.GraphModule, op: str) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == op]


def test_multi_input_multi_output_matches_model() -> None:
    model = TwoInTwoOut().train()
    gm = trace(model)
    assert _ops(gm, "placeholder") == ["x", "y"]
    x, y = torch.randn(5, 4), torch.randn(5, 6)
    got = gm(x, y)
    model_copy = TwoInTwoOut()
    model_copy.load_state_dict(model.state_dict())
    want = model_copy(x, y)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert gm.training


def test_buffers_are_the_models_own() -> None:
    model = TwoInTwoOut().train()
    gm = trace(model)
    gm(torch.randn(5, 4), torch.randn(5, 6))
    # BatchNorm's running statistics are updated in the model: the same buffer objects
    assert model.bn.num_batches_tracked.item() == 1
    assert gm.get_submodule("bn").running_mean is model.bn.running_mean
    assert "bn" in _ops(gm, "call_module")


def test_keyword_input_and_defaults() -> None:
    model = WithKeyword()
    plain = trace(model)
    assert _ops(plain, "placeholder") == ["x"]  # mask fixed to None, scale to 2.0
    assert not any(n.op == "call_function" and "assert" in str(n.target)
                   for n in plain.graph.nodes)
    x = torch.randn(3, 4)
    torch.testing.assert_close(plain(x), model(x))
    keyed = trace(model, example_kwargs_names=["mask"])
    assert _ops(keyed, "placeholder") == ["x", "mask"]
    mask = torch.zeros(3, 4)
    torch.testing.assert_close(keyed(x, mask=mask), model(x, mask=mask))


def test_positional_input_in_a_defaulted_slot() -> None:
    from pdcompile.errors import PipelineInputError
    from pdcompile.passes.shapes import annotate_shapes

    model = WithKeyword()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    with pytest.raises(PipelineInputError, match="num_positional=2"):
        annotate_shapes(trace(model), (x, mask))
    gm = trace(model, num_positional=2)
    assert _ops(gm, "placeholder") == ["x", "mask"]
    torch.testing.assert_close(gm(x, mask), model(x, mask))


def test_tied_parameters_stay_one_parameter() -> None:
    model = Tied()
    gm = trace(model)
    assert gm.get_submodule("head").weight is gm.get_submodule("emb").weight
    assert len(list(gm.parameters())) == 1
    assert gm.get_submodule("head").weight is model.emb.weight


def test_default_leaves_keep_recurrent_and_attention_whole() -> None:
    gm = trace(Recurrent())
    assert {"rnn", "attn"} <= set(_ops(gm, "call_module"))
    x = torch.randn(2, 3, 4)
    assert gm(x).shape == (2, 3, 8)


def test_untraceable_module_names_module_line_and_fix() -> None:
    with pytest.raises(TraceError) as info:
        trace(Outer())
    message = str(info.value)
    assert "'gate'" in message and "DataDependent" in message
    assert "test_trace.py" in message and "x.sum() > 0" in message
    assert "leaf_modules=['gate']" in message


def test_untraceable_root_says_what_to_do() -> None:
    with pytest.raises(TraceError) as info:
        trace(DataDependent())
    message = str(info.value)
    assert "DataDependent.forward" in message and "leaf_modules" in message


def test_leaf_by_name_and_by_type_fixes_it() -> None:
    model = Outer()
    x = torch.randn(2, 4)
    for leaves in (["gate"], [DataDependent]):
        gm = trace(model, leaf_modules=leaves)
        assert "gate" in _ops(gm, "call_module")
        torch.testing.assert_close(gm(x), model(x))


def test_bad_leaf_arguments() -> None:
    with pytest.raises(TraceError, match="not a submodule"):
        trace(Outer(), leaf_modules=["nope"])
    with pytest.raises(TraceError, match="Module types or qualified names"):
        trace(Outer(), leaf_modules=[3])  # type: ignore[list-item]
    with pytest.raises(TraceError, match="does not take"):
        trace(WithKeyword(), example_kwargs_names=["nothing"])
    with pytest.raises(TraceError, match="nn.Module"):
        trace(lambda x: x)  # type: ignore[arg-type]


def _grads_and_buffers(model: nn.Module, x: torch.Tensor, steps: int = 3
                       ) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    for _ in range(steps):
        model.zero_grad()
        model(x).square().sum().backward()
    return ({n: p.grad for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def test_no_grad_in_forward_stops_gradients_where_eager_stops_them() -> None:
    """fx records the operations under `torch.no_grad()`, not the grad mode: without the trace's
    cut the gradient flowed through the centre and the gate (and trained `gate`)."""
    torch.manual_seed(0)
    model, x = RunningCentre(), torch.randn(5, 6)
    gm = trace(copy.deepcopy(model))
    want_grads, want_buffers = _grads_and_buffers(model, x)
    got_grads, got_buffers = _grads_and_buffers(gm, x)
    assert want_grads["gate.weight"] is None and got_grads["gate.weight"] is None
    for name, grad in want_grads.items():
        if grad is not None:
            torch.testing.assert_close(got_grads[name], grad, msg=name)
    torch.testing.assert_close(got_buffers, want_buffers)


def test_no_grad_holds_under_every_cut() -> None:
    torch.manual_seed(0)
    model = RunningCentre()
    inputs, target = (torch.randn(8, 6),), torch.randint(0, 3, (8,))
    for stages in ([1, 1], [1, 1, 1], [1, 1, 1, 1]):
        check((copy.deepcopy(model), inputs, target, nn.functional.cross_entropy),
              schedule="1f1b-flush", micro=2, plan=None, stages=stages)


class Decaying(nn.Module):
    """Buffers changed in place from constants alone, which fx runs once while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(0.9)
        self.steps += 1
        return self.lin(x) * self.scale + self.steps


def test_a_buffer_changed_from_constants_changes_on_every_forward() -> None:
    torch.manual_seed(0)
    model, x = Decaying(), torch.randn(2, 4)
    gm = trace(copy.deepcopy(model))
    assert int(gm.steps) == 0 and bool((gm.scale == 1).all())  # tracing changed nothing
    for _ in range(3):
        torch.testing.assert_close(gm(x), model(x))
    assert int(gm.steps) == 3
    torch.testing.assert_close(gm.scale, torch.full((4,), 0.9 ** 3))


class CountsInControlFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x) * 2 if self.count > 2 else self.lin(x)


def test_an_untraceable_buffer_count_is_refused_and_left_as_it_was() -> None:
    model = CountsInControlFlow()
    with pytest.raises(TraceError, match=r"CountsInControlFlow.forward .* control flow"):
        trace(model)
    assert isinstance(model.count, torch.Tensor) and int(model.count) == 0


class HalfGate(nn.Module):
    """A gate computed under the model's own torch.autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = torch.tanh(self.gate(h))
        return self.b(h * torch.sigmoid(g.float()))


def test_autocast_in_forward_is_refused_by_fx_and_taken_by_torch_export(tmp_path: Path) -> None:
    """fx would run the gate in full precision without a word; compile's default front end
    falls back to torch.export, which records the autocast, and trains like eager mode. Its
    export refuses the region torch.export keeps as a graph of its own, in words."""
    torch.manual_seed(0)
    model = HalfGate()
    with pytest.raises(TraceError, match=r"HalfGate.forward runs 'gate' under torch.autocast.*"
                                         r"frontend='export'"):
        trace(model)
    inputs, target = (torch.randn(8, 8),), torch.randint(0, 3, (8,))
    pipe = check((copy.deepcopy(model), inputs, target, nn.functional.cross_entropy),
                 schedule="1f1b-flush", micro=2, plan=None, stages=[1, 1, 1])
    assert get_frontend(pipe.graph) == "export"
    with pytest.raises(PipelineInputError, match=r"torch.autocast block .* cannot write yet"):
        pipe.export(str(tmp_path / "out"))
