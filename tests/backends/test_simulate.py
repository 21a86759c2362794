"""The simulator against pipeline theory, transfers, all-reduce, memory, and timelines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import networkx as nx
import pytest

from pdcompile.backends.simulate import simulate
from pdcompile.cli import main
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PlanError, ScheduleError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.plan import Plan, Stage
from pdcompile.schedule.generators import (
    copies_weights,
    generate,
    latency_aware_warmup,
    updates_in_flight,
    warmup_depth,
)
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.lower import lower
from pdcompile.schedule.validate import validate
from pdcompile.timeline import Event, Recorder, Timeline, TimelineError
from tests.helpers.graphs import saved_chain

FREE = Cluster.flat(64, 1e30)  # free communication: infinite-ish bandwidth, no latency
F, B = 1.0, 2.0


def straight(p: int) -> list[list[int]]:
    return [[s] for s in range(p)]


def ranks_of(replicas: list[int]) -> list[list[int]]:
    out, first = [], 0
    for r in replicas:
        out.append(list(range(first, first + r)))
        first += r
    return out


# ------------------------------------------------------------------ theory
@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("f, b", [(F, B), (0.3, 0.3), (2.0, 0.5)])
def test_flush_makespan_and_bubble(name: str, p: int, m: int, f: float, b: float) -> None:
    result = simulate(lower(generate(name, straight(p), m)), StageCosts.uniform(p, fwd=f, bwd=b),
                      FREE)
    # stages 1 .. p - 1 send their input gradients before their weight gradients (half the
    # backward, the default `wgrad_share`): each hop of the drain is that much shorter
    w = b / 2
    assert result.makespan == pytest.approx((m + p - 1) * (f + b) - (p - 1) * w)
    assert result.bubble == pytest.approx((p - 1) * (f + b - w) / result.makespan)
    assert result.time_per_minibatch == pytest.approx(result.makespan)
    whole = simulate(lower(generate(name, straight(p), m)), StageCosts.uniform(p, fwd=f, bwd=b),
                     FREE, wgrad_share=0.0)  # every backward one block before its send
    assert whole.makespan == pytest.approx((m + p - 1) * (f + b))
    assert whole.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("replicas", [[1, 1], [1, 1, 1, 1], [2, 1], [3, 2, 1], [1, 2], [2, 2, 2]])
def test_flush_with_replicas_matches_theory_per_replica(replicas: list[int]) -> None:
    # each stage costs r_s times more, so every replica has the same load per microbatch
    p, m = len(replicas), 12
    costs = StageCosts(tuple(F * r for r in replicas), tuple(B * r for r in replicas))
    result = simulate(lower(generate("gpipe", ranks_of(replicas), m)), costs, FREE)
    # (the input gradients of stages 1 .. p - 1 leave before their weight gradients, B / 2)
    assert result.makespan >= (m + p - 1) * (F + B) - (p - 1) * B / 2 - 1e-9
    per_replica_work = m * (F + B)  # every replica does m / r_s microbatches at r_s times the cost
    assert result.bubble == pytest.approx(1 - per_replica_work / result.makespan)


@pytest.mark.parametrize("replicas", [[1], [1, 1], [1, 1, 1, 1], [1] * 8, [2, 1], [3, 1],
                                      [2, 2, 1], [2, 2, 2, 2]])
def test_async_1f1b_reaches_zero_bubble(replicas: list[int]) -> None:
    n = 8 * sum(replicas) * math.lcm(*replicas)  # long enough for a steady state
    costs = StageCosts(tuple(F * r for r in replicas), tuple(B * r for r in replicas))
    result = simulate(lower(generate("1f1b", ranks_of(replicas), n)), costs, FREE)
    assert result.steady_bubble == pytest.approx(0.0, abs=1e-9)
    assert result.time_per_minibatch == pytest.approx(F + B)
    assert (result.bubble > 0) == (len(replicas) > 1)  # warm-up and drain are not free


def test_round_synchronous_allreduce_couples_replicas_fed_one_after_another() -> None:
    # Found with this simulator: a replicated stage fed by a single worker gets its inputs one
    # after the other, but its replicas all-reduce after every round, so they wait for each
    # other; PipeDream's warm-up depth (NOAM) leaves no slack to hide it. Not zero bubble.
    replicas = [1, 2, 1]
    costs = StageCosts(tuple(F * r for r in replicas), tuple(B * r for r in replicas))
    result = simulate(lower(generate("1f1b", ranks_of(replicas), 48)), costs, FREE)
    assert result.steady_bubble > 0.1
    assert result.time_per_minibatch > F + B


def test_2bw_time_per_minibatch_counts_its_microbatches() -> None:
    result = simulate(lower(generate("2bw", straight(3), 48, microbatches_per_minibatch=4)),
                      StageCosts.uniform(3, fwd=F, bwd=B), FREE)
    assert result.steady_bubble == pytest.approx(0.0, abs=1e-9)
    assert result.time_per_minibatch == pytest.approx(4 * (F + B))


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush"])
@pytest.mark.parametrize("replicas", [[1, 1, 1, 1], [2, 1], [2, 2, 1], [1, 3]])
def test_peak_in_flight_follows_warmup(name: str, replicas: list[int]) -> None:
    ranks = ranks_of(replicas)
    n = 12
    result = simulate(lower(generate(name, ranks, n)), StageCosts.uniform(len(ranks), fwd=F, bwd=B,
                                                                         activations=10.0), FREE)
    for stage, stage_ranks in enumerate(ranks):
        for rank in stage_ranks:
            expected = min(warmup_depth(ranks, stage) + 1, n // len(stage_ranks))
            assert result.memory[rank].in_flight == expected
            assert result.memory[rank].activations == 10.0 * expected
    # and in time: counting F starts and B ends on the simulated timeline gives the same peak
    for rank, events in result.timeline.by_rank().items():
        live = peak = 0
        for event in events:
            kind = event.parsed().kind
            live += {Kind.F: 1, Kind.B: -1}.get(kind, 0)
            peak = max(peak, live)
        assert peak == result.memory[rank].in_flight


def test_weight_versions_per_schedule() -> None:
    costs = StageCosts.uniform(2, fwd=F, bwd=B, params=100.0)
    async_ = simulate(lower(generate("1f1b", straight(2), 8)), costs, FREE)
    assert async_.memory[0].stashed == 100.0  # 2 in flight at stage 0: one stashed version
    assert async_.memory[1].stashed == 0.0
    flush = simulate(lower(generate("1f1b-flush", straight(2), 8)), costs, FREE)
    assert flush.memory[0].stashed == 0.0
    two_bw = simulate(lower(generate("2bw", straight(2), 8, microbatches_per_minibatch=4)), costs,
                      FREE)
    assert two_bw.memory[0].stashed == 100.0
    # weights, gradients and Adam's two moments (the default optimizer state), no stash
    assert flush.memory[0].optimizer == 200.0
    assert flush.memory[0].total == 400.0 + flush.memory[0].activations
    sgd = StageCosts.uniform(2, fwd=F, bwd=B, params=100.0, optimizer_state=0.0)
    assert simulate(lower(generate("1f1b-flush", straight(2), 8)), sgd, FREE).memory[0].total \
        == 200.0 + flush.memory[0].activations


# ------------------------------------------------------------------ communication
def test_transfer_uses_bandwidth_and_latency_of_the_link_level() -> None:
    # 2 servers x 2 workers: ranks 0,1 share a server (fast), rank 2 is on the other (slow)
    cluster = Cluster(levels=(Level(2, 100.0, 0.5), Level(2, 10.0, 1.0)))
    costs = StageCosts((1.0, 1.0, 1.0), (1.0, 1.0, 1.0), edges={(0, 1): 100.0, (1, 2): 100.0},
                       optimizer=(0.0, 0.0, 0.0))
    result = simulate(lower(generate("gpipe", straight(3), 1)), costs, cluster)
    events = {e.action: e for e in result.timeline.events}
    # 0 -> 1 inside a server: 100 B at 100 B/s + 0.5 s latency
    assert events["1RECV_F0<-0"].end == pytest.approx(1.0 + 1.0 + 0.5)
    assert events["1F0"].start == pytest.approx(2.5)
    # 1 -> 2 across servers: 100 B at 10 B/s + 1 s
    assert events["2F0"].start == pytest.approx(3.5 + 10.0 + 1.0)
    # the gradient goes back the same way, sent once its input-gradient half is done (the
    # weight gradients follow the send; the recorded backward spans them)
    sent = events["2SEND_B0->1"]
    assert sent.start == pytest.approx(events["2B0"].start + 0.5)
    assert events["2B0"].end == pytest.approx(events["2B0"].start + 1.0)
    assert events["1B0"].start == pytest.approx(sent.start + 11.0)


def test_transfers_on_one_link_queue() -> None:
    cluster = Cluster.flat(2, 1.0)
    costs = StageCosts((0.0, 0.0), (0.0, 0.0), edges={(0, 1): 5.0}, optimizer=(0.0, 0.0))
    result = simulate(lower(generate("gpipe", straight(2), 3)), costs, cluster)
    starts = [e.start for e in result.timeline.events if e.action.startswith("1F")]
    assert starts == pytest.approx([5.0, 10.0, 15.0])


def test_ring_allreduce_and_optimizer_step() -> None:
    cluster = Cluster.flat(4, 10.0)
    costs = StageCosts((1.0,), (1.0,), params=(30.0,), optimizer=(0.5,))
    result = simulate(lower(generate("1f1b-flush", [[0, 1, 2]], 3)), costs, cluster)
    events = [e for e in result.timeline.events if "ALLREDUCE" in e.action]
    assert len(events) == 3
    for event in events:  # ring: 2 (r-1)/r * P / bw = 2 * 2/3 * 30 / 10 = 4 s, all together
        assert (event.start, event.end) == pytest.approx((2.0, 6.0))
    assert result.makespan == pytest.approx(6.5)


def test_weight_stashing_copies_cost_time_in_async_1f1b() -> None:
    # two stages: stage 0 keeps two minibatches in flight, so the first F after each of its
    # steps snapshots the weights (+0.25); the last stage runs each F right before its B and
    # updates after it, so it uses the live weights and never copies
    costs = StageCosts((1.0, 1.0), (2.0, 2.0), params=(1e6, 1e6), optimizer=(0.5, 0.5),
                       stash=(0.25, 0.25))
    schedule = lower(generate("1f1b", [[0], [1]], 8))
    result = simulate(schedule, costs, FREE)
    forwards = {rank: [e.duration for e in result.timeline.events
                       if e.rank == rank and e.parsed().kind == Kind.F] for rank in (0, 1)}
    assert forwards[1] == pytest.approx([1.0] * 8)
    assert forwards[0][0] == pytest.approx(1.25)  # version 0, then one per update
    assert sorted(set(round(d, 6) for d in forwards[0])) == [1.0, 1.25]
    # steady state: stage 0 is the bottleneck, F + copy + B + step = 3.75 per minibatch
    assert result.time_per_minibatch == pytest.approx(3.75)
    assert simulate(schedule, costs, FREE, stash=False).time_per_minibatch == pytest.approx(3.5)
    flush = lower(generate("1f1b-flush", [[0]], 4))  # one update per minibatch: no stash
    one = StageCosts((1.0,), (2.0,), params=(1e6,), optimizer=(0.5,), stash=(0.25,))
    assert simulate(flush, one, FREE).makespan == pytest.approx(4 * 3.0 + 0.5)
    # by default: a read and a write of the weights at the device's memory bandwidth
    default = StageCosts((1.0, 1.0), (2.0, 2.0), params=(1e6, 1e6), optimizer=(0.0, 0.0))
    copy = 2e6 / FREE.device.mem_bandwidth
    assert simulate(schedule, default, FREE).time_per_minibatch == pytest.approx(3.0 + copy)


@pytest.mark.parametrize("shape", [[[0], [1]], [[0], [1], [2], [3]], [[0, 1], [2]],
                                   [[0], [1, 2]], [[0, 1], [2], [3, 4, 5]], [[0]]])
def test_copy_rule_agrees_with_the_schedule(shape: list[list[int]]) -> None:
    """The runtime decides from the stage's position (copies_weights), the simulator from the
    actions (updates_in_flight): the same ranks copy."""
    schedule = lower(generate("1f1b", shape, 12))
    for stage, ranks in enumerate(shape):
        for rank in ranks:
            assert updates_in_flight(schedule.actions[rank]) == copies_weights(
                "1f1b", shape, stage)
    assert copies_weights("1f1b", shape, len(shape) - 1, vertical_sync=True)
    assert not copies_weights("1f1b-flush", shape, 0)


def test_simulate_rejects_bad_input() -> None:
    costs = StageCosts.uniform(2, fwd=F, bwd=B)
    with pytest.raises(ScheduleError, match="lowered"):
        simulate(generate("gpipe", straight(2), 2), costs, FREE)
    with pytest.raises(ScheduleError, match="3 stages"):
        simulate(lower(generate("gpipe", straight(3), 2)), costs, FREE)
    with pytest.raises(ScheduleError, match="larger cluster"):
        simulate(lower(generate("gpipe", [[0], [5]], 2)), costs, Cluster.flat(2, 1e9))


def test_simulated_timeline_has_one_event_per_action() -> None:
    schedule = lower(generate("1f1b", [[0, 1], [2], [3]], 8))
    result = simulate(schedule, StageCosts.uniform(3, fwd=F, bwd=B), FREE)
    for rank, events in result.timeline.by_rank().items():
        assert [e.action for e in events] == [str(a) for a in schedule.actions[rank]]


# ------------------------------------------------------------------ stage costs from a plan
def test_stage_costs_from_plan() -> None:
    graph = new_cost_graph("toy")
    add_block(graph, "input", fwd=5, bwd=0, act=8, params=0)  # 5: data loading, not compute
    add_block(graph, "a", fwd=2, bwd=4, act=16, params=100)
    add_block(graph, "b", fwd=6, bwd=8, act=32, params=200)
    add_block(graph, "c", fwd=4, bwd=4, act=4, params=50)
    for u, v in [("input", "a"), ("a", "b"), ("a", "c"), ("b", "c")]:
        graph.add_edge(u, v)
    plan = Plan(stages=(Stage(("a",), 1, (0,)), Stage(("b",), 1, (1,)), Stage(("c",), 1, (2,))),
                time_per_minibatch=1.0, dp_time=1.0, workers=3)
    costs = StageCosts.from_plan(graph, plan, microbatches=2)
    assert costs.fwd == (1.0, 3.0, 2.0)
    assert costs.bwd == (2.0, 4.0, 2.0)
    assert costs.params == (100.0, 200.0, 50.0)
    assert costs.edges == {(0, 1): 8.0, (0, 2): 8.0, (1, 2): 16.0}
    assert costs.activations == (12.0, 16.0, 2.0)  # input joins stage 0
    backwards = Plan(stages=(Stage(("b",), 1, (0,)), Stage(("a", "c"), 1, (1,))),
                     time_per_minibatch=1.0, dp_time=1.0, workers=2)
    with pytest.raises(PlanError, match="back to stage"):
        StageCosts.from_plan(graph, backwards)
    stranger = Plan(stages=(Stage(("zzz",), 1, (0,)),), time_per_minibatch=1.0, dp_time=1.0,
                    workers=1)
    with pytest.raises(PlanError, match="zzz"):
        StageCosts.from_plan(graph, stranger)
    assert isinstance(graph, nx.DiGraph)


# ------------------------------------------------------------------ timeline format
def test_timeline_json_round_trip(tmp_path: object) -> None:
    result = simulate(lower(generate("1f1b", straight(2), 4)), StageCosts.uniform(2, fwd=F, bwd=B),
                      FREE)
    line = result.timeline
    back = Timeline.from_json(line.to_json())
    assert back == line
    assert back.time_per_minibatch() == line.time_per_minibatch()
    with pytest.raises(TimelineError, match="format"):
        Timeline.from_json('{"events": []}')
    with pytest.raises(TimelineError, match="event 0"):
        Timeline.from_json('{"format": "pdcompile.timeline/1", "events": [[0, "1F0"]]}')


def test_recorder_and_merge() -> None:
    ticks = iter([10.0, 11.0, 11.5, 12.0])
    recorder = Recorder(1, clock=lambda: next(ticks))
    with recorder.record("1F0"):
        pass
    recorder.add("1B0", 11.5, 12.0)
    other = Timeline([Event(0, "0F0", 9.0, 10.0)], "measured", {"schedule": "gpipe"})
    merged = Timeline.merge([recorder.timeline(), other])
    assert sorted((e.rank, e.action, e.start, e.end) for e in merged.events) == [
        (0, "0F0", 0.0, 1.0), (1, "1B0", 2.5, 3.0), (1, "1F0", 1.0, 2.0)]
    assert merged.source == "measured"
    assert merged.meta["schedule"] == "gpipe"
    assert merged.bubble_fraction() == pytest.approx(1 - 2.5 / 6.0)


# ------------------------------------------------------------------ latency-aware warm-up
def test_latency_aware_warmup_is_noam_when_transfers_are_free() -> None:
    ranks = ranks_of([2, 1, 1])
    costs = StageCosts((2.0, 1.0, 1.0), (4.0, 2.0, 2.0))
    depths = latency_aware_warmup(ranks, costs.round_trips(ranks, FREE), costs.period(ranks, FREE))
    assert depths == [warmup_depth(ranks, s) for s in range(3)]


def test_latency_aware_warmup_hides_slow_links() -> None:
    ranks = straight(3)
    cluster = Cluster.flat(3, 1.0)
    costs = StageCosts.uniform(3, fwd=1.0, bwd=2.0, edge_bytes=3.0)  # 3 s per transfer
    noam = simulate(lower(generate("1f1b", ranks, 60)), costs, cluster)
    depths = latency_aware_warmup(ranks, costs.round_trips(ranks, cluster),
                                  costs.period(ranks, cluster))
    assert depths[0] > warmup_depth(ranks, 0)
    deeper = lower(generate("1f1b", ranks, 60, warmup=depths))
    result = simulate(deeper, costs, cluster)
    assert noam.time_per_minibatch > F + B + 0.5
    assert result.time_per_minibatch == pytest.approx(F + B)
    assert result.memory[0].in_flight == depths[0] + 1 > noam.memory[0].in_flight


# ------------------------------------------------------------------ command line
def test_simulate_command(tmp_path: Path, profiles_dir: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    code = main(["simulate", "--profile", str(profiles_dir / "alexnet"), "--cluster", "4@1e9",
                 "--planner", "dp", "--minibatches", "16", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "per minibatch" in printed and "bubble" in printed
    for name in ("plan.json", "schedule.txt", "timeline.json", "gantt.png", "gantt.svg",
                 "trace.json"):
        assert (out / name).stat().st_size > 0, name
    line = Timeline.load(out / "timeline.json")
    schedule = Schedule.from_text((out / "schedule.txt").read_text())
    assert len(line.events) == sum(len(a) for a in schedule.actions.values())
    code = main(["simulate", "--profile", str(profiles_dir / "alexnet"), "--cluster", "4@1e9",
                 "--plan", str(out / "plan.json"), "--minibatches", "16", "--json",
                 "--measured", str(out / "timeline.json")])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0
    assert figures["predicted_over_measured"] == pytest.approx(1.0)
    assert figures["schedule"] == "1f1b"
    assert figures["comparison"]["stage 0 forward"]["error"] == pytest.approx(0.0)
    code = main(["simulate", "--profile", str(profiles_dir / "alexnet"), "--cluster", "4@1e9",
                 "--plan", str(out / "plan.json"), "--minibatches", "16",
                 "--measured", str(out / "timeline.json")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "predicted against measured" in printed and "stage 0 receive wait" in printed


def test_simulate_command_flush_schedule(profiles_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--profile", str(profiles_dir / "vgg16"), "--cluster", "2x2@1e10,1e9",
                 "--planner", "dp", "--schedule", "gpipe", "--microbatches", "4", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0 and figures["schedule"] == "gpipe"
    assert figures["makespan"] == pytest.approx(figures["time_per_minibatch"])


def test_simulate_command_errors(profiles_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--cluster", "A"]) == 1
    assert "exactly one of MODEL" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(profiles_dir / "alexnet"), "--cluster", "4@1e9",
                 "--planner", "dp", "--microbatches", "4"]) == 1
    assert "'1f1b' runs whole minibatches" in capsys.readouterr().err


def test_allreduce_does_not_wait_for_a_partners_transfer() -> None:
    # replicas of stage 1 send their gradient back (slow link) right before their all-reduce:
    # the all-reduce starts when both replicas have *issued* the send and computed the weight
    # gradients that follow it, not when it has arrived
    cluster = Cluster.flat(3, 1.0)
    costs = StageCosts((1.0, 1.0), (1.0, 1.0), params=(0.0, 0.0), edges={(0, 1): 10.0},
                       optimizer=(0.0, 0.0))
    result = simulate(lower(generate("1f1b", [[0], [1, 2]], 2)), costs, cluster)
    events = {(e.rank, e.action): e for e in result.timeline.events}
    assert events[2, "1SEND_B1->0"].end == pytest.approx(events[2, "1B1"].start + 0.5)
    assert events[1, "1ALLREDUCE0"].start == pytest.approx(events[2, "1B1"].end)


@pytest.mark.parametrize("replicas", [[2, 1, 1, 4, 8], [1, 2], [3, 2, 1], [2, 2, 2, 1], [1, 3, 1],
                                      [4, 1, 2, 3], [6, 2, 8]])
def test_latency_aware_warmup_never_deadlocks(replicas: list[int]) -> None:
    ranks = ranks_of(replicas)
    n = 2 * math.lcm(*replicas) * len(replicas)
    for scale in (0.5, 2.0, 10.0, 40.0):  # round trips from short to many periods long
        round_trip = [scale * (len(replicas) - s) for s in range(len(replicas))]
        depths = latency_aware_warmup(ranks, round_trip, 1.0)
        assert all(d >= warmup_depth(ranks, s) for s, d in enumerate(depths))
        validate(lower(generate("1f1b", ranks, n, warmup=depths)))


def test_timeline_checked_against_its_schedule() -> None:
    schedule = lower(generate("1f1b-flush", straight(2), 3))
    result = simulate(schedule, StageCosts.uniform(2, fwd=F, bwd=B), FREE)
    result.timeline.check_schedule(schedule)  # one event per action, in order
    events = [e for e in result.timeline.events if e.action != "1F2"]
    with pytest.raises(TimelineError, match="rank 1: the timeline has 12 events, the schedule 13 "
                       "actions; first difference at step 9: ran 1B2, schedule says 1F2"):
        Timeline(events, "measured").check_schedule(schedule)


def test_simulate_command_from_a_costgraph_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    saved_chain(tmp_path / "g.json", 6, nbytes=1e6)
    code = main(["simulate", "--costgraph", str(tmp_path / "g.json"), "--cluster", "3@1e10",
                 "--planner", "dp", "--schedule", "2bw", "--microbatches", "2", "--minibatches",
                 "8", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0 and figures["schedule"] == "2bw"
    assert figures["time_per_minibatch"] > 0


def test_simulate_command_from_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = tmp_path / "mlp.py"
    model_file.write_text(
        "import torch\n"
        "def factory():\n"
        "    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])\n"
        "    return model, (torch.randn(16, 64),)\n")
    code = main(["simulate", f"{model_file}:factory", "--cluster", "2@1e9", "--planner", "dp",
                 "--schedule", "1f1b-flush", "--microbatches", "4", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0 and figures["schedule"] == "1f1b-flush"
    assert figures["time_per_minibatch"] > 0 and set(figures["memory"]) <= {"0", "1"}


def test_figures_do_not_depend_on_keeping_the_full_timeline() -> None:
    schedule = lower(generate("gpipe", [[0, 1], [2]], 4))
    costs = StageCosts((2.0, 1.0), (4.0, 2.0), params=(1e9, 1e9), optimizer=(0.5, 0.5))
    full = simulate(schedule, costs, Cluster.flat(3, 1e9))
    lean = simulate(schedule, costs, Cluster.flat(3, 1e9), timeline=False)
    assert any("ALLREDUCE" in e.action for e in full.timeline.events)
    assert not any("ALLREDUCE" in e.action for e in lean.timeline.events)
    for name in ("makespan", "time_per_minibatch", "bubble", "steady_bubble"):
        assert getattr(lean, name) == pytest.approx(getattr(full, name)), name
    assert full.makespan > max(e.end for e in full.timeline.events if e.action[1:2] in "FB")


@pytest.mark.parametrize("stage_ranks", [[[0], [1, 2, 3]], [[0, 1, 2], [3]], [[0, 1], [2, 3, 4]]])
def test_steady_time_does_not_depend_on_where_the_stream_ends(stage_ranks: list[list[int]]
                                                              ) -> None:
    # replicated stages finish minibatches in bursts, one per round; the steady window spans
    # whole periods (lcm of the replica counts), so the stream length moves the figure by well
    # under 1% (the earlier middle-half window moved it by 12% on [[0, 1], [2, 3, 4]]; some
    # pipelines repeat only every few periods, which leaves a 0.2% wobble)
    cluster = Cluster.flat(5, 1e9)
    costs = StageCosts((1.0, 2.0), (2.0, 4.0), params=(1e8, 3e8), activations=(0.0, 0.0),
                       edges={(0, 1): 1e6}, optimizer=(0.1, 0.1))
    times = []
    period = math.lcm(*(len(r) for r in stage_ranks))
    for minibatches in (8 * period, 9 * period, 11 * period, 14 * period):
        lowered = lower(generate("1f1b", stage_ranks, minibatches), costs.stage_edges())
        result = simulate(lowered, costs, cluster)
        assert result.timeline.period() == period
        times.append(result.time_per_minibatch)
    assert max(times) == pytest.approx(min(times), rel=5e-3)
