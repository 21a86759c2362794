"""A CostGraph measured at one minibatch size, priced at another.

A profile is measured at the minibatch its profiler ran (PipeDream's VGG-16 profile at 128
images, GNMT-8's at 32 sentences), while a training run may use another per-worker minibatch
(PipeDream's VGG-16 and GNMT runs used 64: its `driver_configs/*.yml`). Epoch time is samples
over throughput, and what scales with the minibatch is not the same for every term: a layer's
compute and the tensors it produces grow with the samples in it, its parameters (and so a data-
parallel all-reduce, once per minibatch) do not. Halving the minibatch therefore doubles the
all-reduce per sample and leaves the compute per sample as it was (to first order: a GPU may
run a smaller minibatch less efficiently, which this leaves out). docs/cost-model.md gives the
figures it moves.
"""

from __future__ import annotations

import networkx as nx

from pdcompile.errors import CostGraphError

_PER_SAMPLE = ("fwd", "bwd", "act", "keep", "wgrad")


def at_minibatch(graph: nx.DiGraph, measured: int, run: int) -> nx.DiGraph:
    """A copy of `graph` (measured at `measured` samples per minibatch) as a minibatch of `run`
    samples: compute, activations, what the backward keeps, edge bytes and the input scaled by
    run / measured; parameters (and ties) as they are."""
    if measured <= 0 or run <= 0:
        raise CostGraphError(f"minibatch sizes must be positive (measured {measured}, run {run}): "
                             "give the profile's samples per minibatch and the run's")
    factor = run / measured
    scaled = graph.copy()
    scaled.graph = dict(graph.graph)
    for _, data in scaled.nodes(data=True):
        for key in _PER_SAMPLE:
            if key in data:
                data[key] = float(data[key]) * factor
    for _, _, data in scaled.edges(data=True):
        if "bytes" in data:
            data["bytes"] = float(data["bytes"]) * factor
    if "input_bytes" in scaled.graph:
        scaled.graph["input_bytes"] = float(scaled.graph["input_bytes"]) * factor
    return scaled


__all__ = ["at_minibatch"]
