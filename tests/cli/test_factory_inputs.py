"""A model factory's example inputs reach the model as `compile()` binds them, in every command.

A factory may return its example inputs as a dict bound by name (`{"input_ids": ids}`, as
Hugging Face models take them), a tuple with a None and a number for defaulted parameters
(`(x, None, 3)`), or one tensor. Before, the factory loader wrapped a dict in a 1-tuple, so
every command (export too) handed the model one positional dict ("linear(): argument 'input'
must be Tensor, not dict"), and `inspect`, `plan` and `simulate` traced with fx alone, binding
nothing: `(x, None, 3)` was refused with advice for an internal function
("trace(model, num_positional=3)") where `export` took it. Now the commands capture the model
through compile's front end (cost/costed_graph.py) and keep a dict as a dict (cli/common.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.cli import main

FACTORIES = '''
import torch
from torch import nn


class Gated(nn.Module):
    """Optional ids and gate, a scale with a default; returns its log variances as they are."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.log_var = nn.Parameter(torch.zeros(2))

    def forward(self, x, ids=None, scale: int = 2, keep=None):
        h = torch.relu(self.a(x))
        if ids is not None:
            h = h + ids[:, None].to(h.dtype)
        if keep is not None:
            h = torch.where(keep[:, None], h, -h)
        h = torch.tanh(self.b(h)) * scale
        return {"out": self.c(h), "log_var": self.log_var}


def loss_fn(out, target):
    return torch.exp(-out["log_var"][0]) * ((out["out"] - target) ** 2).mean() + \\
        out["log_var"].sum()


def by_name():
    return Gated(), {"x": torch.randn(6, 4), "ids": torch.arange(6), "scale": 3,
                     "keep": torch.arange(6) % 2 == 0}


def with_none_and_number():
    return Gated(), (torch.randn(6, 4), None, 3)


def one_tensor():
    return Gated(), torch.randn(6, 4)
'''

COMMANDS = {
    "inspect": ["inspect", "--cost", "analytic", "--json"],
    "plan": ["plan", "--cluster", "2", "--cost", "analytic", "--json"],
    "simulate": ["simulate", "--cluster", "2", "--json"],
    "export": ["export", "--cluster", "2", "--cost", "analytic", "--json", "--out"],
}


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(factory=st.sampled_from(["by_name", "with_none_and_number", "one_tensor"]),
       command=st.sampled_from(sorted(COMMANDS)))
def test_every_command_takes_the_inputs_compile_takes(
        factory: str, command: str, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path_factory.mktemp("factory")
    source = folder / "gated.py"
    source.write_text(FACTORIES)
    args = list(COMMANDS[command])
    if command == "export":
        args.append(str(folder / "pipe"))
    capsys.readouterr()
    code = main([*args, f"{source}:{factory}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    json.loads(out)  # the command's whole answer
    if command == "export":
        assert (Path(folder) / "pipe" / "pipeline.json").is_file()
