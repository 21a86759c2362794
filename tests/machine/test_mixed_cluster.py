"""Mixed clusters: device groups in the short form, files, presets, per-rank devices, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given

from pdcompile.errors import ClusterError
from pdcompile.machine.cluster import PRESET_HELP, Cluster
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from tests.helpers.clusters import reloaded
from tests.helpers.strategies import mixed_clusters

A100_V100 = "8x4@150GB/s,100Gbps:a100*16,v100*16"


def test_short_form_gives_each_rank_its_device() -> None:
    cluster = Cluster.parse(A100_V100)
    assert cluster.is_mixed and cluster.workers == 32
    assert [cluster.device_of(r).name for r in (0, 15, 16, 31)] == ["a100", "a100", "v100", "v100"]
    assert cluster.device.name == "a100"  # the reference: the first group's device
    assert cluster.speed_of(3) == 1.0
    a100, v100 = DEVICES["a100"], DEVICES["v100"]
    expected = ((v100.flops / a100.flops) * (v100.mem_bandwidth / a100.mem_bandwidth)) ** 0.5
    assert cluster.speed_of(20) == pytest.approx(expected)
    assert cluster.memory_of([0, 1]) == a100.memory and cluster.memory_of([0, 16]) == v100.memory
    assert list(cluster.group_ranks(1)) == list(range(16, 32))
    assert cluster.slowest_speed(range(32)) == pytest.approx(expected)


def test_speed_is_transitive_so_the_reference_does_not_matter() -> None:
    a, v, h = DEVICES["a100"], DEVICES["v100"], DEVICES["h100"]
    assert h.speed_relative_to(v) == pytest.approx(h.speed_relative_to(a)
                                                   * a.speed_relative_to(v))
    assert v.speed_relative_to(v) == 1.0


@given(mixed_clusters())
def test_random_mixed_clusters_round_trip_through_dicts(cluster: Cluster) -> None:
    again = Cluster.from_dict(cluster.to_dict())
    assert again == cluster
    assert [again.device_of(r) for r in range(cluster.workers)] == \
        [cluster.device_of(r) for r in range(cluster.workers)]
    assert [again.speed_of(r) for r in range(cluster.workers)] == \
        [cluster.speed_of(r) for r in range(cluster.workers)]
    # the groups cover the ranks in order, each rank once
    covered = [r for i in range(len(cluster.groups)) for r in cluster.group_ranks(i)]
    assert covered == list(range(cluster.workers))


@given(mixed_clusters())
def test_a_group_alone_is_a_homogeneous_cluster_of_its_workers(cluster: Cluster) -> None:
    for i, group in enumerate(cluster.groups):
        alone = cluster.group_cluster(i)
        assert alone.workers == group.workers and not alone.groups
        assert alone.device == group.device and not alone.is_mixed


def test_homogeneous_clusters_answer_per_rank_alike() -> None:
    for cluster in (Cluster.preset("A"), Cluster.parse("4x2:h100"), Cluster.flat(3, "1e9")):
        assert not cluster.is_mixed and cluster.groups == ()
        assert all(cluster.device_of(r) == cluster.device for r in range(cluster.workers))
        assert all(cluster.speed_of(r) == 1.0 for r in range(cluster.workers))
        assert cluster.memory_of(range(cluster.workers)) == cluster.device.memory
        assert cluster.to_dict().get("groups") is None
    one_kind = Cluster.parse("4x2:v100*8")  # one group is not a mix
    assert not one_kind.is_mixed and one_kind.device_of(7).name == "v100"


def test_files_read_groups(tmp_path: Path) -> None:
    yaml_file = tmp_path / "mixed.yaml"
    yaml_file.write_text("levels:\n  - {workers: 2, bandwidth: 10GB/s}\n"
                         "  - {workers: 2, bandwidth: 10Gbps}\n"
                         "groups:\n  - {device: a100, workers: 2}\n"
                         "  - {device: v100, workers: 2, speed: 0.5}\n")
    cluster = Cluster.load(yaml_file)
    assert cluster.speed_of(3) == 0.5 and cluster.device_of(0).name == "a100"
    assert reloaded(cluster, tmp_path) == cluster


@pytest.mark.parametrize("name", [n for n in PRESET_HELP if n.startswith("mixed")])
def test_mixed_presets(name: str) -> None:
    cluster = Cluster.preset(name)
    assert cluster.is_mixed and len({g.device.name for g in cluster.groups}) == 2
    assert Cluster.parse(name) == cluster
    assert cluster.with_workers(5).workers == 5


def test_with_workers_keeps_the_groups_in_rank_order() -> None:
    cluster = Cluster.parse("4:a100*2,v100*2")
    assert [g.workers for g in cluster.with_workers(3).groups] == [2, 1]
    assert [g.workers for g in cluster.with_workers(6).groups] == [2, 4]


@pytest.mark.parametrize(("text", "words"), [
    ("8x4:a100*16,v100*8", ["hold 24 workers", "levels 8x4 hold 32", "a100*16,v100*16"]),
    ("8x4:a100*16,v1000*16", ["unknown device 'v1000'", "v100"]),
    ("4:a100*two,v100*2", ["'a100*two'", "NAME*WORKERS"]),
    ("4:a100*0,v100*4", ["'a100*0'", "NAME*WORKERS"]),
    ("4:a100*2,", ["''", "NAME*WORKERS"]),
])
def test_bad_short_forms_name_the_culprit_and_the_fix(text: str, words: list[str]) -> None:
    with pytest.raises(ClusterError) as err:
        Cluster.parse(text)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(("groups", "words"), [
    ("[{device: a100}]", ["needs 'device' and 'workers'"]),
    ("[{device: a100, workers: 2, speed: -1}, {device: v100, workers: 2}]",
     ["speed -1", "> 0"]),
    ("[{device: a100, workers: 4, colour: red}]", ["unknown keys ['colour']"]),
    ("[]", ["non-empty list"]),
    ("[{device: a100, workers: 3}]", ["hold 3 workers", "hold 4"]),
])
def test_bad_group_files_name_the_culprit(tmp_path: Path, groups: str, words: list[str]) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(f"levels:\n  - {{workers: 4, bandwidth: 10GB/s}}\ngroups: {groups}\n")
    with pytest.raises(ClusterError) as err:
        Cluster.load(file)
    for word in words:
        assert word in str(err.value)


def test_a_group_built_by_hand_is_checked() -> None:
    with pytest.raises(ClusterError, match="speed 0"):
        Cluster(levels=Cluster.parse("2").levels,
                groups=(DeviceGroup(DEVICES["a100"], 1, 0.0), DeviceGroup(DEVICES["v100"], 1)))
