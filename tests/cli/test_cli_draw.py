"""Drawing the partitioned graph (Pipeline.draw, plan --draw) and the per-stage summary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.pipeline import Pipeline
from pdcompile.viz.plan_graph import costgraph_picture, plan_picture, to_dot


class Skip(nn.Module):
    """Linear layers with a skip connection: the skip crosses a stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.d(self.c(torch.relu(self.b(h))) + h)


def _pipe(stages: int | list[int] = 2) -> Pipeline:
    return pdcompile.compile(Skip(), example_inputs=(torch.randn(6, 8),), stages=stages)


def test_summary_lists_each_stage() -> None:
    pipe = _pipe([2, 1])
    text = pipe.summary()
    header, rule, *rows = text.splitlines()[:4]
    for column in ("stage", "replicas", "ranks", "nodes", "first", "last", "params", "compute",
                   "sends/mb", "comm", "memory"):
        assert column in header
    assert pipe.graph is not None
    assert rows[0].split()[:4] == ["0", "2", "0,1", str(sum(
        1 for n in pipe.graph.graph.nodes if n.meta.get("pd.stage") == 0 and n.op != "output"))]
    assert rows[0].split()[4] == "x"  # first node of stage 0: the input
    params = sum(p.numel() for p in pipe.stage_modules[1].parameters())
    assert f"{params:,}" in rows[1]
    assert "config 2-1 on 3 workers" in text and "schedule 1f1b" in text


def test_summary_of_a_planned_pipeline_has_predictions() -> None:
    pipe = pdcompile.compile(Skip(), "2", example_inputs=(torch.randn(6, 8),), cost="analytic",
                             planner="dp")
    text = pipe.summary()
    assert "predicted" in text and "over data parallel" in text


def test_picture_groups_by_stage_and_labels_cut_edges() -> None:
    pipe = _pipe(2)
    picture = plan_picture(pipe)
    assert pipe.graph is not None
    stage_of = {n.name: n.meta["pd.stage"] for n in pipe.graph.graph.nodes if n.op != "output"}
    assert len(picture.columns) == 2
    for s, column in enumerate(picture.columns):
        assert column and all(stage_of[name] == s for name in column)
    assert picture.titles[0].startswith("stage 0: 1 replica (rank 0)")
    cut = [(a, b, label) for a, b, label in picture.edges if label]
    inner = [(a, b) for a, b, label in picture.edges if not label]
    assert cut and all(stage_of[a] != stage_of[b] for a, b, _ in cut)
    assert all(stage_of[a] == stage_of[b] for a, b in inner)
    # each cut tensor is a float32 [6, 16] activation: 384 bytes per minibatch
    assert all(label == "384 B" for _, _, label in cut)
    text = to_dot(picture)
    assert "subgraph cluster_0" in text and 'label="384 B"' in text


def test_replicas_in_titles_collapse_and_one_stage() -> None:
    pipe = _pipe([2, 1])
    assert plan_picture(pipe).titles[0] == "stage 0: 2 replicas (ranks 0,1)"
    collapsed = plan_picture(pipe, collapse=1)
    assert collapsed.columns == [["stage 0"], ["stage 1"]]
    assert collapsed.labels["stage 0"].startswith(f"{len(plan_picture(pipe).columns[0])} nodes")
    assert [label for _, _, label in collapsed.edges] == ["768 B"]  # h and relu(b(h)) together
    one = plan_picture(pipe, stage=1)
    assert one.columns[0] == ["stage 0"] and len(one.columns[1]) > 1
    with pytest.raises(pdcompile.PdcompileError, match="stage 5 does not exist"):
        plan_picture(pipe, stage=5)


@pytest.mark.parametrize("suffix", ["svg", "png", "dot"])
def test_pipeline_draw_writes_the_file(tmp_path: Path, suffix: str) -> None:
    pipe = _pipe(2)
    path = pipe.draw(str(tmp_path / f"plan.{suffix}"))
    data = Path(path).read_bytes()
    start = {"svg": b"<?xml", "png": b"\x89PNG", "dot": b"digraph"}[suffix]
    assert data.startswith(start)
    assert isinstance(pipe.graph, torch.fx.GraphModule)


def test_draw_rejects_other_formats(tmp_path: Path) -> None:
    with pytest.raises(pdcompile.PdcompileError, match=r"\.svg, \.png or \.dot"):
        _pipe(2).draw(str(tmp_path / "plan.pdf"))


def test_costgraph_picture_of_a_profile(profiles_dir: Path) -> None:
    graph = pdcompile.profiles.load_pipedream(profiles_dir / "vgg16" / "graph.txt")
    plan = pdcompile.plan(graph, "A", planner="dp")
    picture = costgraph_picture(graph, plan)
    assert len(picture.columns) == len(plan.stages)
    assert sum(len(c) for c in picture.columns) == graph.number_of_nodes()
    assert any(label.endswith("MiB") for _, _, label in picture.edges)


@pytest.mark.slow
def test_plan_cli_draw_and_stage(profiles_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "vgg.svg"
    code = main(["plan", "--profile", str(profiles_dir / "vgg16"), "--cluster", "A",
                 "--planner", "dp", "--draw", str(svg), "--stage", "0"])
    assert code == 0 and f"wrote {svg}" in capsys.readouterr().out
    assert "<svg" in svg.read_text()[:400]
    code = main(["plan", "--profile", str(profiles_dir / "vgg16"), "--cluster", "A",
                 "--planner", "dp", "--draw", str(svg), "--stage", "9"])
    assert code == 1 and "stage 9 does not exist" in capsys.readouterr().err
    code = main(["plan", "--profile", str(profiles_dir / "vgg16"), "--cluster", "A",
                 "--planner", "dp", "--stage", "1"])
    assert code == 1 and "add --draw" in capsys.readouterr().err


def test_loaded_pipeline_draws_with_bytes(tmp_path: Path) -> None:
    """An exported pipeline's graph has meta weights; the bytes still come out."""
    pipe = _pipe(2)
    pipe.export(str(tmp_path / "exp"))
    loaded = pdcompile.load(str(tmp_path / "exp"))
    labels = sorted(label for _, _, label in plan_picture(loaded).edges if label)
    assert labels == sorted(label for _, _, label in plan_picture(pipe).edges if label)
    assert loaded.summary().splitlines()[2].split()[:2] == ["0", "1"]
