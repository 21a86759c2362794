"""Random stage costs and rank layouts for the simulator's property tests."""

from __future__ import annotations

import random

from pdcompile.cost.stage_costs import StageCosts

SHAPES = [[[0], [1]], [[0], [1], [2]], [[0], [1], [2], [3]], [[0, 1], [2]], [[0], [1, 2]],
          [[0, 1], [2, 3]], [[0, 1, 2, 3]]]


def random_costs(rng: random.Random, stages: int, *, free_links: bool = False) -> StageCosts:
    edges = {(s, s + 1): 0.0 if free_links else rng.uniform(0.0, 3.0) for s in range(stages - 1)}
    return StageCosts(fwd=tuple(rng.uniform(0.2, 2.0) for _ in range(stages)),
                      bwd=tuple(rng.uniform(0.2, 3.0) for _ in range(stages)),
                      params=tuple(0.0 if free_links else rng.uniform(0.0, 2.0)
                                   for _ in range(stages)),
                      edges=edges,
                      optimizer=tuple(rng.uniform(0.0, 0.5) for _ in range(stages)),
                      stash=tuple(rng.uniform(0.0, 0.3) for _ in range(stages)))
