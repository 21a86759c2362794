"""A model file's own code in an export: `pdcompile export FILE.py:factory` records the
`loss_fn` (and a wrapped function the stage code imports) of a file no other process can import
by name; the export keeps a copy with its SHA-256 and loading imports that copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import DamagedFileError
from pdcompile.export import user_modules
from pdcompile.export.user_modules import named_user_modules
from pdcompile.util.user_code import USER_MODULE_PREFIX, import_user_module
from tests.helpers.model_files import MODEL_FILE


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A model file outside the package, in a folder of its own; its module is forgotten
    after the test, as in a new process."""
    folder = tmp_path / "mine"
    folder.mkdir()
    path = folder / "usernet.py"
    path.write_text(MODEL_FILE)
    yield path
    sys.modules.pop(f"{USER_MODULE_PREFIX}usernet", None)


def _forget(name: str = f"{USER_MODULE_PREFIX}usernet") -> None:
    """What another process sees: no such module imported."""
    sys.modules.pop(name, None)


def _export(model_file: Path, out: Path) -> None:
    code = main(["export", f"{model_file}:factory", "--stages", "2", "--out", str(out)])
    assert code == 0


def test_the_export_keeps_the_model_file_and_load_imports_it(
        model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exp"
    _export(model_file, out)
    meta = json.loads((out / "pipeline.json").read_text())
    assert meta["loss_fn"] == {"function": f"{USER_MODULE_PREFIX}usernet:loss_fn"}
    entry = meta["user_modules"][f"{USER_MODULE_PREFIX}usernet"]
    assert (out / entry["file"]).read_text() == MODEL_FILE
    stage_code = "".join(p.read_text() for p in out.glob("stage_*.py"))
    assert f"from {USER_MODULE_PREFIX}usernet import shift" in stage_code
    module = sys.modules[f"{USER_MODULE_PREFIX}usernet"]
    inputs = module.factory()[1]
    target = module.make_target(inputs)
    exported = pdcompile.load(str(out))
    expected = exported.step(*inputs, target=target)

    _forget()
    model_file.unlink()  # the copy is what loads
    loaded = pdcompile.load(str(out))
    assert loaded.loss_fn is not None and loaded.loss_fn.__module__ == \
        f"{USER_MODULE_PREFIX}usernet"
    assert loaded.step(*inputs, target=target) == expected


def test_an_altered_or_missing_copy_is_named(model_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "exp"
    _export(model_file, out)
    copy = out / "user_code" / f"{USER_MODULE_PREFIX}usernet.py"
    _forget()
    copy.write_text(MODEL_FILE + "\nimport os\n")
    # the copy is in the export's manifest, which is checked before anything is imported
    with pytest.raises(DamagedFileError, match=r"usernet.py does not match its manifest"):
        pdcompile.load(str(out))
    copy.unlink()
    with pytest.raises(DamagedFileError, match=r"usernet.py is missing from the export"):
        pdcompile.load(str(out))


def test_a_copy_swapped_after_its_check_is_not_run(model_file: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file's copy replaced by other code right after its SHA-256 was checked: the
    code run is the checked bytes. Before, the file was opened again to run it, and the
    replacement ran."""
    out = tmp_path / "exp"
    _export(model_file, out)
    _forget()
    copy = out / json.loads((out / "pipeline.json").read_text())["user_modules"][
        f"{USER_MODULE_PREFIX}usernet"]["file"]
    looked_up = user_modules.user_module_file

    def swap_then_look_up(name: str) -> Path | None:
        copy.write_text(MODEL_FILE + "\nSWAPPED = True\n")
        return looked_up(name)

    monkeypatch.setattr(user_modules, "user_module_file", swap_then_look_up)
    assert pdcompile.load(str(out)).loss_fn is not None
    assert not hasattr(sys.modules[f"{USER_MODULE_PREFIX}usernet"], "SWAPPED")


def test_a_module_of_the_same_content_already_imported_is_kept(model_file: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "exp"
    _export(model_file, out)
    module = sys.modules[f"{USER_MODULE_PREFIX}usernet"]
    loaded = pdcompile.load(str(out))
    assert loaded.loss_fn is module.loss_fn


def test_an_export_of_importable_code_copies_nothing(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    assert main(["export", "pdcompile.models.democnn:factory", "--stages", "2", "--out",
                 str(out)]) == 0
    assert json.loads((out / "pipeline.json").read_text())["user_modules"] == {}
    assert not (out / "user_code").exists()


def test_only_modules_loaded_from_files_are_named(model_file: Path) -> None:
    import_user_module(str(model_file), what="model")
    name = f"{USER_MODULE_PREFIX}usernet"
    tree = {"a": [f"{name}:loss_fn", "torch.nn.functional:cross_entropy"],
            "code": f"from {name} import shift\nimport {USER_MODULE_PREFIX}nothing_loaded\n"}
    assert named_user_modules(tree) == {name}
    assert named_user_modules(torch.nn.functional.relu.__module__) == set()
