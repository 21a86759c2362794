"""Export and load: the files, and a round trip with identical outputs and next steps."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import PipelineInputError
from pdcompile.models import gpt2, resnet50
from pdcompile.plan import Plan
from pdcompile.schedule.ir import Schedule


def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    model, inputs = gpt2.factory(size="tiny", layers=2, d=16, heads=2, vocab_size=50, seq_len=6,
                                 batch_size=8, dropout=0.0)
    return model, inputs, gpt2.make_target(inputs, vocab_size=50)


def assert_same_state(a: pdcompile.pipeline.Pipeline, b: pdcompile.pipeline.Pipeline) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name, value in sa.items():
        assert torch.equal(value, sb[name]), name


def test_round_trip_flush_with_adam_and_tied_weights(tmp_path: Path) -> None:
    model, inputs, target = gpt()
    pipe = pdcompile.compile(model, example_inputs=inputs, loss_fn=gpt2.loss_fn,
                             optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                             plan=[1, 2, 1], schedule="1f1b-flush", microbatches=4)
    pipe.step(*inputs, target=target)  # optimizer state (Adam moments) must travel too
    pipe.export(str(tmp_path))
    names = {p.name for p in tmp_path.iterdir()}
    for i in range(3):
        assert {f"stage_{i}.py", f"stage_{i}.safetensors", f"optimizer_{i}.safetensors"} <= names
    assert {f"rank_{r}.py" for r in range(4)} <= names
    assert {"plan.json", "schedule.txt", "pipeline.json", "launch.sh", "README.md"} <= names
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == pipe.plan
    assert Schedule.from_text((tmp_path / "schedule.txt").read_text()).ranks == [0, 1, 2, 3]
    assert "pdcompile run" in (tmp_path / "launch.sh").read_text()
    assert "class Stage1(torch.nn.Module)" in (tmp_path / "stage_1.py").read_text()

    loaded = pdcompile.load(str(tmp_path))
    assert loaded.rank_sources(4, 4)[2] == (tmp_path / "rank_2.py").read_text()
    assert loaded.parts.ties and loaded.parts.ties[0].stages == (0, 2)
    assert loaded.graph is not None
    assert [n.meta["pd.stage"] for n in loaded.graph.graph.nodes] == [
        n.meta["pd.stage"] for n in pipe.graph.graph.nodes]
    with torch.no_grad():
        assert torch.equal(pipe(*inputs), loaded(*inputs))
    for _ in range(2):
        assert pipe.step(*inputs, target=target) == loaded.step(*inputs, target=target)
    assert_same_state(pipe, loaded)


@pytest.mark.parametrize("replicas", [[3, 1], [2, 3], [1, 5]])
def test_async_1f1b_with_uneven_replicas_exports_its_default_run(tmp_path: Path,
                                                                  replicas: list[int]) -> None:
    """'1f1b' runs a multiple of every replica count per run: the default length (twice the
    workers) was not one for [3, 1] (8), and the export stopped on its own schedule."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(30, 6), torch.randn(30, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.mse_loss,
                             plan=replicas, schedule="1f1b")
    workers = sum(replicas)
    assert pipe.microbatches >= 2 * workers
    assert all(pipe.microbatches % r == 0 for r in replicas)
    pipe.export(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path))
    for _ in range(2):
        assert pipe.step(x, target=y) == loaded.step(x, target=y)
    assert_same_state(pipe, loaded)


@pytest.mark.slow
def test_round_trip_async_1f1b_with_batchnorm(tmp_path: Path) -> None:
    model, inputs = resnet50.factory(batch_size=4, image_size=32, width=16, blocks=(1, 1, 1, 1))
    target = resnet50.make_target(inputs)
    momentum = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    pipe = pdcompile.compile(model, example_inputs=inputs, loss_fn=resnet50.loss_fn, plan=3,
                             schedule="1f1b", optimizer=momentum)
    batches = [(inputs, target)] * 3
    pipe.train(batches)
    pipe.export(str(tmp_path / "out"))
    loaded = pdcompile.load(str(tmp_path / "out"))
    assert pipe.train(batches) == loaded.train(batches)
    assert_same_state(pipe, loaded)


def test_optimizer_made_by_a_lambda_travels_as_class_and_hyper_parameters(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),),
                             loss_fn=nn.functional.mse_loss, plan=2, schedule="gpipe",
                             microbatches=2,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                                 nesterov=True))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.step(x, target=y)  # momentum buffers to carry over
    pipe.export(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path))
    for opt in loaded.optimizers:
        assert type(opt) is torch.optim.SGD
        assert opt.defaults["momentum"] == 0.9 and opt.defaults["nesterov"] is True
        assert opt.param_groups[0]["lr"] == 0.1
    assert pipe.step(x, target=y) == loaded.step(x, target=y)
    assert_same_state(pipe, loaded)
    # given again, the caller's factory is used, and the saved state is loaded into it
    again = pdcompile.load(str(tmp_path), optimizer=lambda p: torch.optim.SGD(p, lr=0.1,
                                                                              momentum=0.9,
                                                                              nesterov=True))
    assert again.step(x, target=y) == pdcompile.load(str(tmp_path)).step(x, target=y)
    with pytest.raises(PipelineInputError, match="pipeline.json"):
        pdcompile.load(str(tmp_path / "nothing"))


def _two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: two param groups, a class whose constructor
    does not take every key of its own defaults."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1],
                               "weight_decay": 0.0}], lr=0.01, betas=(0.8, 0.9))


def test_param_groups_and_adam_state_travel(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),),
                             loss_fn=functools.partial(nn.functional.huber_loss, delta=0.5),
                             plan=2, schedule="1f1b-flush", microbatches=2,
                             optimizer=_two_groups)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.step(x, target=y)
    pipe.export(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path))
    assert isinstance(loaded.loss_fn, functools.partial)
    assert loaded.loss_fn.keywords == {"delta": 0.5}
    for before, after in zip(pipe.optimizers, loaded.optimizers, strict=True):
        assert type(after) is torch.optim.AdamW
        assert [g["weight_decay"] for g in after.param_groups] == [0.01, 0.0]
        assert after.param_groups[0]["betas"] == (0.8, 0.9)
        assert [len(g["params"]) for g in after.param_groups] == [
            len(g["params"]) for g in before.param_groups]
    for _ in range(2):
        assert pipe.step(x, target=y) == loaded.step(x, target=y)
    assert_same_state(pipe, loaded)


class LocalSGD(torch.optim.SGD):
    pass


def test_what_has_no_import_path_must_be_given_again(tmp_path: Path) -> None:
    def local_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        class Mine(torch.optim.SGD):
            pass
        return Mine(params, lr=0.1)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),),
                             loss_fn=lambda out, y: nn.functional.mse_loss(out, y), plan=2,
                             schedule="gpipe", microbatches=2, optimizer=local_optimizer)
    with pytest.warns(UserWarning, match=r"loss_fn and optimizer cannot be saved in the export "
                                         r"\(loss_fn: it is a lambda; optimizer: Mine"):
        pipe.export(str(tmp_path))
    with pytest.raises(PipelineInputError,
                       match=r"loss_fn and optimizer of .* could not be saved at export "
                             r"\(loss_fn: it is a lambda; optimizer: Mine: .*local_optimizer.Mine "
                             r"is defined inside a function\); pass it again"):
        pdcompile.load(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path), loss_fn=nn.functional.mse_loss,
                            optimizer=functools.partial(LocalSGD, lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    assert pipe.step(x, target=y) == loaded.step(x, target=y)


def test_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vgg"
    code = main(["export", "pdcompile.models.vgg16:factory", "--stages", "2",
                 "--schedule", "gpipe", "--microbatches", "2", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "schedule gpipe" in printed and f"pdcompile run {out}" in printed
    loaded = pdcompile.load(str(out))
    from pdcompile.models import vgg16

    model, inputs = vgg16.factory()
    # the factory module's make_target gave the export its example target (default data for run)
    assert loaded.example_target is not None
    expected = vgg16.make_target(inputs)
    assert loaded.example_target.shape == expected.shape
    assert loaded.example_target.dtype == expected.dtype
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    loss = loaded.step(*inputs, target=vgg16.make_target(inputs))
    assert loss == loss  # a number (not NaN)
    assert main(["export", "pdcompile.models.vgg16:factory", "--stages", "x", "--out",
                 str(out)]) == 1


@pytest.mark.slow
def test_outputs_match_the_model_after_load(tmp_path: Path) -> None:
    model, inputs, _ = gpt()
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, plan=3,
                             schedule="gpipe", microbatches=2, loss_fn=gpt2.loss_fn)
    pipe.export(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path))
    model.eval()
    for module in loaded.stage_modules:
        module.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs), model(*inputs))


def test_loss_modules_travel_with_their_settings(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    loss = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.1)
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),), loss_fn=loss, plan=2,
                             schedule="gpipe", microbatches=2)
    pipe.export(str(tmp_path))
    loaded = pdcompile.load(str(tmp_path))
    assert isinstance(loaded.loss_fn, nn.CrossEntropyLoss)
    assert loaded.loss_fn.label_smoothing == 0.1
    assert torch.equal(loaded.loss_fn.weight, loss.weight)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    assert pipe.step(x, target=y) == loaded.step(x, target=y)


@pytest.mark.slow
def test_a_function_of_a_script_run_as_main_is_named_at_export(tmp_path: Path) -> None:
    """A loss defined in a script run as __main__ cannot be imported by another process: the
    export says so (a warning) and the load asks for it, instead of failing later."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import torch, torch.nn as nn, pdcompile\n"
        "def my_loss(out, y):\n    return nn.functional.mse_loss(out, y)\n"
        "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
        "pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),), loss_fn=my_loss, "
        "plan=2, schedule='gpipe', microbatches=2)\n"
        f"pipe.export({str(tmp_path / 'out')!r})\n")
    done = subprocess.run([sys.executable, str(script)], check=True, timeout=120,
                          capture_output=True, text=True)
    assert "my_loss is defined in the script run as __main__" in done.stderr
    with pytest.raises(PipelineInputError, match=r"loss_fn of .* could not be saved.*__main__"):
        pdcompile.load(str(tmp_path / "out"))
    loaded = pdcompile.load(str(tmp_path / "out"), loss_fn=nn.functional.mse_loss)
    assert loaded.step(torch.randn(4, 4), target=torch.randn(4, 2)) > 0


def test_the_first_target_trained_on_becomes_the_example_target(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.randn(8, 4)
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=nn.functional.cross_entropy,
                             plan=2, schedule="1f1b-flush", microbatches=2)
    assert pipe.example_target is None
    pipe.step(torch.randn(4, 4), target=torch.randint(0, 3, (4,)))  # another shape: not kept
    assert pipe.example_target is None
    y = torch.randint(0, 3, (8,))
    pipe.step(x, target=y)
    assert torch.equal(pipe.example_target, y)
    pipe.step(x, target=torch.randint(0, 3, (8,)))  # the first one stays
    assert torch.equal(pipe.example_target, y)
    pipe.export(str(tmp_path))
    assert torch.equal(pdcompile.load(str(tmp_path)).example_target, y)


def test_export_fuses_linears_unless_told_not_to(tmp_path: Path) -> None:
    """The exported stage code carries the fused accumulation; --no-fuse keeps nn.Linear calls."""
    fused, plain = tmp_path / "fused", tmp_path / "plain"
    assert main(["export", "pdcompile.models.vgg16:factory", "--stages", "2", "--out",
                 str(fused)]) == 0
    assert main(["export", "pdcompile.models.vgg16:factory", "--stages", "2", "--no-fuse",
                 "--out", str(plain)]) == 0
    fused_code = "".join(p.read_text() for p in sorted(fused.glob("stage_*.py")))
    plain_code = "".join(p.read_text() for p in sorted(plain.glob("stage_*.py")))
    assert "linear_accumulate" in fused_code
    assert "linear_accumulate" not in plain_code
    loaded = pdcompile.load(str(fused))
    assert any(n.op == "call_function" and "linear_accumulate" in str(n.target)
               for m in loaded.stage_modules for n in m.graph.nodes)
