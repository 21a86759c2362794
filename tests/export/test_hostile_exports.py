"""Exports nobody here wrote: a flipped byte anywhere, files swapped in from another export,
files added beside the manifest, JSON nested past any reader's depth, a signature that is not
text, folders where files belong. Each is refused in one line naming the file (no other
exception, no code of the folder run), or loads exactly what was written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PdcompileError
from pdcompile.export import read as pdcompile_read
from pdcompile.export.checked import check_export
from pdcompile.export.integrity import seal_export
from pdcompile.pipeline import Pipeline
from pdcompile.util.manifest import write_manifest
from tests.helpers.byte_damage import bounded, damage


def _pipeline(seed: int, *, example: bool = True) -> Pipeline:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, stages=[1, 1], microbatches=2,
                             cost="analytic",
                             optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    pipe.step(x, target=y)  # optimizer state that differs between the two exports
    if not example:
        pipe.example_inputs = None
    return pipe


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two exports of one architecture with different weights (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("exports")
    for seed in (0, 1):
        _pipeline(seed).export(str(root / f"seed{seed}"))
    return root / "seed0", root / "seed1"


def _copy(source: Path, folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    return folder


def _state(pipe: Pipeline) -> list[tuple[str, torch.Tensor]]:
    out = [(f"{i}.{k}", v) for i, m in enumerate(pipe.stage_modules)
           for k, v in m.state_dict().items()]
    for state in pipe.states():
        for k, v in state.optimizer.state_dict()["state"].items():
            out += [(f"opt{state.stage}.{k}.{n}", t) for n, t in v.items()
                    if isinstance(t, torch.Tensor)]
    out += [("example", t) for t in pipe.example_inputs or ()]
    return out


def _same(a: Pipeline, b: Pipeline) -> bool:
    left, right = _state(a), _state(b)
    return len(left) == len(right) and all(
        n == m and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for (n, x), (m, y) in zip(left, right, strict=True))


def _refused_in_one_line(folder: Path, *, trust: bool = False) -> str:
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(folder), trust=trust)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message
    return message


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damage_anywhere_is_refused_or_changes_nothing(
        exports: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    """Any file (the manifest and signature included) with bytes flipped anywhere, cut short
    or extended: load refuses in one line naming a file of the folder (no other exception,
    no hang), or loads exactly what was written. With trust=True too: trust lifts the
    signature, not the manifest."""
    original, _ = exports
    folder = _copy(original, tmp_path_factory.mktemp("damage") / "out")
    damage(data, [p for p in folder.rglob("*") if p.is_file()])
    trust = data.draw(st.booleans(), label="trust")
    try:
        with bounded(60):
            loaded = pdcompile.load(str(folder), trust=trust)
    except PdcompileError as err:
        assert "\n" not in str(err) and str(folder) in str(err)
        return
    assert _same(loaded, pdcompile.load(str(original)))


@pytest.mark.parametrize("names", [
    ["stage_0.safetensors"], ["optimizer_1.safetensors"], ["example.safetensors"],
    ["MANIFEST.json"], ["MANIFEST.sig"], ["MANIFEST.json", "MANIFEST.sig"],
    ["MANIFEST.json", "MANIFEST.sig", "stage_0.safetensors", "pipeline.json"]])
def test_files_swapped_in_from_another_export_are_refused(
        exports: tuple[Path, Path], tmp_path: Path, names: list[str]) -> None:
    """Files of another export of the same model (the manifest and signature with them) mixed
    into this one: the mix never loads as either."""
    mine, theirs = exports
    folder = _copy(mine, tmp_path / "mixed")
    for name in names:
        shutil.copy(theirs / name, folder / name)
    _refused_in_one_line(folder)


def test_files_swapped_after_the_check_are_not_loaded(
        exports: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file of another export of the same model put in place of this one's right after
    the manifest check passed (and before anything is loaded): the load still returns exactly
    what was checked. Before, the folder was hashed, then its files opened again to load them,
    and the other export's weights, optimizer state and example were loaded unchecked."""
    mine, theirs = exports
    folder = _copy(mine, tmp_path / "swapped")
    checked = pdcompile_read.check_imports

    def check_then_swap(*args: Any, **kwargs: Any) -> None:
        checked(*args, **kwargs)
        for file in theirs.iterdir():
            if file.is_file() and not file.name.startswith("MANIFEST"):
                shutil.copy(file, folder / file.name)

    monkeypatch.setattr(pdcompile_read, "check_imports", check_then_swap)
    loaded = pdcompile.load(str(folder))
    monkeypatch.undo()
    assert _same(loaded, pdcompile.load(str(mine)))
    assert not _same(loaded, pdcompile.load(str(theirs)))


def test_a_data_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    """An export written without an example minibatch, with another export's
    example.safetensors dropped beside its (untouched, signed) manifest: load and
    `pdcompile verify` refuse it; before, it loaded that file's tensors as its example."""
    without, other = tmp_path / "without", tmp_path / "other"
    _pipeline(0, example=False).export(str(without))
    _pipeline(1).export(str(other))
    assert pdcompile.load(str(without)).example_inputs is None
    shutil.copy(other / "example.safetensors", without / "example.safetensors")
    message = _refused_in_one_line(without)
    assert "example.safetensors is not listed in MANIFEST.json" in message
    assert "example.safetensors is not listed" in _refused_in_one_line(without, trust=True)
    with pytest.raises(PdcompileError, match="example.safetensors is not listed"):
        check_export(without)


def _manifest_naming(name: str) -> Any:
    def damage(folder: Path) -> None:
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        manifest["files"][name] = {"size": 1, "sha256": "0" * 64}
        (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    return damage


def _replaced_by_folder(name: str) -> Any:
    def damage(folder: Path) -> None:
        os.unlink(folder / name)
        (folder / name).mkdir()
    return damage


def _written(name: str, data: bytes) -> Any:
    return lambda folder: (folder / name).write_bytes(data)


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("damage", [
    _written("MANIFEST.sig", b"\xff\xfe not text"),
    _written("MANIFEST.sig", b""),
    _written("pipeline.json", _DEEP),
    _written("MANIFEST.json", b'{"format": ' + _DEEP + b"}"),
    _written("MANIFEST.json", _DEEP),
    _replaced_by_folder("pipeline.json"),
    _replaced_by_folder("MANIFEST.json"),
    _replaced_by_folder("MANIFEST.sig"),
    _replaced_by_folder("stage_1.safetensors"),
    _manifest_naming("nul\x00byte"),
    _manifest_naming(""),
    _manifest_naming("."),
    _manifest_naming("user_code/../../outside"),
    _manifest_naming("/etc/hostname"),
], ids=["signature-not-text", "signature-empty", "pipeline-json-nested",
        "manifest-nested-value", "manifest-nested", "pipeline-json-folder", "manifest-folder",
        "signature-folder", "weights-folder", "manifest-nul", "manifest-empty-name",
        "manifest-dot", "manifest-dotdot", "manifest-absolute"])
def test_malformed_containers_are_refused_in_one_line(
        exports: tuple[Path, Path], tmp_path: Path, damage: Any) -> None:
    """Files that are not what their names say: load (with or without trust) and the check
    `pdcompile verify` and `run` make refuse them in one line naming the folder."""
    folder = _copy(exports[0], tmp_path / "out")
    damage(folder)
    _refused_in_one_line(folder)
    if "MANIFEST.sig" in {p.name for p in folder.iterdir()} and _intact_but_signature(folder,
                                                                                    exports[0]):
        # trust=True is the user's word for whoever wrote it, in place of the signature
        assert _same(pdcompile.load(str(folder), trust=True), pdcompile.load(str(exports[0])))
        return
    _refused_in_one_line(folder, trust=True)
    with pytest.raises(PdcompileError) as info:
        check_export(folder)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)


def _intact_but_signature(folder: Path, original: Path) -> bool:
    return all((folder / p.name).is_file() and (folder / p.name).read_bytes() == p.read_bytes()
               for p in original.iterdir() if p.is_file() and p.name != "MANIFEST.sig")


_EDITS = st.none() | st.booleans() | st.integers(-2, 10**9) | st.floats(allow_nan=False) | \
    st.sampled_from(["", "x", "os:system", "_0", "input_1"]) | \
    st.lists(st.integers(0, 2) | st.text(max_size=3), max_size=2) | \
    st.dictionaries(st.text(max_size=3), st.integers(0, 2), max_size=2)


def _leaves(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for key, value in items:
        out += _leaves(value, (*path, key))
    return out


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_pipeline_json_edited_by_another_loads_with_trust_or_is_one_line(
        exports: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    """Someone else's export (no signature of this user's) whose pipeline.json has a field
    dropped or changed, loaded with trust=True: it loads, or one line names pipeline.json
    (before: KeyError, TypeError, AttributeError... from deep in the loader)."""
    folder = _copy(exports[0], tmp_path_factory.mktemp("edited") / "out")
    meta = json.loads((folder / "pipeline.json").read_text())
    path = data.draw(st.sampled_from([p for p in _leaves(meta) if p[0] != "format"]),
                     label="field")
    parent = meta
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans(), label="drop"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_EDITS, label="value")
    (folder / "pipeline.json").write_text(json.dumps(meta))
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()  # another's: not signed by this user
    try:
        pdcompile.load(str(folder), trust=True)
    except PdcompileError as err:
        assert "\n" not in str(err) and str(folder) in str(err)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(['Net"""\nopen(MARKER, "w")\n"""', "\\", 'N"', "\r\u2028\x01"])
       | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                 min_size=1, max_size=12))  # a lone surrogate cannot be a class's name at all
def test_a_model_class_name_stays_text_in_the_generated_code(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    """The model's class name (free text for a class made by type()) is written into every
    stage file's docstring: it reads back as that text and never runs (before, a name with
    three quotes and code ended the docstring, and load ran the code)."""
    import ast

    folder = tmp_path_factory.mktemp("named") / "out"
    marker = folder.parent / "ran"
    named = type(name.replace("MARKER", repr(str(marker))), (nn.Sequential,), {})
    torch.manual_seed(0)
    model = named(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 6),),
                             loss_fn=nn.functional.mse_loss, stages=[1, 1], microbatches=2,
                             cost="analytic")
    pipe.export(str(folder))
    assert pdcompile.load(str(folder)).name == named.__name__
    assert not marker.exists()
    for stage in ("stage_0.py", "stage_1.py"):
        doc = ast.get_docstring(ast.parse((folder / stage).read_text()), clean=False)
        assert doc is not None and named.__name__ in doc


@pytest.mark.parametrize("name", ["pipeline.json", "MANIFEST.json"])
def test_a_json_file_larger_than_any_written_is_refused_unread(
        exports: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    """A 512 MiB pipeline.json or manifest (sparse: no disk used) is refused from its size,
    before it is read into memory (before, it was read whole, then parsed)."""
    folder = _copy(exports[0], tmp_path / "out")
    with open(folder / name, "wb") as out:
        out.truncate(512 << 20)
    message = _refused_in_one_line(folder)
    assert f"{512 << 20:,} bytes" in message and name in message


def test_a_signed_manifest_swapped_in_after_the_check_does_not_vouch_for_the_files(
        exports: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stage_0.py edited and the manifest written again without the key (so unsigned), the
    user's signed manifest put back right after the files were checked against the forged
    one: the signature is checked on the manifest the files were checked against, and the
    export is refused before its code runs. Before, the signature was checked on the file read
    again, so the put-back manifest vouched for the edited code, which ran."""
    mine, _ = exports
    folder = _copy(mine, tmp_path / "forged")
    signed = (folder / "MANIFEST.json").read_bytes()
    marker = tmp_path / "payload-ran"
    with open(folder / "stage_0.py", "a") as code:
        code.write(f"\nopen({str(marker)!r}, 'w').close()\n")
    names = [p.name for p in folder.iterdir() if p.name not in ("MANIFEST.json", "MANIFEST.sig")]
    write_manifest(folder, names, kind="export", manifest_name="MANIFEST.json")
    listed = pdcompile_read.code_files  # called once the files were checked, before the trust

    def put_back(*args: Any, **kwargs: Any) -> list[str]:
        (folder / "MANIFEST.json").write_bytes(signed)
        return listed(*args, **kwargs)

    monkeypatch.setattr(pdcompile_read, "code_files", put_back)
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(folder))
    assert "MANIFEST.sig does not match" in str(info.value) and not marker.exists()


@pytest.mark.parametrize("name", ["pipeline.json", "MANIFEST.json"])
def test_a_fifo_in_place_of_a_json_file_is_refused_at_once(
        exports: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    """A FIFO where pipeline.json or the manifest belongs: refused in one line naming it, at
    once (before, the loader opened it to read and waited for a writer forever)."""
    folder = _copy(exports[0], tmp_path / "out")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    with bounded(30):
        message = _refused_in_one_line(folder, trust=True)
    assert name in message and "not a plain file" in message, message


@pytest.mark.parametrize("name", ["rank_0.py", "stage_1.py", "schedule.txt", "plan.json"])
def test_a_huge_sparse_file_under_a_manifest_written_again_is_refused_at_once(
        exports: tuple[Path, Path], tmp_path: Path, name: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A file read whole (code, the schedule, JSON) made an 8 GiB sparse file, the manifest
    written again to list it (someone else's export, trusted): loading, check_export and
    `pdcompile verify --trust` refuse it at once, naming it. Before, each read all 8 GiB into
    memory (over a minute) before the digest refused it."""
    from pdcompile.cli import main

    folder = _copy(exports[0], tmp_path / "out")
    os.truncate(folder / name, 8 << 30)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"][name]["size"] = 8 << 30
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    (folder / "MANIFEST.sig").unlink()
    with bounded(20):
        message = _refused_in_one_line(folder, trust=True)
        assert name in message and "read whole" in message, message
        with pytest.raises(PdcompileError) as info:
            check_export(folder)
        assert str(folder / name) in str(info.value), info.value
        assert main(["verify", str(folder), "--trust"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder / name) in err, err


def _swap(a: str, b: str) -> Any:
    def damage(folder: Path) -> None:
        first, second = (folder / a).read_bytes(), (folder / b).read_bytes()
        (folder / a).write_bytes(second)
        (folder / b).write_bytes(first)
    return damage


def _plan_number(folder: Path) -> None:
    plan = json.loads((folder / "plan.json").read_text())
    plan["stages"][0]["compute"] += 4.0  # a prediction no other file repeats
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))


def _cut_at_line(name: str, lines: int) -> Any:
    def damage(folder: Path) -> None:
        text = (folder / name).read_text().splitlines(keepends=True)
        (folder / name).write_text("".join(text[:lines]))
    return damage


def _optimizer_state(change: Any) -> Any:
    """`change` applied to stage 0's saved optimizer state (Adam's: its tree, as torch gives
    it) and the file written again."""
    def damage(folder: Path) -> None:
        from pdcompile.runtime.tensor_tree import load_tree, save_tree

        path = folder / "optimizer_0.safetensors"
        state = load_tree(path)
        change(state)
        save_tree(path, state)
    return damage


def _exp_avg_a_table(state: dict[str, Any]) -> None:
    """Adam's exp_avg of stage 0's first parameter a table instead of a tensor."""
    first = next(iter(state["state"].values()))
    first["exp_avg"] = {"not": first["exp_avg"]}


def _exp_avg_reshaped(state: dict[str, Any]) -> None:
    """Adam's exp_avg_sq of stage 0's first parameter (8 x 6) a tensor of another shape."""
    first = next(iter(state["state"].values()))
    first["exp_avg_sq"] = first["exp_avg_sq"].reshape(-1)


def _exp_avg_a_number(state: dict[str, Any]) -> None:
    """Adam's exp_avg of stage 0's first parameter a number (broadcast at the first step)."""
    next(iter(state["state"].values()))["exp_avg"] = 0.5


def _step_a_word(state: dict[str, Any]) -> None:
    """Adam's step count of stage 0's first parameter a word."""
    next(iter(state["state"].values()))["step"] = "many"


def _a_parameter_more(state: dict[str, Any]) -> None:
    """The saved group one parameter longer than the recorded optimizer's."""
    group = state["param_groups"][0]
    group["params"] = [*group["params"], max(group["params"]) + 1]


_OPTIMIZER_DAMAGE = [(_optimizer_state(c), "optimizer_0.safetensors")
                     for c in (_exp_avg_a_table, _exp_avg_reshaped, _exp_avg_a_number,
                               _step_a_word, _a_parameter_more)]
_OPTIMIZER_IDS = ["optimizer-state-a-table", "optimizer-state-reshaped",
                  "optimizer-state-a-number", "optimizer-step-a-word",
                  "optimizer-group-longer"]


@pytest.mark.parametrize("damage, culprit", [
    (_swap("rank_0.py", "rank_1.py"), "rank_0.py"),
    (_cut_at_line("rank_1.py", 12), "rank_1.py"),
    (_plan_number, "plan.json"),
    *_OPTIMIZER_DAMAGE,
], ids=["rank-files-swapped", "rank-file-cut-at-a-line", "plan-prediction-changed",
        *_OPTIMIZER_IDS])
def test_one_file_changed_under_a_manifest_written_again_is_refused(
        exports: tuple[Path, Path], tmp_path: Path, damage: Any, culprit: str) -> None:
    """One file changed into another that still parses, the manifest written again over it
    (someone else's export, loaded with trust=True): refused in one line naming the file.
    Before, each loaded: swapped or cut rank files deadlocked the first step, a plan priced
    otherwise was reported as the export's, and Adam's state with a table in place of a tensor
    failed at the first step with AttributeError."""
    folder = _copy(exports[0], tmp_path / "out")
    damage(folder)
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()
    with bounded(60):
        message = _refused_in_one_line(folder, trust=True)
    assert culprit in message, message


@pytest.mark.parametrize("damage, culprit", [
    (_swap("rank_0.py", "rank_1.py"), "rank_0.py"),
    (_cut_at_line("rank_1.py", 12), "rank_1.py"),
    (_plan_number, "plan.json"),
    *_OPTIMIZER_DAMAGE,
], ids=["rank-files-swapped", "rank-file-cut-at-a-line", "plan-prediction-changed",
        *_OPTIMIZER_IDS])
def test_what_loading_refuses_verify_and_a_dry_run_refuse_too(
        exports: tuple[Path, Path], tmp_path: Path, damage: Any, culprit: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The same files changed under a manifest written again: check_export, `pdcompile verify
    --trust` and `pdcompile run --trust --dry-run` refuse them in one line naming the file, as
    loading does (before, verify passed swapped or cut rank files: only the loader compared
    them with the code generated from schedule.txt; and an optimizer state that does not fit
    the recorded optimizer: only the loader fitted it)."""
    from pdcompile.cli import main

    folder = _copy(exports[0], tmp_path / "out")
    damage(folder)
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()
    with pytest.raises(PdcompileError) as info:
        check_export(folder)
    assert "\n" not in str(info.value) and str(folder / culprit) in str(info.value), info.value
    for command in (["verify", str(folder), "--trust"],
                    ["run", str(folder), "--trust", "--dry-run"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(folder / culprit) in err, err
