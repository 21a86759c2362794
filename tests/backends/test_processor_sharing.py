"""Ranks that outnumber their host's cores share them (`Level.cores`, processor sharing)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdcompile.backends.action_costs import ActionCosts
from pdcompile.backends.processor_sharing import share_processors
from pdcompile.backends.simulate import _dedicated, simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import ClusterError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.schedule.deps import dependency_lists, execution_order
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.lower import lower
from tests.helpers.clusters import reloaded
from tests.helpers.graphs import chain_graph
from tests.helpers.stage_costs import SHAPES, random_costs


def lowered(name: str, shape: list[list[int]], m: int) -> Schedule:
    return lower(generate(name, shape, m))


def work_per_rank(schedule: Schedule, costs: StageCosts, cluster: Cluster) -> float:
    """Seconds of processor that all ranks' actions take at full speed (no stash copies)."""
    work = ActionCosts(schedule, costs, cluster, stash=False)
    total = 0.0
    for rank, actions in schedule.actions.items():
        for action in actions:
            if action.kind.is_compute or action.kind == Kind.STEP:
                total += work.compute(rank, action)
            elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                _, busy, _, cpu_copies = work.send(rank, action)
                total += busy if cpu_copies else 0.0
    return total


# ------------------------------------------------------------------ agreement with one core each
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe"])
def test_enough_cores_give_the_dedicated_times(seed: int, name: str) -> None:
    rng = random.Random(seed)
    shape = SHAPES[seed % len(SHAPES)]
    stages = len(shape)
    m = 4 * rng.randint(1, 4)
    schedule = lowered(name, shape, m)
    costs = random_costs(rng, stages)
    workers = max(r for ranks in shape for r in ranks) + 1
    on = Cluster(levels=(Level(workers, rng.uniform(1.0, 5.0), rng.uniform(0.0, 0.2),
                               cpu_copies=bool(seed % 2), cores=2 * workers),))
    deps = dependency_lists(schedule)
    alone = _dedicated(schedule, deps, execution_order(schedule, deps),
                       ActionCosts(schedule, costs, on, stash=True))
    # a core for every rank and for the receiving side of every loopback copy in flight
    shared = share_processors(schedule, deps, ActionCosts(schedule, costs, on, stash=True),
                              group_size=workers, cores=2 * workers)
    for rank in schedule.actions:
        assert shared[0][rank] == pytest.approx(alone[0][rank], abs=1e-9)
        assert shared[1][rank] == pytest.approx(alone[1][rank], abs=1e-9)


# ------------------------------------------------------------------ theory
@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [4, 8, 12])
def test_one_core_is_never_idle_while_work_is_left(name: str, shape: list[list[int]],
                                                   m: int) -> None:
    # links free, no all-reduce time: a rank only waits for another rank's computation, so
    # with one core some rank is always computing and the run takes exactly all the work
    rng = random.Random(m * 31 + len(shape))
    schedule = lowered(name, shape, m)
    costs = random_costs(rng, len(shape), free_links=True)
    workers = max(r for ranks in shape for r in ranks) + 1
    one_core = Cluster(levels=(Level(workers, 1e9, 0.0, cpu_copies=True, cores=1),))
    result = simulate(schedule, costs, one_core, stash=False)
    assert result.makespan == pytest.approx(work_per_rank(schedule, costs, one_core))


@pytest.mark.parametrize("cores", [1, 2, 3, 4])
def test_independent_replicas_share_the_cores_evenly(cores: int) -> None:
    # one stage on 4 replicas (1F1B-RR), no parameters to all-reduce: the replicas never wait
    # for each other, so c cores finish the 4 replicas' work in 4 / c times one replica's
    schedule = lowered("1f1b", [[0, 1, 2, 3]], 8)
    costs = StageCosts((1.0,), (2.0,), optimizer=(0.5,))
    on = Cluster(levels=(Level(4, 1e9, cores=cores),))
    dedicated = simulate(schedule, costs, Cluster(levels=(Level(4, 1e9),)))
    assert dedicated.makespan == pytest.approx(2 * 3.5)  # two minibatches per replica
    assert simulate(schedule, costs, on).makespan == pytest.approx(2 * 3.5 * max(1, 4 / cores))


def test_a_waiting_rank_leaves_its_core_to_the_others() -> None:
    # gpipe, 2 stages, one core, each backward one block before its send: rank 1 waits for
    # the forward of rank 0, so the ranks never compute at the same time and nothing is slower
    # than on two cores
    schedule = lowered("gpipe", [[0], [1]], 1)
    costs = StageCosts((1.0, 2.0), (3.0, 4.0), optimizer=(0.0, 0.0))
    one = simulate(schedule, costs, Cluster(levels=(Level(2, 1e9, cores=1),)), wgrad_share=0.0)
    two = simulate(schedule, costs, Cluster(levels=(Level(2, 1e9),)), wgrad_share=0.0)
    assert one.makespan == pytest.approx(two.makespan) == pytest.approx(10.0)
    # rank 1 sends its input gradients after half its backward (2 s) and computes its weight
    # gradients (2 s) while rank 0 runs its backward (3 s): on two cores that saves 2 s, on
    # one they share it, both at half speed for 4 s, then rank 0's last 1 s
    one = simulate(schedule, costs, Cluster(levels=(Level(2, 1e9, cores=1),)))
    two = simulate(schedule, costs, Cluster(levels=(Level(2, 1e9),)))
    assert two.makespan == pytest.approx(1.0 + 2.0 + 2.0 + 3.0)
    assert one.makespan == pytest.approx(1.0 + 2.0 + 2.0 + 4.0 + 1.0)


def test_time_slicing_bounds_the_throughput() -> None:
    # four stages on two cores: a minibatch takes at least all its work over two cores
    schedule = lowered("1f1b", [[0], [1], [2], [3]], 64)
    costs = StageCosts((1.0,) * 4, (2.0,) * 4, optimizer=(0.0,) * 4, stash=(0.0,) * 4)
    shared = simulate(schedule, costs, Cluster(levels=(Level(4, 1e9, cores=2),)))
    alone = simulate(schedule, costs, Cluster(levels=(Level(4, 1e9),)))
    assert alone.time_per_minibatch == pytest.approx(3.0)
    assert shared.time_per_minibatch == pytest.approx(4 * 3.0 / 2, rel=0.02)


def test_a_loopback_transfer_copies_on_both_ends() -> None:
    # one core, rank 0 sends 1 s of copying to an idle rank 1: the sender's copy and the
    # receiver's run at once at half speed each, so the data arrives after 2 s, not 1 s
    schedule = lowered("gpipe", [[0], [1]], 1)
    costs = StageCosts((1.0, 1.0), (1.0, 1.0), edges={(0, 1): 10.0}, optimizer=(0.0, 0.0))
    one = simulate(schedule, costs, Cluster(levels=(Level(2, 10.0, 0.0, True, cores=1),)),
                   wgrad_share=0.0)  # each backward one block before its send
    two = simulate(schedule, costs, Cluster(levels=(Level(2, 10.0, 0.0, True),)),
                   wgrad_share=0.0)
    assert two.makespan == pytest.approx(1 + 1 + 1 + 1 + 1 + 1)  # F, copy, F, B, copy, B
    assert one.makespan == pytest.approx(1 + 2 + 1 + 1 + 2 + 1)


def test_hosts_share_their_own_cores_only() -> None:
    # 2 hosts of 2 ranks, one core each: ranks 0-1 share one core, ranks 2-3 the other
    schedule = lowered("1f1b", [[0, 1, 2, 3]], 8)
    costs = StageCosts((1.0,), (1.0,), optimizer=(0.0,))
    two_hosts = Cluster(levels=(Level(2, 1e9, cores=1), Level(2, 1e9)))
    assert two_hosts.shared_cores() == (2, 1)
    assert simulate(schedule, costs, two_hosts).makespan == pytest.approx(2 * 2.0 * 2)


# ------------------------------------------------------------------ the cluster field
def test_cores_are_validated_and_kept_in_files(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="cores 0"):
        Cluster(levels=(Level(2, 1e9, cores=0),))
    with pytest.raises(ClusterError, match="cores 1.5"):
        Cluster(levels=(Level(2, 1e9, cores=1.5),))  # type: ignore[arg-type]
    shared = Cluster(levels=(Level(4, 1e9, cpu_copies=True, cores=2),))
    assert shared.shared_cores() == (4, 2)
    assert "2 cores" in shared.describe()
    assert Cluster(levels=(Level(4, 1e9, cores=4),)).shared_cores() is None
    assert Cluster(levels=(Level(4, 1e9),)).shared_cores() is None
    assert reloaded(shared, tmp_path) == shared
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"levels": [{"workers": 2, "bandwidth": 1e9, "cores": "two"}]}))
    with pytest.raises(ClusterError, match="cores 'two' is not an integer"):
        Cluster.load(file)


def test_local_preset_knows_the_cores(local_env: None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pdcompile.machine.local.usable_cores", lambda: 2)
    assert Cluster.preset("local-4").levels[0].cores == 2
    assert Cluster.preset("local-4").shared_cores() == (4, 2)
    assert Cluster.preset("local-2").shared_cores() is None


def test_long_runs_end_despite_rounding() -> None:
    # event times of 1e5 s and more, where a step recomputed from the rounded clock left work
    # of a femtosecond behind and the loop advanced by nothing for ever (a version did)
    schedule = lowered("1f1b", [[i] for i in range(6)], 400)
    costs = StageCosts((1000.0,) * 6, (2000.0,) * 6, edges={(s, s + 1): 70.0 for s in range(5)},
                       optimizer=(100.0,) * 6)
    shared = simulate(schedule, costs, Cluster(levels=(Level(6, 1.0, 1.0, True, cores=4),)),
                      timeline=False)
    assert shared.makespan > 1e5
    # per minibatch: each stage's F + B + step, and every transfer copied on both of its ends
    work = 6 * (3000.0 + 100.0) + 2 * 2 * 5 * 70.0
    assert shared.time_per_minibatch == pytest.approx(work / 4, rel=1e-6)


# ------------------------------------------------------------------ profiles for shared cores
def test_workers_taking_turns_profile_cold() -> None:
    from pdcompile.cost.cache_flush import caches_for

    assert caches_for(Cluster(levels=(Level(4, 1e9, cores=2),))) == "cold"
    assert caches_for(Cluster(levels=(Level(4, 1e9, cores=4),))) == "warm"
    assert caches_for(Cluster(levels=(Level(4, 1e9),))) == "warm"


@pytest.mark.parametrize("cores, expected", [(2, "cold"), (4, "warm")])
def test_simulate_command_profiles_in_the_workers_cache_state(
        cores: int, expected: str, local_env: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import pdcompile.cost.node_costs as cost
    from pdcompile.cli import main

    monkeypatch.setattr("pdcompile.machine.local.usable_cores", lambda: cores)
    seen: list[str] = []
    annotate = cost.annotate_costs

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(str(kwargs.get("caches", "warm")))
        return annotate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cost, "annotate_costs", recording)
    model_file = tmp_path / "mlp.py"
    model_file.write_text(
        "import torch\n"
        "def factory():\n"
        "    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])\n"
        "    return model, (torch.randn(8, 32),)\n")
    assert main(["simulate", f"{model_file}:factory", "--cluster", "local-4", "--planner", "dp",
                 "--minibatches", "8", "--json"]) == 0
    assert seen == [expected]
    assert json.loads(capsys.readouterr().out)["time_per_minibatch"] > 0


# ------------------------------------------------------------------ the planner's view
@pytest.mark.parametrize("nbytes", [0.0, 2e6])
def test_planner_counts_the_cores_workers_take_turns_on(nbytes: float) -> None:
    import pdcompile
    from pdcompile.cost.stage_costs import StageCosts

    graph = chain_graph(8, nbytes=nbytes)
    own = Cluster(levels=(Level(4, 1e9, 1e-5, cpu_copies=True),))
    shared = Cluster(levels=(Level(4, 1e9, 1e-5, cpu_copies=True, cores=2),))
    alone = pdcompile.plan(graph, own, planner="dp", straight=True, stages=4)
    taking_turns = pdcompile.plan(graph, shared, planner="dp", straight=True, stages=4)
    assert [s.nodes for s in alone.stages] == [s.nodes for s in taking_turns.stages]
    # free to leave workers idle, the planner does so where the copies cost more than two
    # more turns on the same cores save (2 MB between blocks: 2 workers at 122.0 ms, 4 at 132.0)
    free = pdcompile.plan(graph, shared, planner="dp", straight=True)
    assert free.time_per_minibatch <= taking_turns.time_per_minibatch * (1 + 1e-9)
    assert len(free.stages) == (2 if nbytes else 4)
    # 8 blocks of 30 ms on 4 stages: 60 ms each with a core each; on 2 cores all 240 ms of
    # compute (and every copy, on both ends, and the optimizer steps) shares them
    copies = sum(s.copies for s in alone.stages)
    steps = sum(s.time - s.compute - s.copies for s in alone.stages)
    closed = "closed_form_time_per_minibatch"
    assert alone.extra[closed] == pytest.approx(max(s.time for s in alone.stages))
    # (the plan the simulator picks may wait a little on a round trip besides)
    assert taking_turns.extra[closed] == pytest.approx((0.24 + steps + 2 * copies) / 2,
                                                       rel=1e-3)
    assert taking_turns.dp_time == pytest.approx(2 * alone.dp_time)
    # and the simulator, which shares the cores action by action, agrees within its bubbles
    schedule = lower(generate("1f1b", [[0], [1], [2], [3]], 64))
    simulated = simulate(schedule, StageCosts.from_plan(graph, taking_turns), shared,
                         timeline=False)
    assert simulated.time_per_minibatch == pytest.approx(taking_turns.extra[closed], rel=0.1)
