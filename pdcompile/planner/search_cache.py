"""What one planning call has already built and priced, so that it builds and prices nothing twice.

Why: a search simulates many plans whose schedules are the same (a move of a stage boundary
changes the stages' nodes, not which ranks run what, so the lowered schedule is the same) and
prices some plans more than once (the mixed planner's candidates coincide; its descents over
rank sets meet the same neighbours step after step). On VGG-16 over 8 A100 and 8 V100 the mixed
planner built 335 schedules of 106 distinct ones, and building and validating them was 14 s of
its 36. A `SearchCache` lives for one call of `plan` (made there, handed down to everything that
builds or prices, never kept in a module), so nothing outlives the search that filled it.

Three tables:
- schedules, by everything `schedule.build` is given: the lowered, validated schedule and what
  the simulator works out from it alone (`backends.simulate.prepare`); a build that failed fails
  again from the table with the same error;
- prices, by everything `price_plan` reads of its inputs: what it worked out (its candidate,
  the simulator's time, data parallelism's), from which it makes its plan as before;
- whatever else a search makes again from the same inputs (`made`): the DP's coarsened graph,
  which every DP of a wide flat cluster's search (over all workers, over groups, straight)
  coarsened anew (GPT-2 XL on 24 H100: 8 times, a quarter of the planning time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from pdcompile.backends.simulate import Prepared, prepare
from pdcompile.errors import ScheduleError
from pdcompile.schedule.build import build
from pdcompile.schedule.ir import Schedule


class SearchCache:
    """The schedules and prices of one planning call (module docstring). `builds` and
    `schedule_hits`, `prices` and `price_hits`: how many were made and how many found again."""

    def __init__(self) -> None:
        self._schedules: dict[Hashable, tuple[Schedule, Prepared] | ScheduleError] = {}
        self._prices: dict[Hashable, tuple[Any, Any]] = {}
        self._made: dict[Hashable, tuple[Any, Any]] = {}
        self.builds = 0
        self.schedule_hits = 0
        self.prices = 0
        self.price_hits = 0

    def schedule(self, name: str, stage_ranks: Sequence[Sequence[int]], microbatches: int, *,
                 per_minibatch: int, stage_edges: Sequence[tuple[int, int]] | None,
                 warmup: Sequence[int] | None, recompute: Sequence[int],
                 shares: Sequence[Sequence[int]] | None) -> tuple[Schedule, Prepared]:
        """`schedule.build` of these arguments and its `prepare`, each made once per search."""
        key = (name, tuple(tuple(r) for r in stage_ranks), microbatches, per_minibatch,
               None if stage_edges is None else tuple(tuple(e) for e in stage_edges),
               None if warmup is None else tuple(warmup), tuple(recompute),
               None if shares is None else tuple(tuple(s) for s in shares))
        found = self._schedules.get(key)
        if found is None:
            self.builds += 1
            try:
                # prepare's execution order is the validation's deadlock run (the W actions
                # it adds after sends wait on nothing else), so that run is not made twice
                lowered = build(name, stage_ranks, microbatches, per_minibatch=per_minibatch,
                                stage_edges=stage_edges, warmup=warmup, recompute=recompute,
                                shares=shares, progress=False)
                found = (lowered, prepare(lowered))
            except ScheduleError as err:
                found = err
            self._schedules[key] = found
        else:
            self.schedule_hits += 1
        if isinstance(found, ScheduleError):
            raise found
        return found

    def price(self, key: Hashable, keep: Any, work: Callable[[], Any]) -> Any:
        """`work()` once per `key` in this search; `keep`: what the key names by identity (a
        graph), held as long as the table so that its id is not another object's."""
        found = self._prices.get(key)
        if found is None:
            self.prices += 1
            found = (keep, work())
            self._prices[key] = found
        else:
            self.price_hits += 1
        return found[1]

    def made(self, key: Hashable, keep: Any, make: Callable[[], Any]) -> Any:
        """`make()` once per `key` in this search (`keep` as in `price`); the caller must not
        change what it returns."""
        found = self._made.get(key)
        if found is None:
            found = (keep, make())
            self._made[key] = found
        return found[1]


__all__ = ["SearchCache"]
