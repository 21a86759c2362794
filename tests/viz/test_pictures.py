"""Pictures read whole: node labels are shortened at argument boundaries (never cut inside a
token), the title of a drawn graph fits its picture, and the Gantt legend explains the shades
and the blanks."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib import image

from pdcompile.timeline import Event, Timeline
from pdcompile.viz.gantt import draw_gantt
from pdcompile.viz.plan_graph import LABEL_CHARS, costgraph_picture, short_label, write_picture


@pytest.mark.parametrize(("text", "limit", "expect"), [
    ("ReLU()", 20, "ReLU()"),
    ("Conv2d(3, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))", 40,
     "Conv2d(3, 16, kernel_size=(3, 3), ...)"),
    ("Linear(in_features=4096, out_features=512, bias=True)", 40,
     "Linear(in_features=4096, ...)"),
    ("MaxPool2d(kernel_size=2, stride=2)", 14, "MaxPool2d(...)"),
])
def test_labels_are_shortened_between_arguments(text: str, limit: int, expect: str) -> None:
    assert short_label(text, limit) == expect
    assert len(short_label(text, limit)) <= limit


def test_a_long_title_widens_the_picture(tmp_path: Path) -> None:
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_node("a", fwd=1e-3, bwd=1e-3, act=4.0, params=0.0,
                   label="Conv2d(3, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))")
    graph.add_node("b", fwd=1e-3, bwd=1e-3, act=4.0, params=0.0, label="ReLU()")
    graph.add_edge("a", "b")
    picture = costgraph_picture(graph)
    assert picture.labels["a"].endswith(", ...)") and len(picture.labels["a"].split("\n")[1]) \
        <= LABEL_CHARS
    short, long = tmp_path / "short.png", tmp_path / "long.png"
    write_picture(picture, short, "g")
    title = "pdcompile.models.some_model_with_a_long_name:factory: 2 nodes (edges: bytes per " \
            "minibatch)"
    write_picture(picture, long, title)
    width_short = image.imread(str(short)).shape[1]
    width_long = image.imread(str(long)).shape[1]
    # about 7.5 pixels per character at 9 points and 100 dpi
    assert width_long > width_short and width_long >= 7.5 * len(title)


def test_gantt_legend_explains_shades_and_blanks(tmp_path: Path) -> None:
    events = [Event(0, f"0F{i}", 2.0 * i, 2.0 * i + 1.0) for i in range(3)]
    events += [Event(0, f"0B{i}", 2.0 * i + 1.0, 2.0 * i + 1.5) for i in range(3)]
    svg = tmp_path / "g.svg"
    draw_gantt(Timeline(events, "predicted", {"schedule": "1f1b"}), svg)
    text = svg.read_text()
    for words in ("light and dark shades alternate between consecutive minibatches",
                  "idle (bubble)", "forward", "backward", "optimizer step"):
        assert words in text, words
