"""A model whose forward asks a traced value what it is (`isinstance(h, tuple)` after an
`nn.LSTM`) took the other branch under torch.fx, and the pipeline trained that other function
silently: `h[-1]` of the (h, c) pair is the cell state of every layer, the output was
(layers, batch, classes) instead of (batch, classes), and a loss that broadcasts took it (the
losses and weights differed from one process). Now the graph and the model are compared on the
example inputs: `auto` takes torch.export's graph, `fx` refuses in one line naming the output."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import TraceError
from pdcompile.passes.frontend import capture
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.transparency import momentum


class RecurrentClassifier(nn.Module):
    """Reads the last hidden state of an LSTM (a tuple) or a GRU (a tensor) by asking."""

    def __init__(self, gru: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        self.rnn = (nn.GRU if gru else nn.LSTM)(8, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(self.embedding(tokens))
        last = state[0] if isinstance(state, tuple) else state
        return self.head(out[:, -1] + last[-1])


def _example(gru: bool, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = RecurrentClassifier(gru).double()
    return model, torch.randint(0, 20, (4, 6)), torch.randn(4, 3, dtype=torch.float64)


@settings(max_examples=3, deadline=None)
@given(gru=st.booleans(), seed=st.integers(0, 2**16), micro=st.sampled_from([1, 2]))
def test_a_branch_on_what_a_traced_value_is_trains_like_one_process(gru: bool, seed: int,
                                                                   micro: int) -> None:
    model, tokens, target = _example(gru, seed)
    loss = nn.functional.mse_loss
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(tokens,), loss_fn=loss,
                             optimizer=momentum, stages=2, schedule="1f1b-flush",
                             microbatches=micro, cost="analytic")
    losses = [pipe.step(tokens, target=target) for _ in range(2)]
    want, state = flush_reference(model, (tokens,), target, loss, micro, 2, momentum)
    assert losses == pytest.approx(want, rel=1e-9)
    got = pipe.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_fx_alone_refuses_a_graph_that_computes_something_else() -> None:
    model, tokens, _ = _example(gru=False, seed=0)
    with pytest.raises(TraceError) as refused:
        capture(model, (tokens,), frontend="fx")
    message = str(refused.value)
    assert "\n" not in message
    assert "RecurrentClassifier" in message and "float64[4, 3] from the model" in message
    assert "float64[2, 4, 3] traced" in message and "frontend='export'" in message


def test_the_comparison_leaves_buffers_and_random_state_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    inputs = (torch.randn(8, 4),)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    capture(model, inputs, frontend="fx")
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
