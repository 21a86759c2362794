"""The fingerprint of what a stage runs: equal for the same model (in another process, after a
fresh compile, for an export loaded back), different for models whose parameters have the same
names and shapes but compute something else."""

from __future__ import annotations

import argparse
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
from pdcompile.backends.distributed_checkpoint import (
    RESUME_ANYWAY,
    check_same_model,
    fingerprints,
)
from pdcompile.errors import DistributedError
from pdcompile.runtime.stage_fingerprint import stage_fingerprint, stage_print
from pdcompile.worker import add_training_options, training_arguments
from pdcompile.worker import parser as worker_parser

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
    # the strict part: the same parameters called in the same order, whatever the activations
    strict = [stage_print(fx.symbolic_trace(Chain(*spec, 0)))["strict"] for spec in (first,
                                                                                    second)]
    assert (strict[0] == strict[1]) == (first[1] == second[1])


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


def _refusal(saved: dict, states: list, folder: Path, **options: bool) -> str:
    with pytest.raises(DistributedError) as info:
        check_same_model(saved, states, folder, 2, **options)
    message = str(info.value)
    assert "\n" not in message and f"step 2 of stage 1 in {folder}" in message, message
    return message


def test_another_activation_is_refused_unless_resumed_anyway(tmp_path: Path) -> None:
    """ReLU where the checkpoint had Tanh: parameters, order and graph the same, a layer's
    class not: refused by default naming the stage, the layer and the opt-in; resumed with it,
    saying so."""
    relu, tanh = _compile(nn.ReLU).states(), _compile(nn.Tanh).states()
    saved = {"fingerprints": fingerprints(relu)}
    assert check_same_model(saved, relu, tmp_path, 2) == []  # the same model: resumed
    message = _refusal(saved, tanh[1:], tmp_path)
    assert "module '3' was 'torch.nn.modules.activation.ReLU()' in the checkpoint, is " \
        "'torch.nn.modules.activation.Tanh()' now" in message, message
    assert RESUME_ANYWAY in message and "another checkpoint folder" in message
    notes = check_same_model(saved, tanh[1:], tmp_path, 2, resume_anyway=True)
    assert len(notes) == 1 and "module '3'" in notes[0] and "resumed anyway" in notes[0]


def test_a_torch_upgrade_renaming_an_operation_is_refused_unless_resumed_anyway(
        tmp_path: Path) -> None:
    """The same model, its checkpoint written by a torch whose layer settings and operator
    names read otherwise (the drifting part edited as an upgrade would)."""
    states = _compile(nn.ReLU).states()
    saved = {"fingerprints": fingerprints(states)}
    drifting = saved["fingerprints"]["1"]["drifting"]
    drifting["modules"]["3"] = "torch.nn.modules.activation.ReLU(inplace=False)"
    drifting["functions"] = {**drifting["functions"], "x": "aten.relu.Tensor"}
    message = _refusal(saved, states[1:], tmp_path)
    assert "ReLU(inplace=False)" in message and RESUME_ANYWAY in message, message
    assert check_same_model(saved, states[1:], tmp_path, 2, resume_anyway=True)


@pytest.mark.parametrize("change", ["dtype", "order", "graph"])
def test_a_strict_difference_is_refused_even_resumed_anyway(tmp_path: Path, change: str
                                                            ) -> None:
    """Another parameter dtype, another parameter order, layers called in another order:
    the checkpoint's numbers would mean something else; no opt-in resumes it."""
    spec = (("relu", "relu"), (0, 1))
    model = fx.symbolic_trace(Chain(*spec, 0))
    names = [n for n, _ in model.named_parameters()]
    other, other_names = model, names
    if change == "dtype":
        other = fx.symbolic_trace(Chain(*spec, 0)).double()
    elif change == "order":
        other_names = names[::-1]
    else:
        other = fx.symbolic_trace(Chain(spec[0], (1, 0), 0))
    saved = {"fingerprints": {"1": stage_print(model, names)}}
    for anyway in (False, True):
        message = _refusal(saved, [_Held(other, other_names)], tmp_path, resume_anyway=anyway)
        assert "written by another model" in message and "resume_anyway" not in message


@pytest.mark.parametrize("recorded", ["none", "older form"])
def test_a_checkpoint_without_a_print_is_refused_unless_resumed_anyway(
        tmp_path: Path, recorded: str) -> None:
    """Written before checkpoints recorded prints (none), or recorded as the single hash
    checkpoints stored before the strict and drifting parts were split, which differs."""
    relu, tanh = _compile(nn.ReLU).states(), _compile(nn.Tanh).states()
    saved = {} if recorded == "none" else {
        "fingerprints": {s: stage_fingerprint(t.module, t.param_order)
                         for s, t in zip(("0", "1"), tanh, strict=True)}}
    message = _refusal(saved, relu[1:], tmp_path)
    assert RESUME_ANYWAY in message and ("written before checkpoints recorded" in message
                                         if recorded == "none" else "older form" in message)
    assert check_same_model(saved, relu[1:], tmp_path, 2, resume_anyway=True)


def test_a_checkpoint_of_the_older_form_by_the_same_model_resumes(tmp_path: Path) -> None:
    states = _compile(nn.ReLU).states()
    saved = {"fingerprints": {str(s.stage): stage_fingerprint(s.module, s.param_order)
                              for s in states}}
    assert check_same_model(saved, states, tmp_path, 2) == []


def test_the_opt_in_is_a_training_flag_passed_to_workers() -> None:
    """`pdcompile run --resume-anyway` reaches the worker's command line and its parser."""
    options = argparse.ArgumentParser()
    add_training_options(options, fault_timeout=None)
    args = options.parse_args(["--resume-anyway"])
    assert args.resume_anyway and "--resume-anyway" in training_arguments(args)
    assert worker_parser().parse_args(["out", *training_arguments(args)]).resume_anyway


class _Held:
    """What check_same_model reads of a rank's state: its stage, module and parameter order."""

    def __init__(self, module: torch.nn.Module, param_order: list[str]) -> None:
        self.stage, self.module, self.param_order = 1, module, tuple(param_order)


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
