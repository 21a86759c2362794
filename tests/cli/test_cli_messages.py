"""Messages a user meets: every user error of the command line is one line (exit 1; usage
errors exit 2, also in one line), a mistyped name gets a 'did you mean', a model module or
factory that cannot be imported or fails is named with where, and `step(x, y)` points at
`target=`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import ClusterError, PdcompileError, PipelineInputError
from pdcompile.machine.cluster import Cluster
from tests.helpers.byte_damage import bounded


def _one_line(err: str, command: str) -> None:
    assert err.count("\n") == 1, err
    assert err.startswith(f"pdcompile {command}: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "expect"), [
    (["inspect", "pdcompile.models.vgg17:factory"],
     "the model module 'pdcompile.models.vgg17' does not exist: no module named "
     "'pdcompile.models.vgg17' (did you mean 'pdcompile.models.vgg16'?)"),
    (["inspect", "pdcompile.modles.vgg16:factory"],
     "no module named 'pdcompile.modles' (did you mean 'pdcompile.models'?)"),
    (["export", "pdcompile.models.vgg16:factroy", "--out", "o"],
     "pdcompile.models.vgg16 has no callable 'factroy' (did you mean 'factory'?)"),
    (["plan", "pdcompile.models.vgg16:factory", "--cluster", "h100node"],
     "unknown cluster preset 'h100node' (did you mean 'h100-node'?)"),
    (["plan", "pdcompile.models.vgg16:factory", "--cluster", "locl-4"],
     "(did you mean 'local-4'?)"),
])
def test_mistyped_names_get_did_you_mean(argv: list[str], expect: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert expect in err, err
    _one_line(err, argv[0])


@pytest.mark.parametrize(("source", "expect"), [
    ("import not_a_real_package_xyz\n\ndef factory():\n    pass\n",
     "importing model file '{file}' raised ModuleNotFoundError: No module named "
     "'not_a_real_package_xyz' ({file}, line 1)"),
    ("def factory(:\n    pass\n", "model file '{file}' has a syntax error at line 1"),
    ("def factory():\n    raise ValueError('no weights here')\n",
     "{file}:factory() raised ValueError: no weights here ({file}, line 2)"),
    ("def factory():\n    return 3\n", "{file}:factory() must return (model, example_inputs)"),
    ("import torch\n\ndef factory():\n    x = torch.randn(4, 3)\n"
     "    return torch.nn.Linear(3, 2), (x,), torch.zeros(4, dtype=torch.long)\n",
     "{file}:factory() must return (model, example_inputs), two values, got a tuple of 3 values;"
     " define a loss beside the factory as def loss_fn(output, target), and a target for the "
     "inputs as def make_target(inputs)"),
    ("def factory():\n    return (3,)\n", "got a tuple of 1 value;"),
])
def test_a_model_file_that_fails_is_one_line_with_where(
        tmp_path: Path, source: str, expect: str, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "net.py"
    file.write_text(source)
    assert main(["inspect", f"{file}:factory"]) == 1
    err = capsys.readouterr().err
    assert expect.format(file=file) in err, err
    _one_line(err, "inspect")


@pytest.mark.parametrize(("argv", "expect"), [
    (["plna"], "invalid choice: 'plna' (did you mean 'plan'?); choose from inspect, plan"),
    (["export", "m.py:f", "--out", "o", "--schedule", "1fb1"],
     "invalid choice: '1fb1' (did you mean '1f1b'?)"),
    (["plan", "--profile", "x", "--cluster", "A", "--tim-limit=3"],
     "unrecognized arguments: --tim-limit=3 (did you mean '--time-limit'?)"),
])
def test_usage_errors_are_one_line_with_did_you_mean(argv: list[str], expect: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1 and "--help" in err, err


def test_cluster_presets_list_local_n(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "local-N" in capsys.readouterr().out
    with pytest.raises(ClusterError, match=r"presets are: A, B, C, .*local-N"):
        Cluster.preset("Z")


def test_step_with_the_target_given_positionally_suggests_target() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             plan=2, schedule="gpipe", microbatches=2)
    with pytest.raises(PipelineInputError, match=r"the model takes 1 input \(input_1\) and "
                                                 r"step\(\) got 2: is the last one the target\? "
                                                 r"Pass it by name: pipe.step\(input_1, "
                                                 r"target=y\)"):
        pipe.step(x, y)
    with pytest.raises(PipelineInputError, match=r"minibatch 0 has no target, and the pipeline "
                                                 r"has a loss function"):
        pipe.step(x)
    assert pipe.step(x, target=y) > 0


def test_unknown_schedule_gets_did_you_mean() -> None:
    with pytest.raises(PdcompileError, match=r"unknown schedule 'gpip' \(did you mean 'gpipe'"):
        pdcompile.compile(nn.Linear(2, 2), example_inputs=(torch.randn(2, 2),), plan=1,
                          schedule="gpip")


@pytest.mark.parametrize("count", ["0", "-1"])
def test_simulate_refuses_a_stream_of_no_minibatches(count: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--minibatches 0` fell back to the default stream and -1 simulated one minibatch; each
    printed a time per minibatch as the plan's, without a word."""
    assert main(["simulate", "--profile", "alexnet", "--cluster", "2@1e10",
                 "--minibatches", count]) == 1
    err = capsys.readouterr().err
    assert f"minibatches={count}: give a positive number of minibatches" in err, err
    _one_line(err, "simulate")


@pytest.mark.parametrize("count", ["0", "-2"])
def test_inspect_refuses_a_top_of_no_nodes(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--top -2` showed every node but two (a Python slice) under "the most expensive", and
    0 an empty table."""
    assert main(["inspect", "--profile", "alexnet", "--top", count]) == 1
    err = capsys.readouterr().err
    assert f"--top takes a positive node count, not {count}" in err, err
    _one_line(err, "inspect")


@pytest.mark.parametrize(("name", "options", "role"), [
    ("graph.txt", ["--cluster", "4", "--profile", "{fifo}"], "profile"),
    ("graph.json", ["--cluster", "4", "--costgraph", "{fifo}"], "CostGraph"),
    ("cluster.yaml", ["--cluster", "{fifo}", "--profile", "vgg16"], "cluster file"),
    ("cluster", ["--cluster", "{fifo}", "--profile", "vgg16"], "cluster file"),
], ids=["profile", "costgraph", "cluster", "cluster-without-suffix"])
def test_a_fifo_named_as_an_input_file_is_one_line_at_once(
        tmp_path: Path, name: str, options: list[str], role: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`pdcompile plan --profile FIFO` (or --costgraph, --cluster): refused in one line naming
    the file, exit 1. Before, the command waited for a writer forever (a cluster FIFO without
    a suffix was taken for a preset's name: "unknown cluster preset")."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    with bounded(10):
        assert main(["plan", *(o.format(fifo=fifo) for o in options)]) == 1
    err = capsys.readouterr().err
    _one_line(err, "plan")
    assert f"{role} {fifo} is not a plain file but a FIFO" in err, err
