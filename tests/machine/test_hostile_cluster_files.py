"""Cluster files nobody here wrote: YAML tags that would run code, aliases nested into a
billion values, structures that hold themselves, figures that are zero, negative or NaN, and
random documents, figures so large or small that a transfer's seconds overflow a float. Each
gives a Cluster whose every figure is usable (a plan over it ends, in finite time) or one
ClusterError, fast; nothing of the file runs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.errors import ClusterError
from pdcompile.machine.cluster import MAX_CLUSTER_FILE_BYTES, Cluster
from tests.helpers.byte_damage import bounded


def _aliases(depth: int, width: int) -> str:
    """YAML whose anchor a<depth> expands to width**depth values ("billion laughs")."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["levels:\n - *a5\n", "levels:\n - {workers: 2, bandwidth: "
                                   "1e9}\ndevice: {memory: *a5}\n",
                                   "levels:\n - {workers: 2, bandwidth: *a5}\n"])
def test_nested_aliases_are_refused_without_expanding_them(tmp_path: Path, where: str) -> None:
    """10**6 values once expanded (the old code printed them all in its message; a few more
    levels of nesting and it never finished)."""
    file = tmp_path / "bomb.yaml"
    file.write_text(_aliases(5, 16) + where)
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    assert "aliases" in str(info.value) and str(file) in str(info.value)
    assert len(str(info.value)) < 2000


def test_a_structure_that_holds_itself_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "loop.yaml"
    file.write_text("levels: &l\n - {workers: 2, bandwidth: 1e9, latency: *l}\n")
    with pytest.raises(ClusterError, match="refers to itself"):
        Cluster.load(file)


def test_python_tags_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    file = tmp_path / "tag.yaml"
    file.write_text("levels:\n - {workers: 2, bandwidth: 1e9}\nname: !!python/object/apply:"
                    f"os.system [\"touch {marker}\"]\n")
    with pytest.raises(ClusterError, match="constructor for the tag"):
        Cluster.load(file)
    assert not marker.exists()


@pytest.mark.parametrize(("text", "culprit"), [
    ("device: {memory: 16GiB, flops: 0, mem_bandwidth: 900GB/s}", "flops 0.0"),
    ("device: {memory: .nan, flops: 1.0e+12, mem_bandwidth: 900GB/s}", "memory nan"),
    ("device: {memory: -1.0, flops: 1.0e+12, mem_bandwidth: 900GB/s}", "memory -1.0"),
    ("device: {memory: 16GiB, flops: 1.0e+12, mem_bandwidth: 0}", "mem_bandwidth 0.0"),
    ("device: {memory: 16GiB, flops: 1.0e+12, mem_bandwidth: 1.0e+9, flops_lowp: -2.0}",
     "flops_lowp -2.0"),
    ("device: {memory: [1], flops: 1.0e+12, mem_bandwidth: 1.0e+9}", "memory"),
])
def test_a_device_of_zero_negative_or_nan_figures_is_refused(tmp_path: Path, text: str,
                                                             culprit: str) -> None:
    file = tmp_path / "cluster.yaml"
    file.write_text("levels:\n - {workers: 2, bandwidth: 1.0e+9}\n" + text + "\n")
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    assert culprit in str(info.value) and str(file) in str(info.value)


def test_a_nan_latency_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yaml"
    file.write_text("levels:\n - {workers: 2, bandwidth: 1.0e+9, latency: .nan}\n")
    with pytest.raises(ClusterError, match="latency nan s"):
        Cluster.load(file)


_SCALARS = (st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats()
            | st.sampled_from(["10GB/s", "10us", "v100", "16GiB", "fast", "", "1e9", "-4"]))
_KEYS = st.sampled_from(["levels", "workers", "bandwidth", "latency", "device", "memory",
                         "flops", "mem_bandwidth", "flops_lowp", "groups", "speed", "cores",
                         "cpu_copies", "allreduce_bucket", "name", "flow_bandwidth",
                         "allreduce_bandwidth", "other"])
_DOCS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_KEYS, inner, max_size=6), max_leaves=24)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(_KEYS, _DOCS, max_size=5), as_json=st.booleans())
def test_random_documents_give_a_usable_cluster_or_a_cluster_error(
        tmp_path: Path, doc: dict[str, object], as_json: bool) -> None:
    file = tmp_path / ("cluster.json" if as_json else "cluster.yaml")
    file.write_text(json.dumps(doc) if as_json else yaml.safe_dump(doc))
    try:
        cluster = Cluster.load(file)
    except ClusterError:
        return
    devices = [cluster.device, *(group.device for group in cluster.groups)]
    figures = [d.memory for d in devices] + [d.flops for d in devices] + [
        d.mem_bandwidth for d in devices] + [level.bandwidth for level in cluster.levels]
    assert all(value > 0 and math.isfinite(value) for value in figures), cluster
    assert all(0 <= level.latency <= 3600 for level in cluster.levels), cluster
    assert all(1 <= bandwidth < math.inf for level in cluster.levels
               for bandwidth in (level.bandwidth, level.flow_bandwidth,
                                 level.allreduce_bandwidth) if bandwidth is not None), cluster
    assert all(not math.isnan(group.speed) and group.speed > 0 for group in cluster.groups)


# each of these hung the planner (a bisection between a finite and an infinite period, Howard's
# cycle ratio on 1e300 s) or failed in a traceback (a NaN memory limit, an infinite bucket
# count, CP-SAT refusing a coefficient of 1e30 bytes' time)
_OVERFLOWING = [
    ("levels: [{workers: 2, bandwidth: 1.0e-300}]", "bandwidth 1e-300"),
    ("levels: [{workers: 2, bandwidth: .inf}]", "bandwidth inf"),
    ("levels: [{workers: 2, bandwidth: 1.0e+9, latency: .inf}]", "latency inf"),
    ("levels: [{workers: 2, bandwidth: 1.0e+9, latency: 1.0e+300}]", "latency 1e+300"),
    ("levels: [{workers: 2, bandwidth: 1.0e+9, flow_bandwidth: 1.0e-300}]",
     "flow_bandwidth 1e-300"),
    ("levels: [{workers: 2, bandwidth: 1.0e+9, allreduce_bandwidth: 1.0e-300}]",
     "allreduce_bandwidth 1e-300"),
    ("{levels: [{workers: 2, bandwidth: 1.0e+9}], allreduce_bucket: .inf}", "allreduce_bucket inf"),
    ("{levels: [{workers: 2, bandwidth: 1.0e+9}], allreduce_bucket: 1.0e-300}",
     "allreduce_bucket 1e-300"),
    ("{levels: [{workers: 2, bandwidth: 1.0e+9}], allreduce_bucket: 1.0e+30}",
     "allreduce_bucket 1e+30"),
    ("{levels: [{workers: 2, bandwidth: 1.0e+9}], device: {memory: .inf, flops: 1.0e+12, "
     "mem_bandwidth: 900GB/s}}", "memory inf"),
    ("{levels: [{workers: 3, bandwidth: 1.0e+9}], device: {memory: 16GiB, flops: 1.0e+12, "
     "mem_bandwidth: 1.0e-300}}", "mem_bandwidth 1e-300"),
    ("{levels: [{workers: 2, bandwidth: 1.0e+9}], groups: [{device: {memory: 16GiB, flops: "
     ".inf, mem_bandwidth: 1.0e+9}, workers: 2}]}", "flops inf"),
]


@pytest.mark.parametrize(("text", "culprit"), _OVERFLOWING)
def test_figures_whose_seconds_overflow_are_refused_naming_them(tmp_path: Path, text: str,
                                                                culprit: str) -> None:
    file = tmp_path / "cluster.yaml"
    file.write_text(text + "\n")
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    assert culprit in str(info.value) and str(file) in str(info.value)


@pytest.mark.parametrize("text", ["2@1e-300", "2@1e10~1e300s", "2x2@1e10,0.5"])
def test_short_forms_whose_seconds_overflow_are_refused(text: str) -> None:
    with pytest.raises(ClusterError, match="bandwidth|latency"):
        Cluster.parse(text)


@pytest.mark.parametrize("text", [
    "{levels: [{workers: 2, bandwidth: 1, latency: 3600, flow_bandwidth: 1, "
    "allreduce_bandwidth: 1}], allreduce_bucket: 1}",
    "{levels: [{workers: 2, bandwidth: 1.0e+300}, {workers: 2, bandwidth: 1}], "
    "device: {memory: 1.0e+300, flops: 1.0e+300, mem_bandwidth: 1.0e+300}}",
    "{levels: [{workers: 3, bandwidth: 1, latency: 3600}], allreduce_bucket: 1.0e+15, "
    "device: {memory: 16GiB, flops: 1, mem_bandwidth: 1}}",
])
def test_a_cluster_at_the_bounds_plans_in_finite_time(tmp_path: Path, text: str) -> None:
    """The figures the checks let through at their edges: planning a PipeDream profile on them
    ends with a finite time per minibatch (the alarm is a guard against a hang)."""
    import signal

    import pdcompile
    from pdcompile.profiles import load_pipedream

    file = tmp_path / "cluster.yaml"
    file.write_text(text + "\n")

    def hung(signum: int, frame: object) -> None:
        raise AssertionError(f"planning on {text} ran past 120 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        plan = pdcompile.plan(load_pipedream("alexnet"), Cluster.load(file))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert math.isfinite(plan.time_per_minibatch) and plan.time_per_minibatch > 0


def test_a_plan_over_a_hundred_thousand_ranks_is_checked_at_once() -> None:
    """A cluster file declaring 100,000 workers (a few zeros too many): the plan over them is
    checked in linear time. Before, Plan's check of ranks shared between stages counted each
    rank in the whole list (quadratic: 13 s at 30,000 ranks, minutes at 100,000, so planning
    vgg16 on `100000@10GB/s` ran past a minute); now it is built in milliseconds. The alarm is
    a guard against a hang, not a speed target (benchmarks/ hold those)."""
    import signal

    from pdcompile.plan import Plan, Stage

    n = 100_000
    stage = Stage(nodes=("a",), replicas=n, ranks=tuple(range(n)), compute=0.0, sync=0.0,
                  comm=0.0, memory=0.0, time=0.0)

    def hung(signum: int, frame: object) -> None:
        raise AssertionError("checking a plan of 100,000 ranks took over 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        plan = Plan(stages=(stage,), time_per_minibatch=0.0, dp_time=0.0, workers=n,
                    cost_model="native", planner="manual", status="GIVEN")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert plan.workers == n and plan.stages[0].ranks[-1] == n - 1


@pytest.mark.parametrize("kind", ["fifo", "over-the-limit", "folder"])
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_cluster_file_that_is_no_plain_file_of_its_size_is_refused_unread(
        tmp_path: Path, kind: str, suffix: str) -> None:
    """A FIFO, a file one byte over the limit or a folder named as the cluster file: one
    ClusterError naming it, what it is and the fix, at once. Before, the FIFO waited for a
    writer forever, a sparse file of a gigabyte was read whole (2.2 GB of memory); a folder
    now reads as the others do."""
    file = tmp_path / f"cluster{suffix}"
    if kind == "fifo":
        os.mkfifo(file)
    elif kind == "folder":
        file.mkdir()
    else:
        with file.open("wb") as handle:  # sparse: no disk used
            handle.truncate(MAX_CLUSTER_FILE_BYTES + 1)
    what = {"fifo": "is not a plain file but a FIFO",
            "over-the-limit": f"holds {MAX_CLUSTER_FILE_BYTES + 1:,} bytes, more than 3 times "
                              f"a file of 100,000 values, the most one may hold "
                              f"({MAX_CLUSTER_FILE_BYTES:,})",
            "folder": "is a folder, not a plain file"}[kind]
    with bounded(5), pytest.raises(ClusterError) as info:
        Cluster.load(file)
    message = str(info.value)
    assert message.startswith(f"cluster file {file} {what}"), message
    assert "or the cluster as a string" in message and "\n" not in message


def test_a_cluster_file_at_the_value_limit_fits_the_byte_limit(tmp_path: Path) -> None:
    """The byte limit's figure: a file of (nearly) as many values as a cluster file may hold,
    written out plainly as indented JSON, reads to its values' refusal, not the size's."""
    groups = [{"device": "a100-80gb", "workers": 16, "speed": 0.8125}] * 16_000
    file = tmp_path / "many.json"
    file.write_text(json.dumps({"levels": [{"workers": 8, "bandwidth": 1e9}],
                                "groups": groups}, indent=2))
    assert 3 * file.stat().st_size < MAX_CLUSTER_FILE_BYTES
    with pytest.raises(ClusterError, match="expands to more than 100,000 values"):
        Cluster.load(file)


def test_a_cluster_file_that_is_not_text_is_one_cluster_error(tmp_path: Path) -> None:
    """Before, a file that is not UTF-8 raised UnicodeDecodeError out of Cluster.load (a
    traceback at the command line)."""
    file = tmp_path / "cluster.yaml"
    file.write_bytes(b"levels:\n - {workers: 2, bandwidth: 1e9}\nname: \xff\xfe\n")
    with pytest.raises(ClusterError) as info:
        Cluster.load(file)
    assert str(info.value).startswith(f"cluster file {file} is not text (byte 46 is not UTF-8)")
