"""Busy neighbours for the cost pass: helper processes that really run, always stop, refuse bad
counts and unpicklable workloads; annotate_costs(neighbours=1) costs every node. No timing
assertions (the slowdown they cause depends on the machine)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from torch import nn

from pdcompile.cost.neighbours import TrainStep, busy_neighbours
from pdcompile.cost.node_costs import annotate_costs
from pdcompile.errors import PdcompileError
from pdcompile.meta import get_cost
from pdcompile.passes.trace import trace


class TouchFile:
    """A workload that leaves a trace: creates `path` (module level, so it pickles)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> None:
        self.path.touch()


class Fails:
    """A workload that cannot run."""

    def __call__(self) -> None:
        raise RuntimeError("this workload always fails")


def tiny() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_neighbours_run_inside_and_are_gone_after(tmp_path: Path) -> None:
    marks = tmp_path / "ran"
    with busy_neighbours(2, TouchFile(marks)) as neighbours:
        assert len(neighbours.processes) == 2
        assert all(p.is_alive() for p in neighbours.processes)
        assert len(set(neighbours.pids)) == 2
        assert marks.exists()  # each ran its workload at least once before the block
    assert not any(p.is_alive() for p in neighbours.processes)
    assert all(p.exitcode is not None for p in neighbours.processes)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_neighbours_stop_after_an_exception(tmp_path: Path) -> None:
    seen = []
    with pytest.raises(ValueError, match="inside"):
        with busy_neighbours(1, TouchFile(tmp_path / "ran")) as neighbours:
            seen = list(neighbours.processes)
            assert seen[0].is_alive()
            raise ValueError("raised inside the block")
    assert seen and not seen[0].is_alive() and seen[0].exitcode is not None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_train_step_runs_forward_and_backward_in_a_neighbour() -> None:
    model, x = tiny()
    with busy_neighbours(1, TrainStep(model, (x,))) as neighbours:
        assert neighbours.processes[0].is_alive()
    assert not neighbours.processes[0].is_alive()
    assert all(p.grad is None for p in model.parameters())  # the neighbour had its own copy


@pytest.mark.parametrize("count", [-1, 1.5, True, "2"])
def test_bad_count_is_refused(count: object) -> None:
    with pytest.raises(PdcompileError, match="whole number >= 0"):
        with busy_neighbours(count, TouchFile(Path("unused"))):  # type: ignore[arg-type]
            pass
    model, x = tiny()
    with pytest.raises(PdcompileError, match="whole number >= 0"):
        annotate_costs(trace(model), (x,), neighbours=count)  # type: ignore[arg-type]


def test_zero_neighbours_start_nothing() -> None:
    with busy_neighbours(0, None) as neighbours:
        assert neighbours.processes == ()


def test_neighbours_need_measured_costs() -> None:
    model, x = tiny()
    with pytest.raises(PdcompileError, match="measured costs only"):
        annotate_costs(trace(model), (x,), source="analytic", neighbours=1)


def test_unpicklable_model_is_refused_with_the_fix() -> None:
    class Local(nn.Module):  # defined in a function: pickle cannot import it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    before = multiprocessing.active_children()
    with pytest.raises(PdcompileError, match="module level"):
        with busy_neighbours(1, TrainStep(Local(), (torch.randn(4, 8),))):
            pass
    assert multiprocessing.active_children() == before


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_failing_workload_is_reported() -> None:
    with pytest.raises(PdcompileError, match="always fails"):
        with busy_neighbours(1, Fails()):
            pass
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_annotate_costs_with_one_neighbour_costs_every_node() -> None:
    model, x = tiny()
    gm = trace(model)
    annotate_costs(gm, (x,), neighbours=1, warmup=1, repeats=3)
    for node in gm.graph.nodes:
        cost = get_cost(node)
        assert cost.source == "measured"
        assert cost.fwd >= 0.0 and cost.bwd >= 0.0
    assert sum(get_cost(n).fwd for n in gm.graph.nodes) > 0.0
    assert get_cost(next(n for n in gm.graph.nodes if n.op == "call_module")).params > 0
    assert not multiprocessing.active_children()
    assert all(p.grad is None for p in gm.parameters())
