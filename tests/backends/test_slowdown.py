"""An emulated slower device: each rank's compute stretched by its factor (runtime/slowdown.py),
applied by the local backend and checked before any worker starts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdcompile.backends.local import run_program
from pdcompile.errors import ClusterError, PipelineInputError
from pdcompile.machine.cluster import Cluster
from pdcompile.runtime import slowdown
from pdcompile.runtime.slowdown import check_slowdowns, stretch
from tests.helpers.small_pipes import small_data as _data
from tests.helpers.small_pipes import small_model as _model
from tests.helpers.small_pipes import small_pipe as _pipe


def test_stretch_waits_factor_minus_one_times_what_the_action_took(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(slowdown.time, "time", lambda: 101.5)
    monkeypatch.setattr(slowdown.time, "sleep", waits.append)
    stretch(100.0, 3.0)
    stretch(100.0, 1.0)  # full speed: no wait
    assert waits == [pytest.approx(3.0)]


@pytest.mark.parametrize(("value", "words"), [
    ("1,x", ["'1,x'", "one number per rank"]),
    ([1.0], ["1 factors for 2 ranks"]),
    ([1.0, 0.5], ["0.5", ">= 1", "cannot be sped up"]),
    ([1.0, float("nan")], ["nan", ">= 1"]),
])
def test_bad_slowdowns_name_the_culprit(value: Any, words: list[str]) -> None:
    with pytest.raises(PipelineInputError) as err:
        check_slowdowns(value, 2)
    for word in words:
        assert word in str(err.value)


def test_slowdowns_read_from_text_and_all_ones_are_none() -> None:
    assert check_slowdowns("1,2.5", 2) == (1.0, 2.5)
    assert check_slowdowns([1, 1], 2) == ()
    assert check_slowdowns(None, 2) == ()


def test_the_local_backend_stretches_only_the_slowed_ranks_compute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(slowdown.time, "sleep", waits.append)
    model = _model()
    batches = _data(4)
    plain = _pipe(copy.deepcopy(model), plan=2, schedule="1f1b-flush", microbatches=2)
    slowed = _pipe(copy.deepcopy(model), plan=2, schedule="1f1b-flush", microbatches=2)
    expected = plain.train(batches)
    program = slowed.program().with_slowdowns("1,3")
    assert program.run_config(2).slowdown_of(1) == 3.0
    assert program.run_config(2).slowdown_of(0) == 1.0
    got: list[float] = []
    for i, item in enumerate(batches):
        run = program.prepare([item], first=i)
        got.extend(run.minibatch_losses(run_program(program, run.data, run.microbatches,
                                                    run.per_minibatch).losses))
    assert got == pytest.approx(expected, rel=1e-6)  # the same training, only slower
    # rank 1's forward, backward and (after it sends the input gradients) weight gradients of
    # 2 microbatches in each of 4 minibatches, nothing else
    assert len(waits) == 4 * 2 * 3 and all(w >= 0 for w in waits)
    with pytest.raises(PipelineInputError, match="3 factors for 2 ranks"):
        run_program(program, run.data, run.microbatches, run.per_minibatch, slowdown=[1, 2, 3])


def test_the_cluster_predicting_an_emulated_run() -> None:
    cluster = Cluster.parse("3@1e9:cpu")
    slowed = cluster.with_slowdowns([1, 2, 2])
    assert [slowed.speed_of(r) for r in range(3)] == [1.0, 0.5, 0.5]
    assert [g.workers for g in slowed.groups] == [1, 2] and slowed.is_mixed
    assert not cluster.with_slowdowns([1, 1, 1]).is_mixed
    with pytest.raises(ClusterError, match="one factor > 0 for each of the 3"):
        cluster.with_slowdowns([1, 2])


def test_the_run_command_passes_a_checked_slowdown_to_the_workers(tmp_path: Any) -> None:
    import argparse

    from pdcompile.cli.run_cmd import register, torchrun_command

    pipe = _pipe(_model(), plan=2, schedule="1f1b-flush", microbatches=2)
    pipe.train(_data(1))
    pipe.export(tmp_path / "exp")

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["run", str(tmp_path / "exp"), "--slowdown", "1,2"])
    cmd = torchrun_command(args)
    assert cmd[cmd.index("--slowdown") + 1] == "1,2"
    bad = parser.parse_args(["run", str(tmp_path / "exp"), "--slowdown", "1,2,3"])
    with pytest.raises(PipelineInputError, match="3 factors for 2 ranks"):
        torchrun_command(bad)
