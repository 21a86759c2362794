"""`pdcompile plan`: summary, JSON output, presets in --help, progress, one-line errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pdcompile import Plan
from pdcompile.cli import main
from pdcompile.cli.plan_cmd import Spinner


def test_plan_profile_pipedream_summary(profiles_dir: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    code = main(["plan", "--profile", str(profiles_dir / "vgg16" / "graph.txt"), "--cluster",
                 "16@1e9", "--planner", "dp", "--cost-model", "pipedream"])
    out = capsys.readouterr().out
    assert code == 0
    assert "config 13-2-1 on 16 workers" in out and "56.53 ms per minibatch" in out
    assert "3.04x over data parallel" in out


def test_plan_json_round_trips(profiles_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--profile", str(profiles_dir / "gnmt"), "--cluster", "4", "--planner",
                 "dp", "--straight", "--json", "--cost-model", "pipedream"])
    out = capsys.readouterr().out
    assert code == 0
    result = Plan.from_json(out)
    assert result.config == "straight" and len(result.stages) == 4
    assert json.loads(out)["config"] == "straight"


def test_plan_costgraph_file_with_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    from pdcompile.cost.costgraph import add_block, new_cost_graph, save

    graph = new_cost_graph("tiny")
    for i in range(4):
        add_block(graph, f"l{i}", fwd=1e-3, bwd=2e-3, act=1e6, params=1e6)
        if i:
            graph.add_edge(f"l{i - 1}", f"l{i}")
    save(graph, tmp_path / "g.json")
    code = main(["plan", "--costgraph", str(tmp_path / "g.json"), "--cluster", "2@1e9",
                 "--memory", "1GiB", "--planner", "ilp", "--time-limit", "5", "--json"])
    result = Plan.from_json(capsys.readouterr().out)
    assert code == 0 and result.planner == "ilp" and result.status == "OPTIMAL"
    assert result.extra["memory_limit"] == 2**30


def test_help_lists_cluster_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for preset in ("A ", "B ", "C ", "h100-node", "local"):
        assert preset in out
    assert "--straight" in out and "--time-limit" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--cluster", "4"], "exactly one of"),
    (["plan", "--profile", "/nonexistent/graph.txt"], "cannot read profile"),
    (["plan", "--profile", "PROFILE", "--cluster", "0"], "positive worker count"),
    (["plan", "--profile", "PROFILE", "--memory", "a lot"], "memory"),
    (["plan", "--profile", "PROFILE", "--planner", "ilp", "--cost-model", "pipedream"],
     "native cost model"),
    # refused before the profile is read and the plan made (minutes on a large model)
    (["plan", "--profile", "/nonexistent/graph.txt", "--collapse", "0"],
     "--collapse 0: give a positive node count"),
    (["plan", "--profile", "/nonexistent/graph.txt", "--draw", "p.svg", "--collapse", "-3"],
     "--collapse -3: give a positive node count"),
    (["plan", "--profile", "/nonexistent/graph.txt", "--draw", "p.svg", "--stage", "-1"],
     "--stage -1: give a stage number from 0"),
])
def test_errors_are_one_line(argv: list[str], message: str, profiles_dir: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(profiles_dir / "alexnet") if a == "PROFILE" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdcompile plan: error:") and message in err
    assert err.count("\n") == 1


def test_spinner_reports_slow_work_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import time

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with Spinner("fast", delay=0.5):
        pass
    assert stream.getvalue() == ""
    with Spinner("slow", delay=0.05):
        time.sleep(0.3)
    assert "slow ..." in stream.getvalue() and "slow: done in" in stream.getvalue()


def test_plan_model_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "tiny.py"
    source.write_text(
        "import torch\n"
        "from torch import nn\n\n\n"
        "def factory():\n"
        "    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "    return model, (torch.randn(8, 16),)\n")
    code = main(["plan", f"{source}:factory", "--cluster", "2@1e9", "--planner", "dp",
                 "--analytic", "--json"])
    result = Plan.from_json(capsys.readouterr().out)
    assert code == 0
    nodes = [n for s in result.stages for n in s.nodes]
    assert len(nodes) == len(set(nodes)) >= 4  # the input and the three layers at least
    # microseconds of compute: one worker beats any transfer or all-reduce over 1 GB/s, and
    # the plan says the other idles
    assert sum(s.replicas for s in result.stages) == result.workers == 1
    assert result.extra["idle_workers"].startswith("1 of 2 workers")


@pytest.mark.slow
def test_plan_refine_prints_the_simulated_gain(profiles_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--profile", str(profiles_dir / "alexnet"), "--cluster", "A",
                 "--planner", "dp", "--refine", "150"])
    out = capsys.readouterr().out
    assert code == 0
    assert "refined by simulation" in out and "planner dp+simulation" in out
    code = main(["plan", "--profile", str(profiles_dir / "alexnet"), "--cluster", "A",
                 "--planner", "dp", "--refine", "150", "--json"])
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.planner == "dp+simulation" and "simulated_time_per_minibatch" in plan.extra
    assert main(["plan", "--profile", str(profiles_dir / "alexnet"), "--cluster", "A",
                 "--refine", "0"]) == 1
    assert "--refine 0" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_plan_prices_schedules_with_chunks(schedule: str, profiles_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --schedule` takes every schedule the planner takes: chunks two per worker, in a V
    (chunk c on rank c, then back) or round robin, as `pdcompile.plan` places them."""
    code = main(["plan", "--profile", str(profiles_dir / "gnmt"), "--cluster", "2@1e9",
                 "--schedule", schedule, "--json"])
    assert code == 0
    result = Plan.from_json(capsys.readouterr().out)
    ranks = [stage.ranks for stage in result.stages]
    assert ranks == ([(0,), (1,), (1,), (0,)] if schedule == "zb-v"
                     else [(0,), (1,), (0,), (1,)])
    assert result.schedule == schedule and result.time_per_minibatch > 0
