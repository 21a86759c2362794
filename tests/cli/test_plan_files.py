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
from pdcompile.plan import Plan

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


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_plan_with_a_field_dropped_or_changed_reads_or_is_a_plan_error(
        data: st.DataObject) -> None:
    plan: dict[str, Any] = copy.deepcopy(_GOOD)
    target: dict[str, Any] = plan
    if data.draw(st.booleans(), label="in a stage"):
        target = plan["stages"][data.draw(st.integers(0, 1), label="stage")]
    key = data.draw(st.sampled_from(sorted(target)), label="key")
    if data.draw(st.booleans(), label="drop"):
        del target[key]
    else:
        target[key] = data.draw(_JSON, label="value")
    try:
        Plan.from_json(json.dumps(plan))
    except PlanError:
        pass


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
