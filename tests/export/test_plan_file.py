"""An export's plan.json damaged, edited or swapped in from another export: the launcher's
worker count (`plan_workers`), `pdcompile run` and `pdcompile.load` refuse it in one line naming
plan.json, or use exactly the plan that was written. Before, `plan_workers` read plan.json
without its manifest (a damaged one gave another count or none, silently), and a plan edited
under a manifest written again loaded with its stages on ranks other than the rank code's."""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import PdcompileError
from pdcompile.export.integrity import seal_export
from pdcompile.export.plan_file import plan_digest, plan_workers
from tests.helpers.byte_damage import bounded, damage
from tests.helpers.random_models import explicit_graph, random_cut, random_models, squared_error
from tests.helpers.transparency import momentum


def _export(folder: Path, seed: int, sizes: tuple[int, ...]) -> Path:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    x, y = torch.randn(4, sizes[0]), torch.randn(4, sizes[-1])
    pipe = pdcompile.compile(nn.Sequential(*layers[:-1]), example_inputs=(x,),
                             example_target=y, loss_fn=nn.functional.mse_loss, stages=[1, 1],
                             microbatches=2, cost="analytic",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    pipe.export(str(folder))
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An export of a 2-layer MLP on 2 workers, and one of a 3-layer MLP (another model)."""
    root = tmp_path_factory.mktemp("plans")
    return (_export(root / "mine", 0, (6, 8, 3)), _export(root / "other", 1, (6, 8, 8, 3)))


def _copy(source: Path, folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    return folder


def _resealed(folder: Path) -> None:
    """The manifest written again over the folder as it is (someone else's export: unsigned)."""
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()


def _one_line(call: Callable[[], Any], folder: Path) -> str:
    with pytest.raises(PdcompileError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and str(folder / "plan.json") in message, message
    return message


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_plan_json_is_refused_or_changes_nothing(
        exports: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    """plan.json with bytes flipped, cut short, extended, or a number replaced (NaN, 1e999,
    2**70, true, ...), the manifest left as it was or written again over it: the launcher's
    worker count and the load (trust=True) refuse it in one line naming plan.json (no other
    exception, no hang), or give exactly the plan that was written. Before, plan_workers
    returned another count, or None, from a damaged file."""
    original = exports[0]
    written = pdcompile.load(str(original)).plan
    folder = _copy(original, tmp_path_factory.mktemp("damaged") / "out")
    done = damage(data, [folder / "plan.json"])
    resealed = data.draw(st.booleans(), label="manifest written again")
    if resealed:
        _resealed(folder)
    with bounded(60):
        try:
            workers = plan_workers(folder)
        except PdcompileError as err:
            assert "\n" not in str(err) and str(folder / "plan.json") in str(err), (done, err)
            _one_line(lambda: pdcompile.load(str(folder), trust=True), folder)
            return
        loaded = pdcompile.load(str(folder), trust=True).plan
    if not resealed:  # the manifest passes only the bytes that were written
        assert (folder / "plan.json").read_bytes() == (original / "plan.json").read_bytes()
    assert workers == loaded.workers, done
    assert [s.ranks for s in loaded.stages] == [s.ranks for s in written.stages], done


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path, Path], None]:
    def edit(folder: Path, other: Path) -> None:
        plan = json.loads((folder / "plan.json").read_text())
        change(plan)
        (folder / "plan.json").write_text(json.dumps(plan))
    return edit


def _swap_ranks(plan: dict[str, Any]) -> None:
    plan["stages"][0]["ranks"], plan["stages"][1]["ranks"] = [1], [0]


def _extra_replica(plan: dict[str, Any]) -> None:
    plan["stages"][1].update(replicas=2, ranks=[1, 2])
    plan["workers"] = 3


def _one_stage(plan: dict[str, Any]) -> None:
    plan["stages"] = [dict(plan["stages"][0], nodes=[n for s in plan["stages"]
                                                     for n in s["nodes"]])]
    plan["workers"] = 1


def _renamed_node(plan: dict[str, Any]) -> None:
    plan["stages"][1]["nodes"].append("not_a_node")


def _moved_node(plan: dict[str, Any]) -> None:
    """stage 0's last node moved to the front of stage 1: every name still one the graph has."""
    plan["stages"][1]["nodes"].insert(0, plan["stages"][0]["nodes"].pop())


def _deleted_node(plan: dict[str, Any]) -> None:
    """stage 0's last node left out of every stage (the other nodes where they were)."""
    plan["stages"][0]["nodes"].pop()


def _others(folder: Path, other: Path) -> None:
    shutil.copy(other / "plan.json", folder / "plan.json")


@pytest.mark.parametrize("edit, words", [
    (_edit(_swap_ranks), "its stages run on ranks [[1], [0]] where schedule.txt"),
    (_edit(_extra_replica), "its stages run on ranks [[0], [1, 2]] where schedule.txt"),
    (_edit(_one_stage), "it has 1 stages where pipeline.json has 2"),
    (_edit(_renamed_node), "names the node 'not_a_node', which the exported graph does not"),
    (_edit(_moved_node), "puts the node '_0' in stage 1 where the exported plan had it in "
                         "stage 0"),
    (_edit(_deleted_node), "leaves out the node '_0', which stage 0's code computes"),
    (_others, "names the node"),
    (_edit(lambda p: p["stages"][0].update(ranks=[5])), "rank 5"),
    (_edit(lambda p: p.update(workers=float("nan"))), "workers must be an integer"),
    (_edit(lambda p: p.update(workers="2")), "workers must be an integer"),
    (_edit(lambda p: p["stages"][0].update(compute=float("nan"))), "compute must be"),
    (_edit(lambda p: p.update(surplus=1)), "'surplus'"),
    (_edit(lambda p: p.update(stages={})), "stages"),
], ids=["ranks-swapped", "extra-replica", "one-stage", "unknown-node", "moved-node",
        "deleted-node", "other-models-plan",
        "rank-out-of-range", "nan-workers", "string-workers", "nan-compute", "extra-key",
        "stages-not-a-list"])
def test_a_plan_json_that_does_not_fit_the_export_is_refused_in_one_line(
        exports: tuple[Path, Path], tmp_path: Path, edit: Callable[[Path, Path], None],
        words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """plan.json edited (or another model's) under a manifest written again, loaded with
    trust=True: the launcher's count, `pdcompile run` and the load refuse it in one line naming
    plan.json and what is wrong. Before, swapped ranks and the other model's plan loaded (the
    stages on ranks the rank code does not run them on), a node moved to the next stage
    loaded (a partition other than the stage code's), so did a node deleted from the plan
    (a stage reported and priced without it), an extra replica loaded and
    deadlocked its first step, and plan_workers counted workers from any of them."""
    folder = _copy(exports[0], tmp_path / "out")
    edit(folder, exports[1])
    _resealed(folder)
    assert words in _one_line(lambda: plan_workers(folder), folder)
    assert words in _one_line(lambda: pdcompile.load(str(folder), trust=True), folder)
    assert main(["run", str(folder), "--trust", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


@st.composite
def _cut_models(draw: st.DrawFn) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """A random model (tests/helpers/random_models.py) and a random cut of it into 2-3 stages
    given as the plan: the split moves some of its nodes (a tuple's items, constants)."""
    model, inputs = draw(random_models(max_steps=6))
    graph = explicit_graph(copy.deepcopy(model), inputs)
    plan = random_cut(graph, random.Random(draw(st.integers(0, 2**32))),
                      stages=draw(st.integers(2, 3)), replicas=[1, 1, 1])
    return model, inputs, plan


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_cut_models(), data=st.data())
def test_a_plan_json_with_a_node_moved_or_deleted_is_refused_and_the_written_one_loads(
        case: tuple[nn.Module, tuple[torch.Tensor, ...], Any],
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Random models cut at random: the plan as written loads (also where the split ran some
    of its nodes in other stages than it names), and so does the loaded pipeline exported
    again (drawn: its graph rebuilt from graph.py, or none, as where graph.py could not be
    saved); the same plan.json (of either export) with one drawn node moved to another drawn
    stage, or deleted, under a manifest written again, is refused in one line naming plan.json
    and the node. Before, every such move loaded, and so did every deletion of a node the
    split had not moved; an export of a loaded pipeline without a graph recorded no nodes (its
    plan.json then went unchecked), and one whose graph was traced again under other names
    (`iadd` as `add_3`) was refused although nothing was changed."""
    model, inputs, plan = case
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                                 loss_fn=squared_error, plan=plan, schedule="1f1b-flush",
                                 microbatches=2, optimizer=momentum)
    except PdcompileError:
        reject()
    folder = tmp_path_factory.mktemp("cut") / "out"
    pipe.export(str(folder))
    kw: dict[str, Any] = {"trust": True, "loss_fn": squared_error, "optimizer": momentum}
    loaded = pdcompile.load(str(folder), **kw)
    assert loaded.plan.stage_of() == pipe.plan.stage_of()
    if data.draw(st.booleans(), label="exported again"):
        if data.draw(st.booleans(), label="without its graph"):
            loaded.graph = None
        again = tmp_path_factory.mktemp("again") / "out"
        try:
            loaded.export(str(again))
        except PdcompileError:  # a leaf module a loaded stage holds that cannot be recorded
            reject()
        written_meta = json.loads((folder / "pipeline.json").read_text())
        again_meta = json.loads((again / "pipeline.json").read_text())
        for key in ("graph_stages", "plan_moved", "plan_unnamed", "plan_gone"):
            assert again_meta[key] == written_meta[key], key
        assert pdcompile.load(str(again), **kw).plan.stage_of() == pipe.plan.stage_of()
        folder = again
    written = json.loads((folder / "plan.json").read_text())
    stages = written["stages"]
    node = data.draw(st.sampled_from(sorted(n for s in stages for n in s["nodes"])), label="node")
    source = next(i for i, s in enumerate(stages) if node in s["nodes"])
    stages[source]["nodes"].remove(node)
    if data.draw(st.booleans(), label="deleted"):
        words = f"leaves out the node {node!r}"
    else:
        target = data.draw(st.sampled_from([i for i in range(len(stages)) if i != source]),
                           label="to stage")
        stages[target]["nodes"].insert(data.draw(st.integers(0, len(stages[target]["nodes"]))),
                                       node)
        words = f"puts the node {node!r} in stage {target}"
    (folder / "plan.json").write_text(json.dumps(written))
    _resealed(folder)
    message = _one_line(lambda: pdcompile.load(str(folder), **kw), folder)
    assert words in message, message
    assert words in _one_line(lambda: plan_workers(folder), folder)


def test_a_plan_of_a_trillion_workers_is_refused_at_once(
        exports: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """workers 10**12 with the stages on ranks 0 and 1: `pdcompile run` names the idle ranks in
    one short line at once (before, it listed every idle rank: range(10**12), which never
    ended)."""
    folder = _copy(exports[0], tmp_path / "out")
    _edit(lambda p: p.update(workers=10**12))(folder, exports[1])
    # pipeline.json's digest of plan.json edited with it (a plan.json alone edited is refused)
    _set(folder / "pipeline.json", plan_sha256=plan_digest((folder / "plan.json").read_text()))
    _resealed(folder)
    assert plan_workers(folder) == 10**12
    with bounded(30):
        assert main(["run", str(folder), "--trust", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ranks [2, 3, 4, 5, 6, 7, 8, 9, ... (" in err, err
    assert len(err) < 1000


@pytest.mark.parametrize("edit", [
    lambda folder: (folder / "schedule.txt").write_text(
        (folder / "schedule.txt").read_text().replace("microbatches=2", "microbatches=1000000000",
                                                      1)),
    lambda folder: _set(folder / "pipeline.json", microbatches=3),
    lambda folder: _set(folder / "pipeline.json", schedule_length=10**9),
], ids=["schedule-claims-a-billion", "pipeline-microbatches", "pipeline-schedule-length"])
def test_a_run_shape_that_does_not_fit_the_rank_code_is_refused(
        exports: tuple[Path, Path], tmp_path: Path, edit: Callable[[Path], None]) -> None:
    """schedule.txt or pipeline.json edited so that the run the pipeline makes is not the one
    the rank files were generated for: refused in one line at load, before any schedule of
    the claimed size is built. Before, pipeline.json's microbatches=3 loaded and ran a run of
    3 microbatches beside rank code generated for 2."""
    folder = _copy(exports[0], tmp_path / "out")
    edit(folder)
    _resealed(folder)
    with bounded(30):
        message = _one_line(lambda: pdcompile.load(str(folder), trust=True), folder)
    assert "schedule.txt" in message


def _set(path: Path, **values: Any) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def test_the_written_plan_loads_and_counts_its_workers(exports: tuple[Path, Path]) -> None:
    """The plan as written: counted and loaded as it is, the schedule the rank code runs kept."""
    folder = exports[0]
    assert plan_workers(folder) == 2
    pipe = pdcompile.load(str(folder))
    assert pipe.plan.workers == 2 and pipe.stage_ranks == ((0,), (1,))
