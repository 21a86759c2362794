"""Plan files (`--plan PLAN.json` of `pdcompile export` and `simulate`) nobody here wrote:
truncated, not text, nested past the parser's depth, another shape, or a good plan with a
field dropped or changed. Each gives a Plan or one PlanError; the command line names the file
and how to write a good one in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.cli import main
from pdcompile.errors import PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.schedule.kinds import KINDS
from tests.helpers.byte_damage import bounded

_STAGE = {"nodes": ["input_1", "_0"], "replicas": 1, "ranks": [0], "compute": 0.001,
          "sync": 0.0, "comm": 0.0, "memory": 1e6, "time": 0.001, "copies": 0.0,
          "in_flight": 1, "recompute": False}
_GOOD = {"format": "pdcompile.plan/1",
         "stages": [_STAGE, {**_STAGE, "nodes": ["_1", "_2"], "ranks": [1]}],
         "time_per_minibatch": 0.002, "dp_time": 0.003, "workers": 2, "cost_model": "native",
         "planner": "manual", "status": "GIVEN", "bound": None, "solve_seconds": 0.0,
         "cluster": None, "extra": {}}

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats()
                     | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def test_the_good_plan_reads() -> None:
    plan = Plan.from_json(json.dumps(_GOOD))
    assert plan.workers == 2 and [s.ranks for s in plan.stages] == [(0,), (1,)]


# values a hand-edited plan file holds where a number, list or name was: a rank of -1, the
# string "0", the float 1.0, a bool, duplicates, ranks beyond the workers, 10**12, other shapes
_ODD = st.sampled_from([-1, 0, 1, 2, 3, 10**12, "0", "1f1b", "gpipe", "x", 1.0, 0.5, -0.5,
                        float("nan"), float("inf"), True, False, None, [], {}, [0], [1], [2],
                        [-1], ["0"], [1.0], [True], [0, 0], [0, 1], [1, 0], [10**12],
                        ["_1"], ["input_1"], [[0]], {"fits": 1},
                        {"closed_form_time_per_minibatch": "x"}])
# keys a plan or a stage may lack (defaults) and one that no plan has
_ABSENT = ["shares", "schedule", "microbatches", "in_flight", "recompute", "evil"]


def _assert_runnable(plan: Plan) -> None:
    """What the runtime takes for granted of a loaded plan, checked here independently of
    Plan's own checks: integer ranks among the workers (0 to workers - 1), replicas on ranks
    of their own, a known schedule, a plan that reads back equal."""
    ranks = [r for s in plan.stages for r in s.ranks]
    assert all(type(r) is int for r in ranks), ranks
    assert all(0 <= r < plan.workers for r in ranks), (ranks, plan.workers)
    for s in plan.stages:
        assert type(s.replicas) is int and s.replicas == len(s.ranks) == len(set(s.ranks))
        assert type(s.in_flight) is int and s.in_flight >= 0 and type(s.recompute) is bool
        assert all(type(n) is int and n >= 1 for n in s.shares)
        assert all(isinstance(n, str) for n in s.nodes)
    assert plan.schedule in KINDS and type(plan.microbatches) is int and plan.microbatches >= 1
    assert Plan.from_json(plan.to_json()) == plan
    plan.summary()  # every field the summary shows is of its type


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_plan_with_a_field_dropped_or_changed_reads_whole_or_names_the_field(
        data: st.DataObject) -> None:
    plan: dict[str, Any] = copy.deepcopy(_GOOD)
    target: dict[str, Any] = plan
    where = "the plan"
    if data.draw(st.booleans(), label="in a stage"):
        index = data.draw(st.integers(0, 1), label="stage")
        target, where = plan["stages"][index], f"stage {index}"
    key = data.draw(st.sampled_from(sorted(target) + _ABSENT), label="key")
    if data.draw(st.booleans(), label="drop"):
        target.pop(key, None)
    else:
        target[key] = data.draw(_ODD | _JSON, label="value")
    try:
        loaded = Plan.from_json(json.dumps(plan))
    except PlanError as err:
        message = str(err)
        assert "\n" not in message and key in message, (key, message)
    else:
        _assert_runnable(loaded)


@pytest.mark.parametrize(("stage", "field", "value", "named"), [
    (0, "ranks", [-1], "ranks"), (0, "ranks", ["0"], "ranks"), (1, "ranks", [1.0], "ranks"),
    (1, "ranks", [True], "ranks"), (1, "ranks", [2], "ranks"), (None, "workers", 1, "workers"),
    (None, "workers", "2", "workers"),
    (0, "replicas", None, "replicas"), (0, "wrong", 1, "wrong"),
    (0, "in_flight", True, "in_flight"), (None, "schedule", "1f1f", "schedule"),
    (None, "extra", [], "extra"), (0, "nodes", "input_1", "nodes")],
    ids=["rank-minus-one", "rank-string", "rank-float", "rank-bool", "rank-beyond",
         "too-few-workers", "workers-a-string", "missing-key", "extra-key",
         "bool-in-flight", "schedule-typo", "extra-not-object", "nodes-a-string"])
def test_simulate_refuses_a_bad_field_at_load_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: int | None, field: str,
        value: Any, named: str) -> None:
    plan: dict[str, Any] = copy.deepcopy(_GOOD)
    target = plan if stage is None else plan["stages"][stage]
    if value is None:
        del target[field]
    else:
        target[field] = value
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(plan))
    assert main(["simulate", "pdcompile.models.demomlp:factory", "--plan", str(file),
                 "--cluster", "2@10GB/s:v100"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(file) in err and named in err, err


@pytest.mark.parametrize("stages", [
    [(("a",), 1, ("0",))], [(("a",), 1, (-1,))], [(("a",), 1, (True,))],
    [(("a",), 2, (0, 0))]],
    ids=["rank-string", "rank-negative", "rank-bool", "replicas-on-one-rank"])
def test_a_plan_made_in_code_with_ranks_no_run_can_take_is_refused_when_made(
        stages: list[tuple[Any, ...]]) -> None:
    # compile(plan=...) takes such a Plan as it is: ranks ("0",) used to compile and price
    with pytest.raises(PlanError, match="rank"):
        built = tuple(Stage(*s) for s in stages)
        Plan(stages=built, time_per_minibatch=0.0, dp_time=0.0,
             workers=1 + max(r for s in stages for r in s[2] if isinstance(r, int)))


@pytest.mark.parametrize("content", [
    b'{"format": "pdcompile.plan/1", "stages": [', b"\xff\xfe\x00", b"[" * 100_000,
    b"[1, 2]", b'"a plan"', json.dumps({**_GOOD, "evil": 1}).encode(),
    json.dumps({**_GOOD, "stages": [1, 2]}).encode()],
    ids=["truncated", "not-text", "nested", "a-list", "a-string", "unknown-field",
         "stages-not-objects"])
def test_a_bad_plan_file_is_one_line_naming_it(tmp_path: Path, content: bytes,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "plan.json"
    file.write_bytes(content)
    assert main(["simulate", "pdcompile.models.demomlp:factory", "--plan", str(file),
                 "--cluster", "2@10GB/s:v100"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(file) in err and "pdcompile plan MODEL --json" in err


def test_a_plan_file_over_any_json_file_is_refused_unread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file one byte over any JSON file pdcompile writes (sparse): refused in one line
    naming it, the limit and the fix, before a byte is read. Before, it was read whole into
    memory (and decoded) before its JSON was refused."""
    from pdcompile.util.manifest import MAX_JSON_BYTES
    from tests.helpers.byte_damage import bounded

    file = tmp_path / "plan.json"
    with open(file, "wb") as handle:
        handle.truncate(MAX_JSON_BYTES + 1)
    with bounded(10):
        code = main(["simulate", "pdcompile.models.demomlp:factory", "--plan", str(file),
                     "--cluster", "2@10GB/s:v100"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and str(file) in err, err
    assert f"({MAX_JSON_BYTES:,})" in err and "pdcompile plan MODEL --json" in err, err


def test_a_plan_file_with_idle_workers_beyond_count_exports_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A planned plan for demomlp with workers raised to 10**12 (its stages stay on ranks 0 and
    1; a plan may leave workers idle): `pdcompile export` used to build a '1f1b' stream of twice
    the workers, 2 * 10**12 microbatches (a MemoryError traceback; 10**6 workers ran for
    minutes). The stream follows the ranks that hold a stage."""
    planned = tmp_path / "planned"
    assert main(["export", "pdcompile.models.demomlp:factory", "--cluster", "local-2",
                 "--schedule", "1f1b", "--out", str(planned)]) == 0
    plan = json.loads((planned / "plan.json").read_text())
    plan["workers"] = 10**12
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(plan))
    capsys.readouterr()
    with bounded(60):
        assert main(["export", "pdcompile.models.demomlp:factory", "--plan", str(file),
                     "--out", str(tmp_path / "out"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["workers"] == 10**12
    held = {r for s in printed["plan"]["stages"] for r in s["ranks"]}
    assert held == {0, 1}
    assert "microbatches=4 " in (tmp_path / "out" / "schedule.txt").read_text()
