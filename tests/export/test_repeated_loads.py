"""Loading an export again and again in one process leaves nothing behind in torch.fx: each load
traced its stages with the fused Linear kept as a call, and the stage code fx made from that
trace registered the call with `torch.fx.wrap` in a process-wide table, never emptied, that
every later fx trace patches in and out (400 loads made each load 2.5 times slower)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.fx._symbolic_trace as fx_trace
from torch import nn

import pdcompile
from pdcompile.runtime.linear_grads import linear_accumulate


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
