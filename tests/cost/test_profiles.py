"""PipeDream profile reader: all 14 shipped profiles, checked against an independent parse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdcompile.cost import costgraph
from pdcompile.errors import ProfileError
from pdcompile.profiles import load_pipedream

MODELS = ["alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge",
          "nasnetamobile", "resnet101", "resnet18", "resnet50", "resnext101", "resnext50",
          "squeezenet1_0", "vgg16"]

_COSTS = re.compile(r"forward_compute_time=([^,]+), backward_compute_time=([^,]+), "
                    r"activation_size=(\[[^\]]*\]|[^,]+), parameter_size=(\S+)\s*$")


def _independent_totals(file: Path) -> tuple[dict[str, float], int, int]:
    """Sums straight from the text (ms -> s), node and edge counts: no code shared with the
    reader."""
    sums = {"fwd": 0.0, "bwd": 0.0, "act": 0.0, "params": 0.0}
    nodes = edges = 0
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        if line.startswith("\t"):
            edges += 1
            continue
        match = _COSTS.search(line)
        assert match, line
        nodes += 1
        fwd, bwd, act, params = match.groups()
        sums["fwd"] += float(fwd) / 1000
        sums["bwd"] += float(bwd) / 1000
        sums["act"] += sum(float(a) for a in act.strip("[]").split(";"))
        sums["params"] += float(params)
    return sums, nodes, edges


def test_all_fourteen_are_shipped(profiles_dir: Path) -> None:
    assert sorted(p.parent.name for p in profiles_dir.glob("*/graph.txt")) == MODELS


@pytest.mark.parametrize("model", MODELS)
def test_profile_totals_match_the_file(profiles_dir: Path, model: str) -> None:
    file = profiles_dir / model / "graph.txt"
    graph = load_pipedream(file)
    costgraph.validate(graph)
    want, nodes, edges = _independent_totals(file)
    got = costgraph.totals(graph)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    assert graph.number_of_nodes() == nodes and graph.number_of_edges() == edges
    assert graph.graph["name"] == model
    # a directory works as well as the file
    assert costgraph.totals(load_pipedream(file.parent)) == got


def test_known_figures(profiles_dir: Path) -> None:
    vgg = load_pipedream(profiles_dir / "vgg16" / "graph.txt")
    # VGG-16 has 138.4 million fp32 parameters
    assert costgraph.totals(vgg)["params"] / 4 == pytest.approx(138.36e6, rel=1e-3)
    # the input node carries a batch of 128 images of 3x224x224 fp32
    assert vgg.graph["input_bytes"] == 128 * 3 * 224 * 224 * 4
    gnmt = load_pipedream(profiles_dir / "gnmt" / "graph.txt")
    lstm = gnmt.nodes["node7"]
    assert lstm["act"] == 6291456.0 + 131072.0 + 131072.0  # a list of outputs is summed
    assert lstm["fwd"] == pytest.approx(3.190e-3) and "LSTM" in lstm["label"]


_GOOD = ("node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
         "activation_size=100.0, parameter_size=0.000\n"
         "node2 -- ReLU() -- forward_compute_time=1.000, backward_compute_time=2.000, "
         "activation_size=100.0, parameter_size=0.000\n")


@pytest.mark.parametrize(
    ("text", "line", "expect"),
    [
        (_GOOD + "node3 -- Linear -- forward_compute_time=abc, backward_compute_time=1, "
                 "activation_size=1, parameter_size=1\n", 3, "'abc' is not a number"),
        (_GOOD + "node3 Linear forward\n", 3, "a node line is like"),
        (_GOOD + "node3 -- Linear -- forward_compute_time=1, activation_size=1, "
                 "parameter_size=1\n", 3, "lacks backward_compute_time"),
        (_GOOD + "\tnode1 -- node9\n", 3, "'node9', which has no node line"),
        (_GOOD + "\tnode1 node2\n", 3, "an edge line is"),
        (_GOOD + _GOOD.splitlines()[1] + "\n", 3, "defined twice"),
        ("node1 -- X -- forward_compute_time=-1, backward_compute_time=1, activation_size=1, "
         "parameter_size=1\n", 1, "non-negative"),
    ],
)
def test_broken_line_gives_file_and_line(tmp_path: Path, text: str, line: int,
                                         expect: str) -> None:
    file = tmp_path / "graph.txt"
    file.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_pipedream(file)
    assert f"{file}:{line}:" in str(info.value)
    assert expect in str(info.value)


def test_unreadable_and_empty(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_pipedream(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ProfileError, match="no node lines"):
        load_pipedream(empty)


def test_good_small_profile(tmp_path: Path) -> None:
    file = tmp_path / "tiny.txt"
    file.write_text(_GOOD + "\tnode1 -- node2\n")
    graph = load_pipedream(file)
    assert list(graph.edges) == [("node1", "node2")]
    assert graph.nodes["node2"]["bwd"] == pytest.approx(0.002)
    assert graph.graph["name"] == "tiny"
