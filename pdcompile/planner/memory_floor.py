"""Lower bounds on the memory per worker that any plan needs: what proves a refusal before the
search runs.

A stage holds its weights, their gradients and optimizer state, and at least one microbatch's
kept activations (costmodel.stage_parts: whatever the schedule, recomputation or in-flight
count, `fit >= 1` needs `limit >= P (2 + s) + K`, stashed versions and tied copies only add).
So every plan needs at least:

* `NodeFloor`: the largest node's share on one worker, the graph's inputs (pinned to the first
  stage) together on one, and the sum over all nodes spread over every worker;
* `least_memory`: over the DP's own states, the least memory at which some chain of at most
  `stages` states has every stage within it (a relaxation of the DP: it drops the time
  objective, replicas, units and ties). Where it exceeds the limit, no DP on those states finds
  a plan, and the DP's grid (seconds per 1,000 states) need not be built.

Refusals were the planner's slowest case: a drawn 1,546-node DAG on 6 servers of 8, one node of
931 GiB against 16 GiB workers, ran every DP of the search and 13 solves of the refusal's
memory search (33 s of CPU), all but the last few certain to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from pdcompile.cost.crossing import input_nodes
from pdcompile.planner.costmodel import ModelOptions
from pdcompile.schedule.kinds import kind

# relative slack on a bound before it refuses: the DP's own sums round differently
SLACK = 1e-9


def weight_factor(options: ModelOptions) -> float:
    """Bytes per parameter byte a stage holds with one microbatch in flight: weights, gradients,
    optimizer state, and the stashed versions a schedule keeps whatever its in-flight count."""
    versions = kind(options.schedule).stashed_versions
    extra = 0.0 if versions == "in-flight" else max(0, int(versions) - 1)
    return 2.0 + options.optimizer_state + extra


@dataclass(frozen=True)
class NodeFloor:
    """What the nodes alone demand of a plan (bytes per worker)."""

    node: str  # the node needing the most on its own
    node_weights: float  # its weights, gradients, optimizer state (and fixed stashed versions)
    node_activations: float  # its kept activations of one microbatch
    inputs: float  # the graph's inputs together (they sit on the first stage)
    total: float  # every node's share, summed

    @property
    def largest(self) -> float:
        """The most one worker must hold whatever the plan."""
        return max(self.node_weights + self.node_activations, self.inputs)

    def on(self, workers: int) -> float:
        """The least memory per worker of any plan on at most `workers` workers."""
        return max(self.largest, self.total / workers)


def node_floor(graph: nx.DiGraph, options: ModelOptions) -> NodeFloor:
    """`NodeFloor` of `graph` (the native model's node attributes) under `options`."""
    factor, m = weight_factor(options), options.per_minibatch
    best = ("", 0.0, 0.0)
    total = inputs = 0.0
    pinned = set(input_nodes(graph))
    for name, data in graph.nodes(data=True):
        weights = float(data.get("params", 0.0)) * factor
        acts = float(data.get("keep", data.get("act", 0.0))) / m
        total += weights + acts
        if name in pinned:
            inputs += weights + acts
        if not best[0] or weights + acts > best[1] + best[2]:
            best = (str(name), weights, acts)
    return NodeFloor(best[0], best[1], best[2], inputs, total)


def least_memory(params: np.ndarray, keep: np.ndarray, valid: np.ndarray, stages: int,
                 options: ModelOptions, *, floor: float = 0.0) -> float:
    """A lower bound on the memory per worker of any DP plan over states with cumulative
    `params` and `keep` (dp.StateTables: state 0 is the empty downset and holds the pinned
    inputs, charged to the first stage) and transitions `valid[k, j]`, in at most `stages`
    stages: the least L (to about 1 part in 10,000, rounded down) at which a chain of states
    from the first to the last has every stage within L, or the single stage of every node."""
    factor, m = weight_factor(options), options.per_minibatch
    s = len(params)
    last = s - 1
    whole = factor * (params[last] - params[0]) + keep[last] / m
    if s < 2:
        return whole
    held = keep.copy()
    held[0] = 0.0  # a stage from state 0 holds the pinned inputs too
    lo, hi = floor, whole
    if hi <= lo:
        return hi
    if _reaches(params, keep, held, valid, stages, factor, m, lo):
        return lo
    while hi - lo > hi * 1e-4:
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break  # no float lies between them (subnormal costs): the loop would never end
        if _reaches(params, keep, held, valid, stages, factor, m, mid):
            hi = mid
        else:
            lo = mid
    return lo


def _reaches(params: np.ndarray, keep: np.ndarray, held: np.ndarray, valid: np.ndarray,
             stages: int, factor: float, m: int, limit: float) -> bool:
    """Whether a chain of at most `stages` valid stages, each within `limit` (with SLACK),
    leads from the first state to the last."""
    s = len(params)
    hops = np.full(s, np.inf)
    hops[0] = 0.0
    bound = limit * (1 + SLACK)
    for j in range(1, s):
        need = factor * (params[j] - params[:j]) + (keep[j] - held[:j]) / m
        usable = valid[:j, j] & (need <= bound)
        if usable.any():
            hops[j] = hops[:j][usable].min() + 1.0
    return bool(hops[-1] <= stages)


__all__ = ["NodeFloor", "SLACK", "least_memory", "node_floor", "weight_factor"]
