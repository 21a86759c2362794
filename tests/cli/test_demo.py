"""`pdcompile demo` at the reduced CI setting: real processes, timelines, plan, cluster A."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.cli import main
from pdcompile.timeline import Timeline


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_demo_trains_and_writes_the_timelines(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    code = main(["demo", "--quick", "--workers", "2", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    text = printed.out
    # the plan (Pipeline.summary), the losses, predicted against measured, cluster A
    assert "## 2. plan for local-2" in text and "first" in text and "sends/mb" in text
    # the planner, free to replicate, chooses a pipeline and says why (weights against compute)
    assert "config straight on 2 workers" in text
    why = next(line for line in text.splitlines() if line.startswith("why straight: "))
    assert "data parallelism would compute" in why and "all-reduce all" in why
    assert float(why.split("x faster")[0].rsplit(" ", 1)[1]) > 1.0
    assert "two predictions, both from the profile" in text
    wrote = next(line for line in text.splitlines() if line.startswith(f"wrote {out}/: "))
    named = wrote.split(": ", 1)[1].split(" (")[0].split(", ")
    assert len(named) >= 15 and all((out / name).exists() for name in named), wrote
    assert "torch.distributed, gloo" in text
    assert "losses: " in text and "samples/s" in text
    assert "time per minibatch: predicted" in text and "measured" in text
    assert "predicted speed-up over data parallelism on cluster A:" in text
    figures = json.loads((out / "demo.json").read_text())
    assert figures["backend"] == "distributed" and figures["workers"] == 2
    assert len(figures["losses"]) == 12
    assert all(loss == loss and 0 < loss < 10 for loss in figures["losses"])
    assert figures["cluster_a_speedup_over_dp"] >= 1.0 - 1e-9
    assert figures["measured_time_per_minibatch"] > 0
    assert figures["predicted_time_per_minibatch"] > 0
    for name in ("predicted", "measured"):
        line = Timeline.load(out / f"{name}_timeline.json")
        assert line.ranks == [0, 1]
        # every one of the 12 minibatches ran forward on both stages
        forwards = {e.action for e in line.events if e.action[1:2] == "F"}
        assert {f"0F{i}" for i in range(12)} <= forwards
        assert {f"1F{i}" for i in range(12)} <= forwards
        assert (out / f"{name}_gantt.png").stat().st_size > 1000
        assert "<svg" in (out / f"{name}_gantt.svg").read_text()[:500]
        trace = json.loads((out / f"{name}_trace.json").read_text())
        assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert "<svg" in (out / "plan.svg").read_text()[:500]
    assert (out / "pipeline" / "plan.json").is_file()
    assert "## 5. the same model on PipeDream's cluster A" in (out / "demo.md").read_text()


@pytest.mark.slow
def test_demo_local_backend_learns(tmp_path: Path) -> None:
    """The local backend path (no processes): the loss of the synthetic task falls."""
    import io

    from pdcompile.demo import DemoSize, run_demo

    size = DemoSize(steps=24, batch_size=16, image_size=8, hidden=128, depth=3, repeats=1)
    result = run_demo(out=tmp_path, size=size, backend="local", stream=io.StringIO(),
                      progress=False, lr=3e-3)
    assert result.backend == "local" and len(result.losses) == 24
    assert sum(result.losses[-4:]) / 4 < sum(result.losses[:4]) / 4
    assert (tmp_path / "measured_gantt.png").is_file()


@pytest.mark.parametrize(("argv", "usage", "expect"), [
    (["demo", "--steps", "1"], False, "too few to fill a pipeline"),
    (["demo", "--steps", "0"], False, "--steps takes a positive number"),
    (["demo", "--workers", "9"], True, "invalid choice"),
    (["demo", "--backend", "nccl"], True, "invalid choice"),
])
def test_demo_bad_options(argv: list[str], usage: bool, expect: str, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """Option errors (argparse's and the demo's own): one line, exit status 1."""
    if usage:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(tmp_path)])
        assert exit_info.value.code == 1
    else:
        assert main([*argv, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1
    assert err.startswith("pdcompile demo: error:")


def test_training_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    import io
    import time

    from pdcompile.demo import TrainingProgress

    stream = io.StringIO()
    progress = TrainingProgress(16, 8, stream=stream, bar=False)
    for step in range(16):
        time.sleep(0.01)
        progress(step, 2.0 - step / 10)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].strip() == "minibatch    1/16  loss  2.0000"
    assert lines[-1].startswith("  minibatch   16/16  loss  0.5000") and "samples/s" in lines[-1]
    assert len(lines) == 1 + 8  # the first, then every 2nd of 16
    # losses reported all at once (a one-stage pipeline reports at the end): no made-up rate
    burst = io.StringIO()
    progress = TrainingProgress(4, 8, stream=burst, bar=False)
    for step in range(4):
        progress(step, 1.0)
    assert "samples/s" not in burst.getvalue()
