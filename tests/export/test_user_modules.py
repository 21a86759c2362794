"""A model file's own code in an export: `pdcompile export FILE.py:factory` records the
`loss_fn` (and a wrapped function the stage code imports) of a file no other process can import
by name; the export keeps a copy with its SHA-256 and loading imports that copy."""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export import user_modules
from pdcompile.export.user_modules import named_user_modules
from pdcompile.util.user_code import USER_MODULE_PREFIX, import_user_module
from tests.helpers.byte_damage import bounded
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


@contextmanager
def _address_space_capped(headroom: int = 8 << 30) -> Iterator[None]:
    """No allocation past this process's present size plus `headroom` (Linux): a reader that
    tries to hold a terabyte fails at once with MemoryError, whatever the machine's overcommit,
    instead of filling memory."""
    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("needs /proc (Linux) to cap the address space")
    size = next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY
                                            else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _replace(path: Path, kind: str, size: int) -> None:
    """The file at `path` replaced by a FIFO, or by a sparse file of `size` bytes."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as handle:
            handle.truncate(size)


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_model_file_replaced_after_its_import_is_not_read_whole_at_export(
        model_file: Path, tmp_path: Path, kind: str) -> None:
    """The model file replaced, after its import, by a FIFO or by a file larger than any model
    source (the export copies the file): refused in one line naming it, at once. Before, the
    export opened the FIFO and waited for a writer forever, and read any file whole."""
    module = import_user_module(str(model_file), what="model")
    model, inputs = module.factory()
    pipe = pdcompile.compile(model, example_inputs=inputs, loss_fn=module.loss_fn,
                             stages=[1, 1], microbatches=2, cost="analytic")
    _replace(model_file, kind, (64 << 20) + 1)  # 1 more than user_modules.MAX_SOURCE_BYTES
    with bounded(30), pytest.raises(PipelineInputError) as info:
        pipe.export(str(tmp_path / "exp"))
    message = str(info.value)
    assert "\n" not in message and str(model_file) in message, message
    assert "put the model file back and export again" in message, message


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_an_imported_model_file_replaced_since_is_not_read_whole_at_load(
        model_file: Path, tmp_path: Path, kind: str) -> None:
    """The model file of a module already imported under the exported name replaced by a FIFO
    or a terabyte (sparse) file: the load reads at most the copy's size of it, finds it is not
    the exported file, and imports the copy. Before, the file was read whole to hash it (a
    terabyte asked of memory: MemoryError here, under a capped address space)."""
    out = tmp_path / "exp"
    _export(model_file, out)
    _replace(model_file, kind, 1 << 40)
    with bounded(30), _address_space_capped():
        loaded = pdcompile.load(str(out))
    module = sys.modules[f"{USER_MODULE_PREFIX}usernet"]
    assert loaded.loss_fn is module.loss_fn and module.__file__ != str(model_file)


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_copy_read_from_the_folder_is_refused_unread_when_no_copy(
        model_file: Path, tmp_path: Path, kind: str) -> None:
    """`load_user_modules` without the loader's checked bytes reads the copy itself: a FIFO or
    a file one byte over any model source in its place is refused in one line naming it, at
    once. Before, the FIFO waited for a writer forever and the file was read whole before its
    SHA-256 refused it."""
    out = tmp_path / "exp"
    _export(model_file, out)
    entries = json.loads((out / "pipeline.json").read_text())["user_modules"]
    copy = out / entries[f"{USER_MODULE_PREFIX}usernet"]["file"]
    _replace(copy, kind, user_modules.MAX_SOURCE_BYTES + 1)
    _forget()
    with bounded(10), pytest.raises(DamagedFileError) as info:
        user_modules.load_user_modules(entries, out)
    message = str(info.value)
    assert "\n" not in message and str(copy) in message, message
    assert "not the copy the export wrote; export the pipeline again" in message, message
    assert kind == "fifo" or f"({user_modules.MAX_SOURCE_BYTES:,})" in message
