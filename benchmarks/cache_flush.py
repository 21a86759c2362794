"""Cold profiles with the flush bounded by what a training step touches, against the flush of
the whole last-level cache, side by side (cost/cache_flush.py).

For each fidelity model (benchmarks/simulator.py) and a tiny two-layer T5-like chain of small
linears, alternating rounds: `annotate_costs(caches="cold")` with the flush as shipped (the
smaller of the cache and the model's step bytes) and with the cache-sized flush, plus a warm
profile. Prints the profile's compute per minibatch (sum of forward and backward over the
nodes) and the seconds each cost pass took. A bounded flush that changed the compute of models
whose step streams more than the cache would be a regression; for models smaller than the
cache, it measures what a pipeline meets (their data stays in the cache between two uses).

    python benchmarks/cache_flush.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pdcompile.cost import node_costs  # noqa: E402
from pdcompile.cost.cache_flush import CacheFlush, last_level_cache_bytes, step_bytes  # noqa: E402
from pdcompile.meta import get_cost  # noqa: E402
from pdcompile.passes.trace import trace  # noqa: E402
from simulator import fidelity_model  # noqa: E402


def small_chain() -> tuple[torch.nn.Module, torch.Tensor]:
    """Four linears of width 64 on minibatches of 8: a model far smaller than any cache."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers), torch.randn(8, 64)


class _WholeCache(CacheFlush):
    """The flush before the bound: the whole last-level cache, whatever the model touches."""

    def __init__(self, device: torch.device, size: int | None = None, *,
                 touched: int | None = None) -> None:
        super().__init__(device, size)


def profile(model: torch.nn.Module, example: torch.Tensor, mode: str) -> tuple[float, float]:
    """Compute per minibatch (ms) of one cost pass, and the pass's wall seconds."""
    gm = trace(model)
    shipped = node_costs.CacheFlush
    if mode == "cold, whole cache":
        node_costs.CacheFlush = _WholeCache  # type: ignore[misc]
    try:
        started = time.perf_counter()
        node_costs.annotate_costs(gm, (example,), caches="warm" if mode == "warm" else "cold")
        seconds = time.perf_counter() - started
    finally:
        node_costs.CacheFlush = shipped  # type: ignore[misc]
    compute = sum(get_cost(n).fwd + get_cost(n).bwd for n in gm.graph.nodes)
    return compute * 1e3, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    llc = last_level_cache_bytes(torch.device("cpu"))
    print(f"last-level cache reported: {llc / 2**20:.0f} MiB")
    models = {"mlp": fidelity_model("mlp")[:2], "cnn": fidelity_model("cnn")[:2],
              "small chain": small_chain()}
    modes = ("cold, bounded", "cold, whole cache", "warm")
    print("| model | step bytes (MiB) | mode | compute per minibatch, ms (rounds) | median | "
          "cost pass s (median) |")
    print("|---|---|---|---|---|---|")
    for name, (model, example) in models.items():
        gm = trace(model)
        from pdcompile.passes.shapes import annotate_shapes
        annotate_shapes(gm, (example,))
        touched = step_bytes(gm, node_costs._outputs(gm))
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                results[mode].append(profile(model, example, mode))
        for mode in modes:
            computes = [c for c, _ in results[mode]]
            seconds = [s for _, s in results[mode]]
            print(f"| {name} | {touched / 2**20:.1f} | {mode} | "
                  f"{' '.join(f'{c:.2f}' for c in computes)} | {statistics.median(computes):.2f} | "
                  f"{statistics.median(seconds):.1f} |")


if __name__ == "__main__":
    main()
