"""Lowering adds the transfers of every stage edge, replica all-reduces and optimizer steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcompile.errors import ScheduleError
from pdcompile.schedule.deps import dependencies, dependency_lists, execution_order
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Action, Kind
from pdcompile.schedule.lower import chain_edges, lower
from pdcompile.schedule.validate import validate


def texts(actions: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in actions]


def test_straight_two_stages_flush() -> None:
    lowered = lower(generate("1f1b-flush", [[0], [1]], 2))
    assert texts(lowered.actions[0]) == [
        "0F0", "0SEND_F0->1", "0F1", "0SEND_F1->1", "0RECV_B0<-1", "0B0", "0RECV_B1<-1", "0B1",
        "0STEP0"]
    assert texts(lowered.actions[1]) == [
        "1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0", "1RECV_F1<-0", "1F1", "1B1", "1SEND_B1->0",
        "1STEP0"]
    assert lowered.options["lowered"] is True
    assert lowered.options["stage_edges"] == [[0, 1]]


def test_skip_connection_jumps_a_stage() -> None:
    lowered = lower(generate("gpipe", [[0], [1], [2]], 1), [(0, 1), (1, 2), (0, 2)])
    assert texts(lowered.actions[0]) == ["0F0", "0SEND_F0->1", "0SEND_F0->2", "0RECV_B0<-1",
                                         "0RECV_B0<-2", "0B0", "0STEP0"]
    assert texts(lowered.actions[2]) == ["2RECV_F0<-0", "2RECV_F0<-1", "2F0", "2B0",
                                         "2SEND_B0->0", "2SEND_B0->1", "2STEP0"]
    validate(lowered)


def test_sends_go_to_the_replica_of_the_microbatch() -> None:
    lowered = lower(generate("1f1b", [[0], [1, 2]], 4))
    recv_ranks = {a.microbatch: r for r in (1, 2) for a in lowered.actions[r]
                  if a.kind == Kind.RECV_F}
    assert recv_ranks == {0: 1, 1: 2, 2: 1, 3: 2}
    deps = dependencies(lowered)
    for (rank, index), waits in deps.items():
        action = lowered.actions[rank][index]
        if action.kind == Kind.RECV_F:
            (src, at), = waits
            assert lowered.actions[src][at] == Action(0, Kind.SEND_F, action.microbatch, 1)


@pytest.mark.parametrize("name, steps", [("1f1b", [0, 1, 2, 3]), ("1f1b-flush", [0]),
                                         ("gpipe", [0])])
def test_updates_per_schedule(name: str, steps: list[int]) -> None:
    lowered = lower(generate(name, [[0], [1]], 4))
    for rank in (0, 1):
        assert [a.microbatch for a in lowered.actions[rank] if a.kind == Kind.STEP] == steps
        assert not any(a.kind == Kind.ALLREDUCE for a in lowered.actions[rank])


def test_1f1b_replicas_allreduce_each_round() -> None:
    lowered = lower(generate("1f1b", [[0, 1], [2]], 4))
    assert texts(lowered.actions[0])[-8:] == [
        "0RECV_B0<-1", "0B0", "0ALLREDUCE0", "0STEP0", "0RECV_B2<-1", "0B2", "0ALLREDUCE1",
        "0STEP1"]
    assert [str(a) for a in lowered.actions[2] if a.kind == Kind.STEP] == [
        "1STEP0", "1STEP1", "1STEP2", "1STEP3"]


def test_2bw_steps_after_each_minibatch() -> None:
    lowered = lower(generate("2bw", [[0, 1], [2]], 8, microbatches_per_minibatch=4))
    for rank in (0, 1):
        actions = texts(lowered.actions[rank])
        steps = [i for i, a in enumerate(actions) if "STEP" in a]
        assert [actions[i] for i in steps] == ["0STEP0", "0STEP1"]
        assert actions[steps[0] - 1] == "0ALLREDUCE0"
        last_b = [a for a in actions[: steps[0]] if "B" in a and "RECV" not in a
                  and "SEND" not in a]
        assert last_b[-1] in ("0B2", "0B3")
    validate(lowered)


def test_lower_rejects_bad_input() -> None:
    schedule = generate("1f1b", [[0], [1]], 2)
    with pytest.raises(ScheduleError, match=r"stage edge \(1, 0\)"):
        lower(schedule, [(1, 0)])
    with pytest.raises(ScheduleError, match=r"stage edge \(0, 5\)"):
        lower(schedule, [(0, 5)])
    with pytest.raises(ScheduleError, match="already lowered"):
        lower(lower(schedule))


def test_chain_edges() -> None:
    assert chain_edges(1) == []
    assert chain_edges(3) == [(0, 1), (1, 2)]


def test_execution_order_respects_dependencies() -> None:
    lowered = lower(generate("1f1b", [[0, 1], [2], [3]], 6))
    order = execution_order(lowered)
    position = {ref: i for i, ref in enumerate(order)}
    assert len(order) == sum(len(a) for a in lowered.actions.values())
    for ref, waits in dependencies(lowered).items():
        for dep in waits:
            assert position[dep] < position[ref]


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe"])
def test_transfers_are_the_compute_dependencies(name: str) -> None:
    """Lowering reads deps.dependency_lists: each receive before an action is one of its waits,
    each send after an action goes to a stage waiting on it, and nothing else is added."""
    edges = [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]
    compute = generate(name, [[0], [1, 2], [3], [4]], 4)
    lowered = lower(compute, edges)
    waits = dependency_lists(replace(compute, options={**compute.options,
                                                       "stage_edges": edges}))
    for rank, own in compute.actions.items():
        stage = compute.stage_of_rank(rank)
        expected: list[str] = []
        waited_by: dict[int, list[int]] = {}
        for other, per_rank in waits.items():
            for refs in per_rank:
                for r, i in refs:
                    if r == rank:
                        waited_by.setdefault(i, []).append(compute.stage_of_rank(other))
        for index, action in enumerate(own):
            recv = "RECV_F" if action.kind == Kind.F else "RECV_B"
            send = "SEND_F" if action.kind == Kind.F else "SEND_B"
            peers = sorted(compute.actions[r][i].stage for r, i in waits[rank][index])
            expected += [f"{stage}{recv}{action.microbatch}<-{p}" for p in peers]
            expected.append(str(action))
            expected += [f"{stage}{send}{action.microbatch}->{p}"
                         for p in sorted(waited_by.get(index, []))]
        got = [str(a) for a in lowered.actions[rank] if a.kind not in (Kind.STEP, Kind.ALLREDUCE)]
        assert got == expected
    validate(lowered)
