"""A forward that asks Python about a traced value (`isinstance(state, tuple)` on an LSTM's
`(h, c)`) was traced by torch.fx down the other branch (fx answers from a Proxy), and the
pipeline trained another function without a word: losses 1.8e-2 off one process, the output
(1, B, 2) where the model's is (B, 2). The graph's outputs are now checked against the model's
on the example inputs: `auto` takes torch.export, which trains as one process does; `fx` is
refused in one line naming the outputs and the fix (pdcompile/passes/trace_check.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import TraceError
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.transparency import momentum


class StateAsked(nn.Module):
    """Reads an RNN's last hidden state through `isinstance(state, tuple)`: the LSTM's is
    `(h, c)`, the GRU's a tensor."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn, self.head = cell(3, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return self.head(out[:, -1] + h[-1])


def _example(cell: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = StateAsked(cell).double()
    return model, torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 2,
                                                                        dtype=torch.float64)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_forward_that_asks_isinstance_trains_as_one_process(cell: type[nn.Module]) -> None:
    model, x, y = _example(cell)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.mse_loss,
                             optimizer=momentum, stages=2, schedule="1f1b-flush",
                             microbatches=2)
    losses = [pipe.step(x, target=y) for _ in range(2)]
    want, state = flush_reference(model, (x,), y, F.mse_loss, 2, 2, momentum)
    assert losses == pytest.approx(want, rel=1e-12)
    got = pipe.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_fx_alone_refuses_a_trace_with_other_outputs_in_one_line() -> None:
    model, x, y = _example(nn.LSTM)
    with pytest.raises(TraceError) as err:
        pdcompile.compile(model, example_inputs=(x,), loss_fn=F.mse_loss, stages=2,
                          frontend="fx")
    message = str(err.value)
    assert "\n" not in message
    assert "StateAsked" in message and "float64[1, 4, 2]" in message
    assert "float64[4, 2]" in message and "frontend='export'" in message


class Normed(nn.Module):
    def __init__(self, drop: float) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.drop, self.b = nn.Dropout(drop), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.norm(self.a(x))))


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([0.0, 0.5]), st.integers(0, 2**16))
def test_the_check_leaves_buffers_and_the_random_state_as_they_were(drop: float,
                                                                    seed: int) -> None:
    """Running the model and its graph once each moves no BatchNorm statistic and draws
    nothing from the generator the user's training loop reads."""
    torch.manual_seed(seed)
    model = Normed(drop)
    x = torch.randn(6, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    pdcompile.compile(model, example_inputs=(x,), loss_fn=F.mse_loss, stages=2,
                      frontend="fx", cost="analytic")
    assert torch.equal(torch.get_rng_state(), state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
