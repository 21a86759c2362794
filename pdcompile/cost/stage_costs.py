"""Stage costs: what one worker of each stage spends per microbatch, the simulator's input.

Per stage s: forward and backward seconds for one microbatch on one worker (`fwd[s]`, `bwd[s]`),
parameter bytes (`params[s]`: a tied parameter counted on every stage holding a copy), bytes kept
for the backward per microbatch in flight (`activations[s]`), optimizer-step seconds
(`optimizer[s]`, None: cost/updates.py estimates it from the device's memory bandwidth), seconds to
copy the stage's weights once (`stash[s]`, None: estimated likewise; weight stashing pays it for
each new version); per stage edge (src, dst): bytes sent per microbatch (`edges`; the gradient
going back is the same size); optimizer state per parameter byte (`optimizer_state`, for memory);
of `bwd[s]`, the seconds of weight gradients the runtime can defer (`wgrad[s]`: the fused Linear
layers' dW, which it computes in W actions or after the input-gradient send; None where the graph
does not say, as in PipeDream's profiles: the simulator then takes `schedule.kinds.WGRAD_SHARE` of
every backward); the tied parameters that stages share (`ties`, cost/ties.py: all-reduced over
their ranks at each update). Built from a CostGraph and a Plan (`from_plan`, with
cost/crossing.py's rule for what crosses), or given directly (`uniform`, the constructor).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import networkx as nx

from pdcompile.cost.crossing import crossing_bytes, input_nodes, stage_of_every_node
from pdcompile.cost.links import slowest_link, transfer_seconds
from pdcompile.cost.memory import OPTIMIZER_STATE
from pdcompile.cost.ties import SharedWeights, copied_bytes, shared_weights
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Plan
from pdcompile.timeline import Timeline, stage_figures


@dataclass(frozen=True)
class StageCosts:
    """Per-stage, per-microbatch costs (seconds, bytes) and bytes per stage edge."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[float, ...] = ()
    activations: tuple[float, ...] = ()
    edges: dict[tuple[int, int], float] = field(default_factory=dict)
    optimizer: tuple[float, ...] | None = None
    stash: tuple[float, ...] | None = None
    optimizer_state: float = OPTIMIZER_STATE
    wgrad: tuple[float, ...] | None = None
    ties: tuple[SharedWeights, ...] = ()

    def received(self, stage: int) -> float:
        """Bytes per microbatch the stage receives from earlier stages (what it keeps when it
        recomputes its activations)."""
        return sum(size for (_, c), size in self.edges.items() if c == stage)

    def __post_init__(self) -> None:
        stages = len(self.fwd)
        if stages == 0 or len(self.bwd) != stages:
            raise PlanError(f"stage costs need one fwd and one bwd per stage (got {len(self.fwd)} "
                            f"and {len(self.bwd)})")
        object.__setattr__(self, "params", tuple(self.params) or (0.0,) * stages)
        object.__setattr__(self, "activations", tuple(self.activations) or (0.0,) * stages)
        for name in ("params", "activations"):
            if len(getattr(self, name)) != stages:
                raise PlanError(f"stage costs: {name} has {len(getattr(self, name))} entries for "
                                f"{stages} stages")
        if self.wgrad is not None:
            object.__setattr__(self, "wgrad", tuple(float(w) for w in self.wgrad))
            if len(self.wgrad) != stages or any(
                    not 0.0 <= w <= b * (1 + 1e-9) + 1e-15
                    for w, b in zip(self.wgrad, self.bwd, strict=True)):
                raise PlanError(f"stage costs: wgrad {list(self.wgrad)} must give each of the "
                                f"{stages} stages a part of its backward {list(self.bwd)}")
        for name in ("optimizer", "stash"):
            given = getattr(self, name)
            if given is not None and len(given) != stages:
                raise PlanError(f"stage costs: {name} has {len(given)} entries for "
                                f"{stages} stages")
        for (src, dst) in self.edges:
            if not 0 <= src < dst < stages:
                raise PlanError(f"stage edge ({src}, {dst}) is not (src, dst) with "
                                f"0 <= src < dst < {stages}")
        object.__setattr__(self, "ties", tuple(self.ties))
        for tie in self.ties:
            if len(tie.stages) < 2 or not all(0 <= s < stages for s in tie.stages) \
                    or tie.nbytes < 0:
                raise PlanError(f"stage costs: tie {tie} must name at least two of the "
                                f"{stages} stages and bytes >= 0")
        for name in ("fwd", "bwd", "params", "activations"):
            if any(v < 0 for v in getattr(self, name)):
                raise PlanError(f"stage costs: negative {name} {list(getattr(self, name))}")

    @property
    def stages(self) -> int:
        """Number of stages."""
        return len(self.fwd)

    def wgrad_shares(self, default: float) -> tuple[float, ...]:
        """Per stage, the part of its backward that is deferrable weight gradients (`wgrad`
        over `bwd`); `default` for every stage where `wgrad` is unknown, 0 where bwd is 0."""
        if self.wgrad is None:
            return (default,) * self.stages
        return tuple(min(w / b, 1.0) if b > 0 else 0.0
                     for w, b in zip(self.wgrad, self.bwd, strict=True))

    def stage_edges(self) -> list[tuple[int, int]]:
        """The edges (sorted); a chain when no edges were given and there are several stages."""
        if self.edges:
            return sorted(self.edges)
        return [(s, s + 1) for s in range(self.stages - 1)]

    def edge_bytes(self, src: int, dst: int) -> float:
        """Bytes per microbatch over stage edge (src, dst) (either order), 0 if unknown."""
        return self.edges.get((min(src, dst), max(src, dst)), 0.0)

    def transfer_seconds(self, src: int, dst: int, stage_ranks: Sequence[Sequence[int]],
                         cluster: Cluster) -> float:
        """One microbatch over stage edge (src, dst) on the slowest link between their ranks."""
        return transfer_seconds(self.edge_bytes(src, dst),
                                slowest_link(cluster, stage_ranks[src], stage_ranks[dst]))

    def round_trips(self, stage_ranks: Sequence[Sequence[int]], cluster: Cluster) -> list[float]:
        """Seconds from a microbatch's forward at stage s to the end of its backward there,
        with nothing queued: the compute of s and every later stage plus each transfer on an
        edge leaving s or a later stage, there and back."""
        out = []
        for stage in range(self.stages):
            compute = sum(self.fwd[s] + self.bwd[s] for s in range(stage, self.stages))
            links = sum(self.transfer_seconds(a, b, stage_ranks, cluster)
                        for a, b in self.stage_edges() if a >= stage)
            out.append(compute + 2 * links)
        return out

    def period(self, stage_ranks: Sequence[Sequence[int]], cluster: Cluster) -> float:
        """The pipeline's time per microbatch if nothing waits: the busiest worker or link."""
        compute = max((self.fwd[s] + self.bwd[s]) / len(stage_ranks[s])
                      for s in range(self.stages))
        links = [self.transfer_seconds(a, b, stage_ranks, cluster) /
                 min(len(stage_ranks[a]), len(stage_ranks[b])) for a, b in self.stage_edges()]
        return max([compute] + links)

    @classmethod
    def uniform(cls, stages: int, *, fwd: float, bwd: float, params: float = 0.0,
                activations: float = 0.0, edge_bytes: float = 0.0,
                optimizer: float | None = 0.0,
                optimizer_state: float = OPTIMIZER_STATE) -> StageCosts:
        """Every stage the same; a straight chain of edges carrying `edge_bytes` each."""
        return cls((fwd,) * stages, (bwd,) * stages, (params,) * stages, (activations,) * stages,
                   {(s, s + 1): edge_bytes for s in range(stages - 1)},
                   None if optimizer is None else (optimizer,) * stages,
                   optimizer_state=optimizer_state)

    @classmethod
    def from_lists(cls, fwd: Sequence[float], bwd: Sequence[float], **kwargs: object) -> StageCosts:
        """Convenience: lists instead of tuples."""
        return cls(tuple(fwd), tuple(bwd), **kwargs)  # type: ignore[arg-type]

    def with_measured_compute(self, timeline: Timeline) -> StageCosts:
        """These costs with each stage's forward, backward and optimizer step replaced by the
        means a recorded run measured (`timeline.stage_figures`: its steady window).

        Why: the cost pass times each node alone; a run of the compiled pipeline (even a short
        local one, `Pipeline.timed()` then `train`) times whole stages through the runtime's
        own path (weight stashing included), which is what the workers will run. The measured
        forward and backward already contain the stash copies, so `stash` becomes 0."""
        seen = stage_figures(timeline)
        missing = [s for s in range(self.stages) if s not in seen]
        if missing:
            raise PlanError(f"the timeline has no actions of stages {missing}; record a run of "
                            f"this pipeline ({self.stages} stages)")
        stages = range(self.stages)
        bwd = tuple(seen[s]["bwd"] for s in stages)
        # the deferrable part keeps its share of each measured backward
        wgrad = None if self.wgrad is None else tuple(
            share * b for share, b in zip(self.wgrad_shares(0.0), bwd, strict=True))
        return StageCosts(tuple(seen[s]["fwd"] for s in stages), bwd, self.params,
                          self.activations, self.edges, tuple(seen[s]["step"] for s in stages),
                          (0.0,) * self.stages, wgrad=wgrad, ties=self.ties)

    @classmethod
    def from_plan(cls, graph: nx.DiGraph, plan: Plan, *, microbatches: int = 1) -> StageCosts:
        """Sum the CostGraph's per-minibatch node costs per stage, divided by `microbatches`.

        Nodes the plan does not place (e.g. zero-cost inputs) join the stage of their first placed
        successor (stage 0 if none). Inputs (`input_nodes`) cost no compute: a PipeDream
        profile's `Input` forward time is data loading, which the input pipeline overlaps with
        training (as the planner's native cost model has it). A tensor sent from one node to
        several nodes of a later stage crosses once; an edge from a later stage to an earlier one
        is an error in the plan.
        """
        return cls.from_assignment(graph, stage_of_every_node(graph, plan.stage_of()),
                                   len(plan.stages), microbatches=microbatches)

    @classmethod
    def from_assignment(cls, graph: nx.DiGraph, stage_of: dict[str, int], stages: int, *,
                        microbatches: int = 1,
                        inputs: Collection[str] | None = None) -> StageCosts:
        """`from_plan` for every node's stage given directly (`stage_of` covers every node;
        `inputs`: the graph's `input_nodes`, when the caller has them already)."""
        if microbatches < 1:
            raise PlanError(f"microbatches must be a positive integer (got {microbatches})")
        fwd, bwd, params, keep, wgrad = ([0.0] * stages for _ in range(5))
        known = True  # every node says how much of its backward can be deferred
        loading = set(input_nodes(graph) if inputs is None else inputs)
        for node, data in graph.nodes(data=True):
            s = stage_of[node]
            if node not in loading:
                fwd[s] += float(data["fwd"])
            bwd[s] += float(data["bwd"])
            if "wgrad" in data:
                wgrad[s] += min(float(data["wgrad"]), float(data["bwd"]))
            else:
                known = False
            params[s] += float(data["params"])
            keep[s] += float(data.get("keep", data["act"]))
        for s, copied in enumerate(copied_bytes(graph, stage_of, stages)):
            params[s] += copied  # a tie's later holders keep a copy of their own
        edges = {pair: size / microbatches
                 for pair, size in crossing_bytes(graph, stage_of).items()}
        m = float(microbatches)
        return cls(tuple(f / m for f in fwd), tuple(b / m for b in bwd), tuple(params),
                   tuple(k / m for k in keep), edges, None,
                   wgrad=tuple(w / m for w in wgrad) if known else None,
                   ties=shared_weights(graph, stage_of))
