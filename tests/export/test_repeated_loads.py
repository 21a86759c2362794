"""Loading an export again and again in one process leaves nothing behind in torch.fx: each load
traced its stages with the fused Linear kept as a call, and the stage code fx made from that
trace registered the call with `torch.fx.wrap` in a process-wide table, never emptied, that
every later fx trace patches in and out (400 loads made each load 2.5 times slower). The split's
own calls (`flatten_value`, ...) did the same, from the compiled stage code, the stage files and
the loaded stage code alike (9 entries a load of a pipeline sending an LSTM's state across a cut;
after 300 loads a load took 6.8 times as long): the loader keeps them as calls by name now."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.fx._symbolic_trace as fx_trace
from torch import nn

import pdcompile
from pdcompile.passes.crossing import flatten_value, rebuild_value
from pdcompile.runtime.linear_grads import linear_accumulate
from tests.helpers.random_models import squared_error
from tests.helpers.transparency import momentum


def test_loads_leave_fx_wrapped_functions_as_they_were(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.mse_loss,
                             stages=[1, 1], microbatches=2, cost="analytic")
    pipe.export(str(tmp_path / "out"))
    before = len(fx_trace._wrapped_fns_to_patch)
    loaded = [pdcompile.load(str(tmp_path / "out")) for _ in range(5)]
    assert len(fx_trace._wrapped_fns_to_patch) == before
    # the fused Linear is still a call of the loaded stage graphs, and they train as compiled
    assert any(node.target is linear_accumulate for stage in loaded[-1].stage_modules
               for node in stage.graph.nodes)
    assert loaded[-1].step(x, target=y) == pipe.step(x, target=y)


class _StateAcross(nn.Module):
    """An LSTM's (h, c) state crosses to the next stage whole: the split sends it flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.LSTM(4, 4, batch_first=True)
        self.second = nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.first(x)
        return self.head(self.second(out, state)[0])


def test_a_loaded_pipeline_sending_a_structured_value_exports_again_and_loads(
        tmp_path: Path) -> None:
    """The stage code keeps `flatten_value` a call when traced back only through its fx
    `wrap`: an export of the loaded pipeline must write it again (dropping every mark of the
    loaded graph, to leave fx's table alone, lost it: 'tuple index out of range' on load)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 4), torch.randn(8, 3, 4)
    kw = {"loss_fn": squared_error, "optimizer": momentum}
    pipe = pdcompile.compile(_StateAcross(), example_inputs=(x,), plan=[1, 2],
                             schedule="1f1b-flush", microbatches=2, **kw)
    pipe.export(str(tmp_path / "first"))
    assert "flatten_value" in (tmp_path / "first" / "stage_0.py").read_text()
    first = pdcompile.load(str(tmp_path / "first"), trust=True, **kw)
    first.export(str(tmp_path / "second"))
    second = pdcompile.load(str(tmp_path / "second"), trust=True, **kw)
    assert second.step(x, target=y) == first.step(x, target=y)


def test_a_pipeline_sending_a_structured_value_compiles_and_loads_leaving_fx_as_it_was(
        tmp_path: Path) -> None:
    """Neither the compiled stage code, nor the stage files, nor the loaded stage code register
    the split's `flatten_value` / `rebuild_value` with fx, and the loaded stages still call them
    (traced through, the loaded pipeline would not run)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 4), torch.randn(8, 3, 4)
    kw = {"loss_fn": squared_error, "optimizer": momentum}
    before = len(fx_trace._wrapped_fns_to_patch)
    pipe = pdcompile.compile(_StateAcross(), example_inputs=(x,), plan=[1, 2],
                             schedule="1f1b-flush", microbatches=2, **kw)
    pipe.export(str(tmp_path / "out"))
    assert "wrap(" not in (tmp_path / "out" / "stage_0.py").read_text()
    loaded = [pdcompile.load(str(tmp_path / "out"), trust=True, **kw) for _ in range(4)]
    assert len(fx_trace._wrapped_fns_to_patch) == before
    first, second = (loaded[-1].stage_modules[i].graph.nodes for i in (0, 1))
    assert any(node.target is flatten_value for node in first)
    assert any(node.target is rebuild_value for node in second)
    assert loaded[-1].step(x, target=y) == pipe.step(x, target=y)
