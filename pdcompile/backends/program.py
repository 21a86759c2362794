"""RunProgram: what a backend is handed to run a compiled pipeline, and nothing more.

`Pipeline.program()` builds it; the local backend (backends/local.py) and the distributed one
(backends/distributed.py) read only it. It names the schedule and how a run is built from it
(the lowered schedule and the generated rank loops of a run shape), each stage's inputs and
outputs, the state every rank trains (module copy, optimizer), the tie groups, the shapes of
the messages, and the run configuration; `prepare` cuts minibatches into a run's microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdcompile.errors import PipelineInputError
from pdcompile.plan import Plan
from pdcompile.runtime.chunks import ChunkRuntimes
from pdcompile.runtime.rank_function import RankFn
from pdcompile.runtime.rank_state import RankState
from pdcompile.runtime.stage_runtime import (
    RunConfig,
    SpecFn,
    StageIO,
    StageRuntime,
    TieGroup,
    ValueSource,
)
from pdcompile.runtime.transport import Tag, TensorSpec
from pdcompile.schedule.ir import Schedule


class MicrobatchData:
    """Inputs (by model input name) and targets of the microbatches of one run."""

    def __init__(self, inputs: list[dict[str, Any]], targets: list[Any]) -> None:
        self._inputs = inputs
        self._targets = targets

    def inputs(self, microbatch: int) -> dict[str, Any]:
        """Model inputs of a microbatch, by placeholder name."""
        return self._inputs[microbatch]

    def target(self, microbatch: int) -> Any:
        """The target of a microbatch."""
        return self._targets[microbatch]

    def __len__(self) -> int:
        return len(self._inputs)


@dataclass
class RunInput:
    """One run of the schedule: its data and shape."""

    data: MicrobatchData
    microbatches: int      # microbatches in the run (the schedule's count)
    per_minibatch: int     # microbatches per minibatch (one update each, per replica round)
    # the microbatches of each minibatch, in order (a minibatch is one microbatch under '1f1b',
    # except a last one cut into pieces to complete the replicas' round; see Pipeline.prepare)
    groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            per = self.per_minibatch
            self.groups = tuple(tuple(range(k * per, (k + 1) * per))
                                for k in range(self.microbatches // per))

    def minibatch_losses(self, losses: dict[int, torch.Tensor]) -> list[float]:
        """Mean loss of each minibatch from the loss of each microbatch."""
        return [float(torch.stack([losses[i] for i in group]).mean()) for group in self.groups]


class Prepare(Protocol):
    """Minibatches -> the data of one run (see Pipeline.prepare); `first` numbers them."""

    def __call__(self, batches: Sequence[tuple[Sequence[Any], Any]], *, first: int = 0
                 ) -> RunInput: ...


def stages_of(stage_ranks: Sequence[Sequence[int]], rank: int) -> tuple[int, ...]:
    """The stages `rank` runs: one, or its chunks in an interleaved pipeline."""
    return tuple(i for i, ranks in enumerate(stage_ranks) if rank in ranks)


@dataclass(frozen=True)
class RunProgram:
    """A compiled pipeline as a backend sees it (built by `Pipeline.program()`).

    `schedule(n, per)` / `rank_functions(n, per)`: the lowered schedule and every rank's
    generated loop of a run of `n` microbatches, `per` per minibatch. `states[rank, stage]`:
    what a rank trains for a stage. `ties[stage]`: its tied parameters' groups.
    `microbatch_specs(named)`: the message table of one microbatch (model inputs by name), for
    `runtime/message_specs.spec_function`. `microbatches`: per minibatch as compiled.
    """

    plan: Plan
    schedule_name: str
    microbatches: int
    per_minibatch: int
    stash: bool
    vertical_sync: bool
    stages: tuple[StageIO, ...]
    output_refs: tuple[ValueSource, ...]
    output_spec: Any
    loss_fn: Callable[..., torch.Tensor] | None
    states: Mapping[tuple[int, int], RankState]
    ties: tuple[tuple[TieGroup, ...], ...]
    schedule: Callable[[int, int], Schedule]
    rank_functions: Callable[[int, int], Mapping[int, RankFn]]
    prepare: Prepare
    microbatch_specs: Callable[[dict[str, Any]], dict[Tag, list[TensorSpec]]]
    slowdowns: tuple[float, ...] = ()  # per rank, an emulated slower device (with_slowdowns)
    clip_grad_norm: float | None = None  # the largest global gradient norm (grad_clip.py)
    autocast: str | None = None  # the forwards' autocast dtype (runtime/precision.py)
    # a minibatch's inputs -> its batch size, along the batch dimension compile was told
    # (runtime/microbatch_cut.py; None: the first dimension of the first tensor)
    samples: Callable[[Sequence[Any]], int | None] | None = None

    def with_slowdowns(self, slowdowns: Sequence[float] | str | None) -> RunProgram:
        """The same program with each rank's compute stretched by its factor
        (runtime/slowdown.py; None or all 1: none), checked: one factor >= 1 per rank."""
        from dataclasses import replace

        from pdcompile.runtime.slowdown import check_slowdowns

        factors = check_slowdowns(slowdowns, max(self.all_ranks) + 1)
        return replace(self, slowdowns=factors)

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every stage."""
        return tuple(tuple(s.ranks) for s in self.plan.stages)

    @property
    def all_ranks(self) -> list[int]:
        """Every rank of the pipeline, sorted."""
        return sorted({r for s in self.plan.stages for r in s.ranks})

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs: one, or its chunks in an interleaved pipeline."""
        return stages_of(self.stage_ranks, rank)

    def state(self, rank: int, stage: int) -> RankState:
        """What `rank` keeps for `stage` (its module copy and optimizer)."""
        state = self.states.get((rank, stage))
        if state is None:
            raise PipelineInputError(f"rank {rank} runs stages {list(self.stages_of(rank))}, "
                                     f"not stage {stage}")
        return state

    def run_config(self, per_minibatch: int) -> RunConfig:
        """The runtime configuration of a run."""
        recompute = frozenset(i for i, s in enumerate(self.plan.stages) if s.recompute)
        shares = self.plan.shares()
        return RunConfig(self.schedule_name, self.stage_ranks, per_minibatch, self.stash,
                         self.vertical_sync, recompute, self.slowdowns,
                         tuple(tuple(c) for c in shares) if shares else (),
                         self.clip_grad_norm, self.autocast)

    def collective_groups(self) -> list[tuple[int, ...]]:
        """Rank groups that all-reduce together: replicas of a stage, and the ranks of stages
        sharing tied parameters (a distributed transport needs a process group for each)."""
        groups = {tuple(s.ranks) for s in self.plan.stages if s.replicas > 1}
        for ties in self.ties:
            groups.update(g.ranks for g in ties)
        return sorted(groups)

    def reads_data(self, rank: int) -> bool:
        """Whether `rank` reads the minibatches: stage 0 (the model's inputs), and any stage
        that uses a model input directly (the last stage may, through the model's output)."""
        stages = self.stages_of(rank)  # several where the rank holds chunks (interleaved)
        if 0 in stages or any(ref.stage is None for stage in stages
                              for ref in self.stages[stage].inputs):
            return True
        last = len(self.plan.stages) - 1 in stages
        return last and any(ref.stage is None for ref in self.output_refs)

    def runtime(self, rank: int, *, config: RunConfig, transport: Any, data: Any,
                specs: SpecFn | None = None, recorder: Any = None
                ) -> StageRuntime | ChunkRuntimes:
        """The runtime of one rank for one run; a rank holding several chunks gets one per
        chunk, sharing its transport and data (runtime/chunks.py)."""
        def one(stage: int) -> StageRuntime:
            state = self.state(rank, stage)
            return StageRuntime(
                rank=rank, io=self.stages[stage], module=state.module,
                optimizer=state.optimizer, config=config, transport=transport, data=data,
                loss_fn=self.loss_fn, output_refs=self.output_refs,
                output_spec=self.output_spec, ties=self.ties[stage],
                specs=specs, recorder=recorder,
                random=state.own_random())  # its own stream, on every backend alike

        stages = self.stages_of(rank)
        if len(stages) == 1:
            return one(stages[0])
        return ChunkRuntimes(rank, {stage: one(stage) for stage in stages})


class ProgramSource(Protocol):
    """What builds a RunProgram (a Pipeline)."""

    def program(self) -> RunProgram: ...


def as_program(source: RunProgram | ProgramSource) -> RunProgram:
    """The program itself, or the one `source` (a Pipeline) builds."""
    return source if isinstance(source, RunProgram) else source.program()


__all__ = ["MicrobatchData", "Prepare", "ProgramSource", "RunInput", "RunProgram",
           "as_program", "stages_of"]
