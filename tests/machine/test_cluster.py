"""Cluster model: presets, the short string form, files, and the messages for bad ones."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcompile.errors import ClusterError
from pdcompile.machine.cluster import PRESET_HELP, Cluster, Level
from pdcompile.machine.device import DEVICES, Device
from tests.helpers.clusters import reloaded

GBPS = 1e9 / 8


@pytest.mark.parametrize("name", sorted(PRESET_HELP))
def test_every_preset_parses(name: str, local_env: None) -> None:
    name = name.replace("local-N", "local-3")  # the help's placeholder (local-N itself: refused)
    cluster = Cluster.preset(name)
    assert cluster.workers >= 1
    assert all(level.bandwidth > 0 for level in cluster.levels)
    assert cluster.device.memory > 0 and cluster.device.flops > 0
    assert Cluster.parse(name) == cluster


def test_paper_presets_have_the_papers_numbers() -> None:
    a, b, c = Cluster.preset("A"), Cluster.preset("B"), Cluster.preset("C")
    assert [lv.workers for lv in a.levels] == [4, 4] and a.device.name == "v100"
    assert a.levels[1].bandwidth == pytest.approx(10 * GBPS)
    assert [lv.workers for lv in b.levels] == [8, 2]
    assert b.levels[1].bandwidth == pytest.approx(25 * GBPS)
    assert b.levels[0].bandwidth > a.levels[0].bandwidth  # NVLink beats PCIe
    assert c.workers == 4 and c.device.name == "titanx"
    assert c.levels[0].bandwidth == pytest.approx(40 * GBPS)
    h100 = Cluster.preset("h100-4node")
    assert h100.workers == 32 and h100.device.name == "h100"
    assert h100.levels[1].bandwidth == pytest.approx(400 * GBPS)


def test_local_preset(local_env: None) -> None:
    cluster = Cluster.parse("local-3")
    assert cluster.workers == 3 and cluster.levels[0].bandwidth == 2e9
    assert cluster.device.flops == 5e10


@pytest.mark.parametrize(
    ("text", "workers", "bandwidths", "device"),
    [
        ("4", [4], [1e9], "v100"),
        ("16@10Gbps", [16], [10 * GBPS], "v100"),
        ("4x4@1e10,1.25e9", [4, 4], [1e10, 1.25e9], "v100"),
        ("8x2@300GB/s,25Gbps~5us,50us:h100", [8, 2], [300e9, 25 * GBPS], "h100"),
        (" 2x2x2 @ 1e9,1e9,1e8 :titanx ", [2, 2, 2], [1e9, 1e9, 1e8], "titanx"),
    ],
)
def test_strings_parse(text: str, workers: list[int], bandwidths: list[float],
                       device: str) -> None:
    cluster = Cluster.parse(text)
    assert [lv.workers for lv in cluster.levels] == workers
    assert [lv.bandwidth for lv in cluster.levels] == pytest.approx(bandwidths)
    assert cluster.device.name == device


def test_latency_and_topology_queries() -> None:
    cluster = Cluster.parse("4x4@1e10,1.25e9~10us,50us")
    assert [lv.latency for lv in cluster.levels] == pytest.approx([10e-6, 50e-6])
    assert cluster.workers == 16 and cluster.group_size(0) == 4
    assert cluster.link_level(0, 3) == 0 and cluster.link_level(3, 4) == 1
    assert cluster.bandwidth_between(1, 2) == 1e10
    assert cluster.bandwidth_between(1, 5) == 1.25e9
    assert cluster.latency_between(0, 15) == pytest.approx(50e-6)
    assert cluster.slowest_level_of([0, 1, 2]) == 0 and cluster.slowest_level_of([0, 4]) == 1
    with pytest.raises(ClusterError, match="outside"):
        cluster.link_level(0, 16)


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("", "empty cluster string"),
        ("4y4", "'4y4'"),
        ("4x4@1e9", "'1e9'"),
        ("4@fast", "'fast'"),
        ("4:tpu", "'tpu'"),
        ("0x4", "'0'"),
        ("A@1e9", "'A'"),
        ("4~1e-5,2", "'1e-5,2'"),
        ("4@1e400", "'1e400'"),  # beyond a float: read as infinity before it was refused
        ("4@1e9~1e400s", "'1e400s'"),
    ],
)
def test_bad_strings_quote_the_bad_part_and_show_an_example(text: str, quoted: str) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.parse(text)
    message = str(info.value)
    assert quoted in message
    # every message shows something valid to write: an example, or the valid names
    assert "e.g." in message or "devices are: v100" in message


def test_flat() -> None:
    cluster = Cluster.flat(8, "25Gbps", device="a100")
    assert cluster.workers == 8 and cluster.levels == (Level(8, 25 * GBPS),)
    assert cluster.device == DEVICES["a100"]
    custom = Device("mine", memory=1e9, flops=1e12, mem_bandwidth=1e11)
    assert Cluster.flat(2, 1e9, device=custom).device is custom
    with pytest.raises(ClusterError, match="bandwidth"):
        Cluster.flat(2, "quick")
    with pytest.raises(ClusterError, match="positive integer"):
        Cluster.flat(0, 1e9)


def test_files_round_trip(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("name: lab\nlevels:\n  - {workers: 4, bandwidth: 10GB/s, latency: 10us}\n"
                         "  - {workers: 2, bandwidth: 10Gbps}\ndevice: v100\n")
    cluster = Cluster.load(yaml_file)
    assert cluster.name == "lab" and cluster.workers == 8
    assert cluster.levels[0] == Level(4, 10e9, pytest.approx(10e-6))  # type: ignore[arg-type]
    assert reloaded(cluster, tmp_path) == cluster
    custom = tmp_path / "d.yaml"
    custom.write_text("levels: [{workers: 2, bandwidth: 1e9}]\n"
                      "device: {name: x, memory: 8GiB, flops: 10TFLOPS, mem_bandwidth: 1TB/s}\n")
    device = Cluster.load(custom).device
    assert device.memory == 8 * 2**30 and device.flops == 10e12 and device.mem_bandwidth == 1e12


@pytest.mark.parametrize(
    ("content", "suffix", "expect"),
    [
        ("levels: [{workers: 4}]", ".yaml", "needs 'workers' and 'bandwidth'"),
        ("workers: 4", ".yaml", "needs a 'levels' list"),
        ("levels: [{workers: four, bandwidth: 1e9}]", ".yaml", "'four' is not an integer"),
        ("levels: [{workers: 4, bandwidth: warp}]", ".yaml", "'warp'"),
        ("levels: [{workers: 4, bandwidth: 1e9, colour: red}]", ".yaml", "unknown keys"),
        ("{not json", ".json", "not valid JSON"),
        ("levels: [{workers: 2, bandwidth: 1e9}]\ndevice: {name: x}", ".yaml", "lacks"),
    ],
)
def test_bad_files(tmp_path: Path, content: str, suffix: str, expect: str) -> None:
    file = tmp_path / f"bad{suffix}"
    file.write_text(content)
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    assert expect in str(info.value)
    assert str(file) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    for name in ("nope.yaml", "nope.json"):
        with pytest.raises(ClusterError) as info:
            Cluster.load(tmp_path / name)
        message = str(info.value)
        assert message.startswith(f"cannot read cluster file {str(tmp_path / name)!r}: ")
        assert "No such file or directory" in message
        _assert_shows_a_valid_file(message, tmp_path, name[-5:])
        assert '"4x4@1e10,1.25e9:v100"' in message  # or a string


def _assert_shows_a_valid_file(message: str, tmp_path: Path, suffix: str) -> None:
    """The message ends with a valid cluster file of the same kind, which loads."""
    kind = "JSON" if suffix == ".json" else "YAML"
    assert f"a valid {kind} cluster file:\n" in message
    example = message.split(f"a valid {kind} cluster file:\n", 1)[1].split("\nor give", 1)[0]
    good = tmp_path / f"example{suffix}"
    good.write_text(example)
    assert Cluster.load(good).workers == 16


@pytest.mark.parametrize(
    ("content", "suffix", "line", "problem"),
    [
        ('{"levels": [{"workers": 4, "bandwidth": 1e10},]}', ".json",
         '{"levels": [{"workers": 4, "bandwidth": 1e10},]}',
         "Expecting value, at line 1 column 47"),
        ('{\n "levels": [{"workers": 4 "bandwidth": 1e10}]\n}', ".json",
         ' "levels": [{"workers": 4 "bandwidth": 1e10}]', "delimiter, at line 2 column 27"),
        ("levels: [\n  - workers: 4\n", ".yaml", "  - workers: 4", "at line 2 column 3"),
    ],
)
def test_syntax_errors_quote_the_line_and_show_a_valid_file(
        tmp_path: Path, content: str, suffix: str, line: str, problem: str) -> None:
    file = tmp_path / f"bad{suffix}"
    file.write_text(content)
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    message = str(info.value)
    kind = "JSON" if suffix == ".json" else "YAML"
    assert message.startswith(f"cluster file {file} is not valid {kind}: ")
    assert problem in message
    column = int(problem.rsplit(" ", 1)[1])
    assert f"\n    {line}\n    {' ' * (column - 1)}^\n" in message  # the bad line, marked
    _assert_shows_a_valid_file(message, tmp_path, suffix)


@pytest.mark.parametrize(("text", "fixed"), [("4x4:v200", "4x4:v100"),
                                             ("8x2@300GB/s,25Gbps:h200", "8x2@300GB/s,25Gbps:v100"),
                                             ("16:TPU", "16:v100")])
def test_unknown_device_in_a_string(text: str, fixed: str) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.parse(text)
    message = str(info.value)
    bad = text.rsplit(":", 1)[1]
    assert message.startswith(f"in cluster {text!r}: unknown device {bad!r}; devices are: v100")
    assert message.endswith(f'write e.g. "{fixed}"')
    assert Cluster.parse(fixed).workers == Cluster.parse(fixed.replace(":v100", "")).workers


@given(shape=st.sampled_from(["2", "4x4", "2x2x2"]), blank=st.sampled_from(["", " ", "  "]),
       before=st.sampled_from(["", "@10Gbps", "@1e10~1ms"]),
       mark=st.sampled_from(["@", "~", ":"]))
def test_a_mark_with_nothing_after_it_is_refused(shape: str, blank: str, before: str,
                                                  mark: str) -> None:
    """`4@` (a shell variable that expanded to nothing: `--cluster 4@$BW`), `4@1e10~`, `4:`:
    refused in one line naming the mark. Before, each took the default (1 GB/s, no latency, a
    V100) without a word, where `4x4@1e10,` was refused."""
    levels = shape.count("x") + 1
    head = shape + (before.replace("10Gbps", ",".join(["10Gbps"] * levels))
                    .replace("1e10~1ms", ",".join(["1e10"] * levels) + "~"
                             + ",".join(["1ms"] * levels)))
    if mark == "@" and "@" in head or mark == "~" and "~" in head:
        return  # the mark already has its values
    spec = head + mark + blank
    with pytest.raises(ClusterError, match=f"nothing after '{re.escape(mark)}'"):
        Cluster.parse(spec)
    assert Cluster.parse(head).workers == math.prod(int(c) for c in shape.split("x"))
