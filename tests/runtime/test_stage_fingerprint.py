"""The fingerprint of what a stage runs: equal for the same model (in another process, after a
fresh compile, for an export loaded back), different for models whose parameters have the same
names and shapes but compute something else."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

import pdcompile
from pdcompile.backends.distributed_checkpoint import check_same_model, fingerprints
from pdcompile.errors import DistributedError
from pdcompile.runtime.stage_fingerprint import stage_fingerprint

WIDTH = 6
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid,
               "leaky0.1": functools.partial(nn.LeakyReLU, 0.1),
               "leaky0.2": functools.partial(nn.LeakyReLU, 0.2)}


class Chain(nn.Module):
    """Square Linear layers called in `order`, each followed by an activation: every drawn
    model has the same parameter names and shapes."""

    def __init__(self, acts: tuple[str, ...], order: tuple[int, ...], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in acts)
        self.acts = nn.ModuleList(ACTIVATIONS[a]() for a in acts)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.acts[i](self.layers[i](x))
        return x


@st.composite
def chains(draw: st.DrawFn) -> tuple[tuple[str, ...], tuple[int, ...]]:
    acts = tuple(draw(st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=1, max_size=3)))
    return acts, tuple(draw(st.permutations(range(len(acts)))))


def _print(spec: tuple[tuple[str, ...], tuple[int, ...]], seed: int) -> str:
    return stage_fingerprint(fx.symbolic_trace(Chain(*spec, seed)))


@settings(max_examples=40, deadline=None)
@given(first=chains(), second=chains(), seeds=st.tuples(st.integers(0, 9), st.integers(0, 9)))
def test_equal_exactly_for_the_same_computation(first: tuple, second: tuple,
                                                seeds: tuple[int, int]) -> None:
    """Same layers, activations and call order: equal whatever the weights; another activation,
    the same activation configured otherwise, or another call order: different."""
    assert _print(first, seeds[0]) == _print(first, seeds[1])
    # no two entries of ACTIVATIONS compute the same function
    assert (_print(first, seeds[0]) == _print(second, seeds[1])) == (first == second)


def test_the_parameter_order_and_dtypes_count() -> None:
    model = fx.symbolic_trace(Chain(("relu", "relu"), (0, 1), 0))
    names = [n for n, _ in model.named_parameters()]
    assert stage_fingerprint(model, names) != stage_fingerprint(model, names[::-1])
    assert stage_fingerprint(model) != stage_fingerprint(model.double())


def _compile(act: type[nn.Module]) -> pdcompile.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), act(), nn.Linear(WIDTH, WIDTH), act(),
                          nn.Linear(WIDTH, 3))
    return pdcompile.compile(model, example_inputs=(torch.randn(4, WIDTH),),
                             example_target=torch.randint(0, 3, (4,)),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             schedule="1f1b", microbatches=2, stages=[1, 1])


_IN_ANOTHER_PROCESS = """
import sys, pdcompile
from pdcompile.backends.distributed_checkpoint import fingerprints
print(sorted(fingerprints(pdcompile.load(sys.argv[1]).states()).items()))
"""


@pytest.mark.slow
def test_the_same_model_compiled_exported_and_loaded_elsewhere_has_the_same_prints(
        tmp_path: Path) -> None:
    """A compiled pipeline, a fresh compile of the same model, and its export loaded in another
    process (another hash seed) agree; the export keeps parameter holders as plain modules,
    which the fingerprint leaves out."""
    pipe = _compile(nn.ReLU)
    mine = fingerprints(pipe.states())
    assert fingerprints(_compile(nn.ReLU).states()) == mine
    pipe.export(str(tmp_path / "pipe"))
    assert fingerprints(pdcompile.load(str(tmp_path / "pipe")).states()) == mine
    out = subprocess.run([sys.executable, "-c", _IN_ANOTHER_PROCESS, str(tmp_path / "pipe")],
                         capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == str(sorted(mine.items()))


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path: Path) -> None:
    relu, tanh = _compile(nn.ReLU).states(), _compile(nn.Tanh).states()
    saved = {"fingerprints": fingerprints(relu)}
    check_same_model(saved, relu, tmp_path, 2)  # the same model: resumed
    with pytest.raises(DistributedError) as info:
        check_same_model(saved, tanh[1:], tmp_path, 2)
    message = str(info.value)
    assert "\n" not in message and f"the checkpoints in {tmp_path} were written by another " \
        "model: step 2 of stage 1 holds the state of another model" in message, message
    assert "another checkpoint folder" in message
    with pytest.raises(DistributedError, match="written before checkpoints recorded the model"):
        check_same_model({}, relu, tmp_path, 2)  # a checkpoint older than fingerprints


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _Triple(_Double):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class _Applies(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


def test_two_autograd_functions_differ() -> None:
    """Both are called as `<class>.apply`, a method their classes share: the class counts."""
    graphs = [fx.symbolic_trace(_Applies(f)) for f in (_Double, _Triple)]
    assert stage_fingerprint(graphs[0]) != stage_fingerprint(graphs[1])
