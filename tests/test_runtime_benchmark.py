"""benchmarks/runtime.py's reading of its rounds: ratios are taken pass by pass (a round against
the reference's round of the same pass), so a drift of the machine over a run moves both sides
of each ratio alike, and the table shows them with their range."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_runtime", ROOT / "benchmarks/runtime.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_runtime"] = module
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=6), st.floats(1.0, 2.5),
       st.lists(st.floats(1.0, 3.0), min_size=6, max_size=6))
def test_a_ratio_is_taken_pass_by_pass_so_a_common_drift_cancels(base: list[float], speedup: float,
                                                                 drift: list[float]) -> None:
    """Whatever slows a whole pass (drift) slows both sides of its ratio: every ratio is the
    true speed-up, which a ratio of medians over passes of different drifts is not."""
    single = [b * d for b, d in zip(base, drift, strict=False)]
    times = {"single": single, "ours": [s / speedup for s in single]}
    ratios = BENCH._pass_ratios(times, "ours", "single")
    assert len(ratios) == len(single)
    assert all(abs(r - speedup) < 1e-9 * speedup for r in ratios)


def test_the_table_shows_medians_ranges_and_the_cpu_of_the_reference() -> None:
    times = {"single": [1.0, 2.0, 1.0], "pp-interleaved": [0.8, 1.6, 1.0],
             "ours-interleaved": [0.5, 1.0, 0.5]}
    cpu = {"single": [0.9, 0.95, 0.9]}
    text = BENCH.table(list(times), times, cpu, rounds=3, steps=8, warmup_passes=1)
    assert "| (a) one process, one thread | 2048.0 (1024.0-2048.0) | 1.00x (1.00x-1.00x) |" in text
    # pass by pass: 2.0, 2.0, 2.0 (a ratio of medians would also say 2.0 here) ...
    assert "| 2.00x (2.00x-2.00x) |" in text
    # ... and ours / torch 1.60, 1.60, 2.00 pass by pass: median 1.60x
    assert "| ours-interleaved / pp-interleaved | 1.60x (1.60x-2.00x) |" in text
    assert "single, CPU / wall seconds per round, in the order run: 0.90 / 1.00, 0.95 / 2.00, " \
           "0.90 / 1.00" in text


def test_a_config_of_one_process_returns_wall_then_cpu_seconds() -> None:
    """(a) runs in a launched process of its own and hands back its CPU seconds too."""
    assert {"single", "single-8"} <= BENCH.WITH_CPU
    assert set(BENCH.WITH_CPU) <= set(BENCH.CONFIGS)
