"""Links whose transfers are CPU copies (loopback): the sending rank is busy while it sends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.backends.simulate import SimResult, simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import ClusterError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.schedule.generators import generate
from pdcompile.schedule.lower import lower
from tests.helpers.clusters import reloaded
from tests.helpers.graphs import saved_chain

F, B = 1.0, 1.0
SIZE, BANDWIDTH = 5.0, 10.0
COPY = SIZE / BANDWIDTH  # 0.5 s per transfer, on the link (and on the sender when CPUs copy)
W = B / 2  # rank 1's weight gradients, computed after it sends the input gradients
COSTS = StageCosts((F, F), (B, B), edges={(0, 1): SIZE}, optimizer=(0.0, 0.0))


def cluster(cpu_copies: bool) -> Cluster:
    return Cluster(levels=(Level(2, BANDWIDTH, 0.0, cpu_copies=cpu_copies),))


def run(name: str, microbatches: int, on: Cluster, warmup: list[int] | None = None) -> SimResult:
    return simulate(lower(generate(name, [[0], [1]], microbatches, warmup=warmup)), COSTS, on)


def send_events(result: SimResult) -> list[tuple[float, float]]:
    return [(e.start, e.end) for e in result.timeline.events if "SEND" in e.action]


# ------------------------------------------------------------------ the sender is busy
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_gpipe_makespan_by_hand(m: int) -> None:
    # a NIC: (m + p - 1)(f + b) plus the first activation's and the last gradient's transfer,
    # less rank 1's last weight gradients, which follow its send
    assert run("gpipe", m, cluster(False)).makespan == pytest.approx(
        (m + 1) * (F + B) + 2 * COPY - W)
    # CPU copies: rank 0 spends f + copy per forward, so the last activation arrives at
    # m (f + copy); rank 1 runs that forward, then m backwards each with its copy between the
    # input and the weight gradients, and rank 0 (b < b + copy: never behind) runs the
    # backward of the last gradient to arrive
    busy = m * (F + COPY) + F + m * (B + COPY) - W + B
    assert busy == 3 * m + 1.5
    assert run("gpipe", m, cluster(True)).makespan == pytest.approx(busy)


def test_send_events_last_bytes_over_bandwidth() -> None:
    free = run("1f1b-flush", 4, cluster(False))
    busy = run("1f1b-flush", 4, cluster(True))
    assert send_events(free) and all(end == start for start, end in send_events(free))
    assert len(send_events(busy)) == 2 * 4
    assert all(end - start == pytest.approx(COPY) for start, end in send_events(busy))


def test_steady_state_grows_by_the_copy_when_the_sender_is_the_bottleneck() -> None:
    # asynchronous 1F1B, 3 minibatches in flight at stage 0 so that the round trip
    # (f + copy + f + b + copy + b = 5 s over 3) does not limit it: f + b per minibatch,
    # and f + b + copy when each rank also makes one copy per minibatch
    free = run("1f1b", 32, cluster(False), warmup=[2, 0])
    busy = run("1f1b", 32, cluster(True), warmup=[2, 0])
    assert free.time_per_minibatch == pytest.approx(F + B)
    assert busy.time_per_minibatch == pytest.approx(F + B + COPY)


def test_arrival_is_unchanged() -> None:
    # one microbatch: the data leaves at the same time and arrives at the same time either way
    free = {e.action: e for e in run("gpipe", 1, cluster(False)).timeline.events}
    busy = {e.action: e for e in run("gpipe", 1, cluster(True)).timeline.events}
    assert busy["1F0"].start == free["1F0"].start == pytest.approx(F + COPY)
    assert busy["0B0"].start == free["0B0"].start == pytest.approx(
        F + COPY + F + B - W + COPY)


def test_empty_sends_take_no_time() -> None:
    costs = StageCosts((F, F), (B, B), optimizer=(0.0, 0.0))  # no edge bytes
    result = simulate(lower(generate("gpipe", [[0], [1]], 3)), costs, cluster(True))
    assert all(end == start for start, end in send_events(result))
    assert result.makespan == pytest.approx((3 + 1) * (F + B) - W)


# ------------------------------------------------------------------ off: as before
@pytest.mark.parametrize("name, m", [("gpipe", 4), ("1f1b-flush", 5), ("1f1b", 12)])
def test_without_cpu_copies_nothing_changes(name: str, m: int) -> None:
    before = Cluster(levels=(Level(2, BANDWIDTH, 0.25),))  # built without the new argument
    after = Cluster(levels=(Level(2, BANDWIDTH, 0.25, cpu_copies=False),))
    a, b = run(name, m, before), run(name, m, after)
    assert a.timeline.events == b.timeline.events
    assert (a.makespan, a.time_per_minibatch) == (b.makespan, b.time_per_minibatch)


def test_only_the_level_with_cpu_copies_pays() -> None:
    # ranks 0, 1 share a host (loopback), rank 2 is behind a NIC
    two = Cluster(levels=(Level(2, BANDWIDTH, cpu_copies=True), Level(2, BANDWIDTH)))
    assert two.cpu_copies_between(0, 1) and not two.cpu_copies_between(1, 2)
    costs = StageCosts((F,) * 3, (B,) * 3, edges={(0, 1): SIZE, (1, 2): SIZE},
                       optimizer=(0.0,) * 3)
    events = {e.action: e for e in simulate(lower(generate("gpipe", [[0], [1], [2]], 1)), costs,
                                            two).timeline.events}
    assert events["0SEND_F0->1"].end - events["0SEND_F0->1"].start == pytest.approx(COPY)
    assert events["1SEND_F0->2"].end == events["1SEND_F0->2"].start


# ------------------------------------------------------------------ the local preset, files
def test_local_preset_copies_by_cpu(local_env: None) -> None:
    local = Cluster.preset("local-2")
    assert [lv.cpu_copies for lv in local.levels] == [True]
    assert local.cpu_copies_between(0, 1)
    assert "CPU copies" in local.describe()
    assert local.with_workers(4).levels[0].cpu_copies
    assert not any(lv.cpu_copies for lv in Cluster.preset("B").levels)


def test_saved_cluster_keeps_the_flag(local_env: None, tmp_path: Path) -> None:
    local = Cluster.preset("local-2")
    assert reloaded(local, tmp_path) == local
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("levels:\n  - {workers: 2, bandwidth: 2GB/s, cpu_copies: true}\n"
                         "  - {workers: 2, bandwidth: 10Gbps}\n")
    assert [lv.cpu_copies for lv in Cluster.load(yaml_file).levels] == [True, False]


def test_old_files_load_without_the_flag(tmp_path: Path) -> None:
    file = tmp_path / "old.json"
    file.write_text(json.dumps({"levels": [{"workers": 2, "bandwidth": 1e9, "latency": 0.0}]}))
    assert Cluster.load(file).levels == (Level(2, 1e9, 0.0, cpu_copies=False),)


def test_a_bad_flag_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "bad.json"
    file.write_text(json.dumps({"levels": [{"workers": 2, "bandwidth": 1e9, "cpu_copies": "yes"}]}))
    with pytest.raises(ClusterError, match="cpu_copies 'yes' is not true or false"):
        Cluster.load(file)


def test_simulate_command_notes_more_workers_than_cores(local_env: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    saved_chain(tmp_path / "g.json", 4, nbytes=1e5)
    command = ["simulate", "--costgraph", str(tmp_path / "g.json"), "--cluster", "local-2",
               "--planner", "dp", "--minibatches", "8", "--json"]
    monkeypatch.setattr("pdcompile.machine.local.usable_cores", lambda: 2)
    assert main([*command, "--out", str(tmp_path / "two")]) == 0
    captured = capsys.readouterr()
    assert "NOTE" not in captured.err and json.loads(captured.out)["config"] != "1"
    # on one core the planner would rather leave a worker idle: the plan made for two cores
    monkeypatch.setattr("pdcompile.machine.local.usable_cores", lambda: 1)
    assert main([*command, "--plan", str(tmp_path / "two" / "plan.json")]) == 0
    captured = capsys.readouterr()
    assert "2 worker processes would share this machine's 1 cores" in captured.err
    assert json.loads(captured.out)["time_per_minibatch"] > 0  # stdout stays JSON
