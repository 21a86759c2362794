"""An export and a checkpoint are data: nothing in them is unpickled, and a truncated or
altered file is named in one line (by `pdcompile.load` and by `pdcompile run` before it starts
any worker)."""

from __future__ import annotations

import functools
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import PdcompileError
from pdcompile.export.checked import check_export
from pdcompile.export.integrity import seal_export
from pdcompile.runtime.checkpoint import Checkpointer, module_state, restore_module_state


class Scale(nn.Module):
    """A leaf module the export cannot write as torch.nn source: recorded as JSON."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.shape = (1, 6)
        self.gain = nn.Parameter(torch.ones(6))
        self.register_buffer("offset", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain * self.factor + self.offset


def _pipeline() -> tuple[Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Scale(0.5), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule="1f1b-flush", microbatches=2, leaf_modules=[Scale],
                             optimizer=functools.partial(torch.optim.Adam, lr=0.01))
    pipe.step(x, target=y)
    return pipe, x, y


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling (pickle's or torch.load's) fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("something was unpickled")

    class Refusing(pickle.Unpickler):  # still a class: torch subclasses pickle.Unpickler
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refusing)
    monkeypatch.setattr(torch, "load", refuse)


def test_nothing_is_unpickled_from_an_export_or_a_checkpoint(tmp_path: Path,
                                                             no_unpickling: None) -> None:
    pipe, x, y = _pipeline()
    pipe.export(str(tmp_path / "out"))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert not [f for f in files if f.endswith((".pt", ".pkl", ".pth"))], files
    assert "stage_1_modules.safetensors" in files  # the Scale leaf, recorded as JSON
    loaded = pdcompile.load(str(tmp_path / "out"))
    (scale,) = [m for m in loaded.stage_modules[1].modules() if isinstance(m, Scale)]
    assert scale.factor == 0.5 and scale.shape == (1, 6)
    assert torch.equal(scale.offset, torch.zeros(6))
    assert pipe.step(x, target=y) == loaded.step(x, target=y)

    ckpt = Checkpointer(tmp_path / "ckpt", rank=0, every=1)
    module, opt = pipe.stage_modules[1], pipe.optimizers[1]
    ckpt.save(1, module_state(module, opt, losses=[1.0, 0.5], data_position=1))
    state = ckpt.load(1)
    restore_module_state(state, loaded.stage_modules[1], loaded.optimizers[1])
    assert state["losses"] == [1.0, 0.5]
    for name, value in module.state_dict().items():
        assert torch.equal(value, loaded.stage_modules[1].state_dict()[name]), name


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path: Path) -> None:
    path.write_bytes(b"\x80\x04not a safetensors file")


def _break_python(path: Path) -> None:
    path.write_text(path.read_text() + "\ndef broken(:\n")


def _break_json(path: Path) -> None:
    path.write_text(path.read_text()[:-20])


@pytest.mark.parametrize("resealed", [False, True], ids=["manifest", "resealed"])
@pytest.mark.parametrize(("name", "damage"), [
    ("stage_1.safetensors", _truncate),
    ("optimizer_0.safetensors", _truncate),
    ("stage_1_modules.safetensors", _garble),
    ("example.safetensors", _garble),
    ("stage_1.py", _break_python),
    ("rank_0.py", _break_python),
    ("pipeline.json", _break_json),
    ("plan.json", _break_json),
])
def test_a_damaged_file_is_named_in_one_line(tmp_path: Path, name: str, damage: Any,
                                             resealed: bool,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the manifest; and with a manifest rewritten to match (a folder altered on
    purpose), by the reader's own checks, still in one line naming the file."""
    pipe, _, _ = _pipeline()
    out = tmp_path / "out"
    pipe.export(str(out))
    damage(out / name)
    if resealed:
        seal_export(out)
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert name in message and "\n" not in message, message
    assert main(["run", str(out), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert name in err and err.count("\n") == 1, err


def test_an_altered_optimizer_state_is_named(tmp_path: Path) -> None:
    """A well-formed file that does not fit: the optimizer state of another stage."""
    pipe, _, _ = _pipeline()
    out = tmp_path / "out"
    pipe.export(str(out))
    shutil.copyfile(out / "optimizer_0.safetensors", out / "optimizer_1.safetensors")
    with pytest.raises(PdcompileError, match=r"optimizer_1.safetensors does not match its "
                                             r"manifest"):
        pdcompile.load(str(out))
    seal_export(out)  # altered on purpose, manifest and all: the reader's own check names it
    with pytest.raises(PdcompileError, match=r"optimizer_1.safetensors does not fit the "
                                             r"stage's Adam optimizer"):
        pdcompile.load(str(out))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    pipe, _, _ = _pipeline()
    out = tmp_path / "out"
    pipe.export(str(out))
    (out / "stage_0.safetensors").unlink()
    with pytest.raises(PdcompileError, match=r"stage_0.safetensors is missing from the export"):
        pdcompile.load(str(out))
    with pytest.raises(PdcompileError, match=r"stage_0.safetensors is missing from the export"):
        check_export(out)


def test_an_altered_pipeline_json_is_named(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import json

    pipe, _, _ = _pipeline()
    out = tmp_path / "out"
    pipe.export(str(out))
    meta = json.loads((out / "pipeline.json").read_text())
    del meta["stages"]
    (out / "pipeline.json").write_text(json.dumps(meta))
    seal_export(out)
    with pytest.raises(PdcompileError, match=r"pipeline.json is altered or incomplete \(stages"):
        pdcompile.load(str(out))
    assert main(["run", str(out), "--dry-run"]) == 1
    assert "pipeline.json is altered" in capsys.readouterr().err


def test_an_export_of_an_older_format_is_named_and_refused(tmp_path: Path) -> None:
    """An export written before the modules moved into their rooms names them in its generated
    code: refused in one line that says so and asks for a new export (not an ImportError)."""
    import json

    from pdcompile.errors import PipelineInputError
    from pdcompile.export.files import read_meta

    (tmp_path / "pipeline.json").write_text(json.dumps({"format": "pdcompile.export/2"}))
    with pytest.raises(PipelineInputError, match="modules that have moved since.*export the "
                       "pipeline again"):
        read_meta(tmp_path)
