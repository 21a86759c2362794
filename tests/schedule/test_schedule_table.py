"""The table of schedule kinds drives what a schedule does; `build` and `costed_graph` are the
one way to make a lowered schedule and a model's CostGraph."""

from __future__ import annotations

import pytest
import torch

from pdcompile.cost.costed_graph import costed, costed_graph
from pdcompile.errors import ScheduleError
from pdcompile.schedule.build import build
from pdcompile.schedule.generators import copies_weights
from pdcompile.schedule.ir import Kind
from pdcompile.schedule.kinds import KINDS, kind, names, stream_length

# a placement each kind can run: interleaved kinds 4 chunks on 2 ranks (V-shaped ones in a V),
# the others 2 stages
PLACEMENTS = {name: [[0], [1], [1], [0]] if row.v_shape else [[0], [1], [0], [1]]
              if row.interleaved else [[0], [1]] for name, row in KINDS.items()}


def steps(schedule: object, rank: int) -> list[int]:
    """The positions of `rank`'s STEP actions."""
    actions = schedule.actions[rank]  # type: ignore[attr-defined]
    return [i for i, a in enumerate(actions) if a.kind == Kind.STEP]


@pytest.mark.parametrize("name", list(KINDS))
def test_the_run_has_the_length_the_kind_says(name: str) -> None:
    row = kind(name)
    run = row.run_length([1, 1], microbatches=4, minibatches=3)
    schedule = build(name, PLACEMENTS[name], run, per_minibatch=row.per_minibatch(4))
    assert schedule.microbatches == run
    assert run == {"end": 4, "minibatch": 12, "backward": 3}[row.updates_at]


@pytest.mark.parametrize("name", list(KINDS))
def test_updates_go_where_the_kind_says(name: str) -> None:
    row = kind(name)
    run = row.run_length([1, 1], microbatches=4, minibatches=3)
    schedule = build(name, PLACEMENTS[name], run, per_minibatch=row.per_minibatch(4))
    for rank in schedule.ranks:
        actions = schedule.actions[rank]
        stages = schedule.stages_of_rank(rank)
        backwards = [i for i, a in enumerate(actions) if a.kind == Kind.B]
        found = steps(schedule, rank)
        if row.updates_at == "end":  # one per stage the rank holds, after all its work
            assert len(found) == len(stages) and min(found) > max(backwards)
        elif row.updates_at == "backward":  # one after every backward, before the next one
            assert len(found) == len(backwards)
            assert all(b < f for b, f in zip(backwards, found, strict=True))
            assert all(f < b for f, b in zip(found, backwards[1:], strict=False))
        else:  # one per minibatch
            assert len(found) == 3


def test_a_stream_of_whole_minibatches_rounds_up_to_the_replicas() -> None:
    assert stream_length([2, 3], 7) == 12
    assert kind("1f1b").run_length([2, 3], microbatches=8, minibatches=7) == 12
    assert kind("2bw").run_length([2, 1], microbatches=2, minibatches=3) == 6
    assert kind("gpipe").run_length([2, 3], microbatches=5, minibatches=7) == 5


def test_loss_scale_and_minibatch_follow_the_cut() -> None:
    assert kind("1f1b").per_minibatch(8) == 1 and kind("1f1b").loss_scale(1) == 1.0
    for name in ("1f1b-flush", "gpipe", "2bw", "zb-h1"):
        assert kind(name).per_minibatch(8) == 8 and kind(name).loss_scale(8) == 1 / 8


def test_flags_name_the_schedules() -> None:
    assert names("flush") == tuple(n for n, r in KINDS.items() if not r.asynchronous)
    assert set(names("asynchronous")) == {"1f1b", "2bw"}
    assert set(names("interleaved")) == {"interleaved-1f1b", "interleaved-zb", "zb-v",
                                         "dualpipev"}
    assert set(names("v_shape")) == {"zb-v", "dualpipev"}
    assert set(names("split_backward")) == {"zb-h1", "interleaved-zb", "zb-v", "dualpipev"}
    assert names("double_buffered") == ("2bw",) and names("forwards_first") == ("gpipe",)


def test_only_copying_kinds_copy_weights() -> None:
    shape = [[0], [1], [2]]
    for name, row in KINDS.items():
        if row.chunked:
            continue
        copies = [copies_weights(name, shape, s) for s in range(3)]
        assert any(copies) == row.copies_weights, name
    # weight stashing copies where minibatches are in flight; two versions copy everywhere
    assert [copies_weights("1f1b", shape, s) for s in range(3)] == [True, True, False]
    assert all(copies_weights("2bw", shape, s) for s in range(3))


def test_an_unknown_schedule_is_named_with_the_known_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule '1f1c'.*1f1b-flush"):
        build("1f1c", [[0], [1]], 2)


def test_warmup_is_kept_only_where_the_kind_lets_it_be_chosen() -> None:
    chosen = build("1f1b-flush", [[0], [1]], 4, warmup=[0, 0])
    assert chosen.options["warmup"] == [0, 0]
    fixed = build("gpipe", [[0], [1]], 4, warmup=[0, 0])
    assert "warmup" not in fixed.options


def test_vertical_sync_only_where_the_kind_allows_it() -> None:
    assert build("1f1b", [[0], [1]], 4, vertical_sync=True).options["vertical_sync"] is True
    with pytest.raises(ScheduleError, match="vertical_sync"):
        build("2bw", [[0], [1]], 4, per_minibatch=2, vertical_sync=True)


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_costed_graph_traces_shapes_and_costs_a_model() -> None:
    graph = costed_graph(TwoLayers(), (torch.randn(2, 8),), cost="analytic", name="two")
    assert graph.graph["name"] == "two"
    linear = [n for n in graph.nodes if n in ("a", "b")]
    assert linear == ["a", "b"]
    assert all(graph.nodes[n]["fwd"] > 0 and graph.nodes[n]["params"] > 0 for n in linear)


def test_costed_copies_a_graph_module_and_keeps_the_random_state() -> None:
    gm = torch.fx.symbolic_trace(TwoLayers())
    inputs = (torch.randn(2, 8),)
    state = torch.random.get_rng_state()
    module, graph = costed(gm, inputs, cost="measured", repeats=1, warmup=0)
    assert torch.equal(state, torch.random.get_rng_state())
    assert module is not gm
    assert all("pd.cost" not in n.meta for n in gm.graph.nodes)
    assert all("pd.cost" in n.meta for n in module.graph.nodes if n.op == "call_module")
    assert graph.graph["name"] == "TwoLayers"  # fx names the GraphModule class after the root
