"""compile()'s arguments as a user may get them wrong: each refused in one line that names the
argument and shows what to write, before any tracing where it can be (pdcompile/api.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PdcompileError, PipelineInputError, PlanError


def _compile(**options: Any) -> pdcompile.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 3))
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 8),),
                             example_target=torch.randint(0, 3, (8,)),
                             **{"loss_fn": nn.functional.cross_entropy, **options})


@pytest.mark.parametrize(("options", "message"), [
    ({"stages": 2.0}, r"stages=2\.0: give a stage count \(e\.g\. stages=2\)"),
    ({"stages": "2"}, r"stages='2': give a stage count"),  # was read as one stage of 2 replicas
    ({"stages": [1.5, 1]}, r"stages=\[1\.5, 1\]: give"),  # was cut to [1, 1]
    ({"stages": []}, r"stages=\[\]: give"),
    ({"plan": "4|4"}, r"plan='4\|4': give .* or a Plan"),
    ({"plan": [["_0"], ["_1"]]}, r"plan=\[\['_0'\], \['_1'\]\]: give"),
    ({"cluster": 3}, r"cluster must be a pdcompile\.Cluster or a cluster string .* not int 3"),
    # an optimizer made from the model's parameters, or names of functions: a raw TypeError
    # from inside the pipeline ('SGD' object is not callable), or the target blamed
    ({"stages": 2, "optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)},
     r"^optimizer must be a function, got an object of type SGD; e\.g\. optimizer=lambda "
     r"params: torch\.optim\.SGD\(params, lr=0\.1\)"),
    ({"stages": 2, "optimizer": "sgd"}, r"^optimizer must be a function, got 'sgd'"),
    ({"stages": 2, "loss_fn": "cross_entropy"},
     r"^loss_fn must be a function, got 'cross_entropy'; e\.g\. loss_fn=torch\.nn\.functional"),
    ({"stages": 2, "param_groups": {"weight_decay": 0.0}},
     r"^param_groups must be a function, got an object of type dict; e\.g\. param_groups="
     r"lambda name, p:"),
])
def test_arguments_of_the_wrong_kind_are_refused_by_name(options: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(PipelineInputError, match=message):
        _compile(**options)


@pytest.mark.parametrize(("options", "message"), [
    ({"stages": 6}, r"stages=6: the graph has 5 operations, too few for 6 stages; use at most 5"),
    ({"stages": 3, "schedule": "zb-v", "microbatches": 6},
     r"too few for 6 chunks \(3 workers with two each\); use at most 2"),
])
def test_more_stages_than_operations_says_how_many_fit(options: dict[str, Any],
                                                        message: str) -> None:
    """Was "no plan ... though it fits N GiB per worker; try schedule='auto'", which sent the
    user after the memory or the schedule."""
    with pytest.raises(PlanError, match=message):
        _compile(**options)
    chunked = "schedule" in options  # two chunks per worker
    fitting = {**options, "stages": 2 if chunked else 5}
    assert len(_compile(**fitting).plan.stages) == (4 if chunked else 5)


def test_a_bad_cluster_string_is_refused_before_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    def traced(*_: Any, **__: Any) -> None:
        raise AssertionError("traced before the cluster was read")

    monkeypatch.setattr("pdcompile.passes.frontend.capture", traced)
    with pytest.raises(PdcompileError, match="'4@fast'"):
        _compile(cluster="4@fast")


@pytest.mark.parametrize("cluster", ["local--1", "local-four", "local-2x"])
def test_a_local_cluster_without_a_count_is_refused(cluster: str) -> None:
    """Any `local-` name that was not local-N ran on local-2, silently."""
    with pytest.raises(PdcompileError, match=rf"cluster '{cluster}': give local-N with N a "
                                             r"whole number of processes"):
        _compile(cluster=cluster)


@pytest.mark.parametrize("limit", ["5", True])
def test_a_time_limit_that_is_no_number_is_refused_by_name(limit: object) -> None:
    """'5' failed inside the planner with "'>' not supported between 'str' and 'int'"."""
    with pytest.raises(PlanError, match=rf"^time_limit must be a number of seconds > 0 \(got "
                                        rf"{limit!r}\)$"):
        _compile(cluster="local-2", cost="analytic", time_limit=limit)


@pytest.mark.parametrize("call", ["schedule", "rank_sources"])
@pytest.mark.parametrize(("args", "name"), [
    ((0,), "microbatches"), ((-2,), "microbatches"), ((2.5,), "microbatches"),
    (("3",), "microbatches"), ((True,), "microbatches"), ((4, 0), "per_minibatch"),
    ((4, 1.5), "per_minibatch"),
])
def test_a_run_shape_that_is_no_count_is_refused(call: str, args: tuple[Any, ...],
                                                 name: str) -> None:
    """pipe.schedule(0) built the compiled run's schedule, silently; '3' raised a raw
    TypeError, per_minibatch=1.5 built a schedule."""
    pipe = _compile(stages=2, schedule="1f1b-flush", microbatches=4)
    value = args[-1]
    with pytest.raises(PipelineInputError, match=rf"^{call}\({name}={re.escape(repr(value))}\): "
                                                 r"give a whole number of microbatches >= 1, "
                                                 r"or leave it out for the compiled run's \(4\)$"):
        getattr(pipe, call)(*args)
    assert getattr(pipe, call)() == getattr(pipe, call)(4, 4)  # the compiled run, as before


@pytest.mark.parametrize("path", [123, None, b"out", ["out"], ""])
def test_export_and_load_refuse_what_names_no_folder(path: object, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """os's TypeError ('expected str, bytes or os.PathLike object, not int') came out of both;
    an empty string named the current folder."""
    monkeypatch.chdir(tmp_path)
    pipe = _compile(stages=2, schedule="1f1b-flush")
    with pytest.raises(PipelineInputError, match=rf"^pipe\.export\({re.escape(repr(path))}\): "
                                                 r"give the export folder as a string or a "
                                                 r"pathlib\.Path, e\.g\. pipe\.export\("):
        pipe.export(path)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
    with pytest.raises(PipelineInputError, match=rf"^pdcompile\.load\({re.escape(repr(path))}\)"
                                                 r": give the export folder as a string"):
        pdcompile.load(path)  # type: ignore[arg-type]


@pytest.mark.parametrize(("options", "message"), [
    ({"trust": "no"}, r"^pdcompile\.load\(trust='no'\): give True or False$"),
    ({"loss_fn": "cross_entropy"}, r"^loss_fn must be a function, got 'cross_entropy'"),
])
def test_load_refuses_options_of_the_wrong_kind(options: dict[str, Any], message: str,
                                                tmp_path: Path) -> None:
    """trust='no' is a true value: it trusted the export."""
    _compile(stages=2, schedule="1f1b-flush").export(tmp_path / "e")
    with pytest.raises(PipelineInputError, match=message):
        pdcompile.load(tmp_path / "e", **options)
    assert pdcompile.load(tmp_path / "e", trust=False).plan.workers == 2


def test_an_order_in_rounds_names_the_microbatch_counts_it_takes() -> None:
    """zb-h1 and the interleaved orders take microbatches in rounds of one per worker; 3 on 2
    workers said only 'try schedule='auto' or another microbatch count'."""
    with pytest.raises(PlanError, match=r"\('zb-h1' takes microbatches in rounds of one per "
                                        r"worker: give a multiple of 2, e\.g\. microbatches=4, "
                                        r"or fewer than 2\)"):
        _compile(stages=2, schedule="zb-h1", microbatches=3)
    assert _compile(stages=2, schedule="zb-h1", microbatches=4).microbatches == 4
