"""Pipeline: a model cut into stages, with a schedule, generated rank loops and per-rank weights.

`pdcompile.compile` builds one; `pdcompile.load` reads an exported one back. Every rank (one
replica of one stage) owns its copy of the stage module and its optimizer. `step` and `train`
run the generated code of all ranks on the local backend; `run_distributed` hands the same
pipeline to the torch.distributed backend. A backend is handed `program()` (a RunProgram,
backends/program.py), never the Pipeline itself.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from pdcompile.backends.local import run_program
from pdcompile.backends.program import MicrobatchData, RunInput, RunProgram, stages_of
from pdcompile.errors import PdcompileError, PipelineInputError, PlanError, ScheduleError
from pdcompile.meta import get_input_shapes, get_training_branches
from pdcompile.passes.codegen import generate_rank, load_rank
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.passes.split import SplitResult, StageProgram
from pdcompile.passes.training_flags import training_mode_calls
from pdcompile.plan import Plan
from pdcompile.runtime.chunks import ChunkRuntimes
from pdcompile.runtime.evaluation import evaluate_model, evaluation_mode
from pdcompile.runtime.grad_clip import check_max_norm
from pdcompile.runtime.message_specs import message_table, spec_function
from pdcompile.runtime.microbatch_cut import (
    BatchDims,
    batch_size,
    checked_batch_dims,
    checked_whole,
    cut_inputs,
    cut_target,
    first_microbatch,
    inferred_whole,
    misread_batch,
)
from pdcompile.runtime.precision import autocast_region, check_autocast
from pdcompile.runtime.rank_function import RankFn
from pdcompile.runtime.rank_state import NoParameters, RankState
from pdcompile.runtime.stage_runtime import RunConfig, StageRuntime, TieGroup
from pdcompile.runtime.stream_window import take_window, window_limit, window_rounds
from pdcompile.runtime.transport import Tag, TensorSpec
from pdcompile.runtime.value_shapes import describe as _describe
from pdcompile.runtime.value_shapes import shape_key
from pdcompile.runtime.value_shapes import signature as _signature
from pdcompile.schedule.build import build
from pdcompile.schedule.generators import checked_shares, interleaved_shape
from pdcompile.schedule.ir import Schedule
from pdcompile.schedule.kinds import KINDS, kind
from pdcompile.schedule.kinds import names as schedule_names
from pdcompile.timeline import Timeline
from pdcompile.util.module_copy import copy_module
from pdcompile.util.suggest import did_you_mean

OptimizerFactory = Callable[[list[Any]], torch.optim.Optimizer]  # parameters or param groups
# a parameter's name in the model and the parameter -> its group's options ({} or None: none)
ParamGroups = Callable[[str, torch.nn.Parameter], Mapping[str, Any] | None]
SCHEDULES = tuple(KINDS)


# the seed of a pipeline's runs unless one is given (Pipeline.seed, exported)
DEFAULT_SEED = 0
# minibatch shapes check_minibatch remembers as accepted (the least recently seen forgotten
# first): a stream of ever new shapes (sequence lengths) must not grow a worker's memory
CHECKED_SHAPES_KEPT = 256
# message tables `microbatch_specs` keeps, by input shape (the least recently used dropped)
MESSAGE_TABLES_KEPT = 64


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with learning rate 0.01 (the default of `compile`)."""
    return torch.optim.SGD(params, lr=0.01)


class Pipeline:
    """A compiled pipeline (see DESIGN.md, public contract).

    A backend gets `pipe.program()` (a RunProgram) and runs one rank of one run like this
    (backends/local.run_program does it for all ranks)::

        program = pipe.program()
        run = program.prepare(batches)              # data + shape of the run
        rt = program.runtime(rank, config=program.run_config(run.per_minibatch), transport=t,
                             data=run.data, specs=pipe.spec_function(batches[0][0]))
        loop = program.rank_functions(run.microbatches, run.per_minibatch)[rank](rt)
        ...drive the generator...; rt.finish(); losses: rt.losses on the last stage

    The transport needs a collective group for each of `program.collective_groups()`.
    """

    def __init__(self, *, graph: fx.GraphModule | None, plan: Plan, parts: SplitResult,
                 schedule: str = "1f1b", microbatches: int | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 optimizer: OptimizerFactory | None = None, stash: bool = True,
                 vertical_sync: bool = False, name: str = "model",
                 example_inputs: Sequence[Any] | None = None,
                 example_target: Any = None, model: torch.nn.Module | None = None,
                 clip_grad_norm: float | None = None,
                 param_groups: ParamGroups | None = None, autocast: Any = None,
                 unbatched: Sequence[str] | str | None = (),
                 batch_dim: int | Mapping[str, int] | BatchDims | None = None,
                 target_batch_dim: int | None = None) -> None:
        if schedule not in SCHEDULES:
            raise PipelineInputError(f"unknown schedule {schedule!r}"
                                     f"{did_you_mean(schedule, SCHEDULES)}; choose one of "
                                     f"{', '.join(SCHEDULES)}")
        self.plan = plan
        self.graph = graph
        self.parts = parts
        self.schedule_name = schedule
        self.microbatches = int(microbatches) if microbatches else _default_microbatches(
            schedule, plan)
        self.loss_fn = loss_fn
        self.optimizer_factory: OptimizerFactory = optimizer or default_optimizer
        self.param_groups = param_groups
        self.stash = stash
        self.vertical_sync = vertical_sync
        self.name = name
        # the model compile captured (None for a loaded export or a graph given as it is):
        # `evaluate` runs its own forward, as only it still holds both modes
        self.model = model
        self.record = False
        # the random seed `pdcompile run` sets in every worker unless told another (--seed);
        # recorded in an export, so that two runs of it are bit-equal
        self.seed = DEFAULT_SEED
        self.last_timeline: Timeline | None = None
        self.last_runtimes: dict[int, StageRuntime | ChunkRuntimes] = {}
        self._sources: dict[tuple[int, int], dict[int, str]] = {}
        # minibatch shapes check_minibatch accepted, the least recently seen first
        self._checked_shapes: OrderedDict[Any, None] = OrderedDict()
        self._functions: dict[tuple[int, int], dict[int, RankFn]] = {}
        self._schedules: dict[tuple[int, int], Schedule] = {}  # lowered, by run shape
        # message tables by the shapes of a microbatch's inputs (`microbatch_specs`), the least
        # recently used first
        self._message_tables: OrderedDict[Any, dict[Tag, list[TensorSpec]]] = OrderedDict()
        self._check()
        self.clip_grad_norm = self._checked_clip(clip_grad_norm)
        self.autocast = check_autocast(autocast)  # a dtype name: "bfloat16"
        # inputs given whole to every microbatch whatever their size (runtime/microbatch_cut.py):
        # named by the user, and those the example's sizes show to hold no samples
        self.unbatched = checked_whole(unbatched, parts.data_inputs)
        # the dimension that holds the samples of each input and of the target (compile's
        # batch_dim= / target_batch_dim=; dimension 0 unless given)
        self.batch_dims = batch_dim if isinstance(batch_dim, BatchDims) else \
            checked_batch_dims(batch_dim, target_batch_dim, parts.data_inputs)
        # operations only a training-mode capture holds: a loaded pipeline cannot evaluate
        self.training_branches = get_training_branches(graph) if graph is not None else ()
        # the stage of each node of the traced graph as an export recorded it (set by the
        # loader): a loaded graph may be missing or traced again under other node names
        self.recorded_graph_stages: dict[str, int] | None = None
        self.whole_inputs = self.unbatched + (() if example_inputs is None else inferred_whole(
            self._named(tuple(example_inputs)), self.unbatched, self.batch_dims))
        # one minibatch as compiled: backends check shapes against it, export saves it
        self.example_inputs: tuple[Any, ...] | None = (
            None if example_inputs is None else tuple(example_inputs))
        self.example_target: Any = example_target
        # the input shapes the stages run on, where the front end knows them (torch.export)
        self.input_shapes: InputShapes | None = (
            None if graph is None else get_input_shapes(graph))
        if example_inputs is not None:
            self._learn_kinds(example_inputs)
        if kind(schedule).split_backward:  # B/W split: Linear weight gradients can wait
            from pdcompile.passes.fuse import split_weight_gradients

            for program in parts.stages:
                split_weight_gradients(program.module)
        # the state of every rank holding one stage, and of every chunk of a rank holding several
        # (interleaved schedules): `state(rank, stage)` reads either
        self.ranks: dict[int, RankState] = {}
        self.chunk_states: dict[tuple[int, int], RankState] = {}
        for stage, program in enumerate(parts.stages):
            for replica, rank in enumerate(plan.stages[stage].ranks):
                module = program.module if replica == 0 else _copy(program.module)
                state = self._rank_state(rank, stage, module)
                if len(self.stages_of(rank)) > 1:
                    self.chunk_states[rank, stage] = state
                else:
                    self.ranks[rank] = state

    # ------------------------------------------------------------------ construction
    def _rank_state(self, rank: int, stage: int, module: fx.GraphModule,
                    param_order: Sequence[str] | None = None) -> RankState:
        named = dict(module.named_parameters())
        order = tuple(param_order) if param_order is not None else tuple(named)
        params = [named[n] for n in order]
        optimizer = self.optimizer_factory(self._grouped(stage, order, params)) if params \
            else NoParameters()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PipelineInputError(f"optimizer must be a callable params -> "
                                     f"torch.optim.Optimizer, e.g. lambda p: torch.optim.SGD(p, "
                                     f"lr=0.1); it returned {type(optimizer).__name__}")
        return RankState(rank, stage, module, optimizer, order)

    def _grouped(self, stage: int, names: Sequence[str], params: list[torch.nn.Parameter]
                 ) -> list[Any]:
        """The stage's parameters for its optimizer: as they are, or in torch's param groups
        by the options `param_groups(name, param)` gives each under its name in the model (e.g.
        no weight decay for biases and norms), groups in order of first appearance."""
        if self.param_groups is None:
            return params
        originals = self.parts.stages[stage].param_names
        groups: dict[str, dict[str, Any]] = {}
        for name, param in zip(names, params, strict=True):
            original = originals.get(name, (name,))[0]
            options = self.param_groups(original, param)
            if options is None:
                options = {}
            if not isinstance(options, Mapping) or "params" in options:
                raise PipelineInputError(
                    f"param_groups({original!r}, ...) returned {options!r}; return a dict of "
                    "optimizer options for the parameter's group (e.g. {'weight_decay': 0.0}), "
                    "without 'params', or {} / None for the defaults")
            key = repr(sorted((str(k), repr(v)) for k, v in options.items()))
            groups.setdefault(key, {**options, "params": []})["params"].append(param)
        return list(groups.values())

    def _checked_clip(self, value: float | None) -> float | None:
        """`clip_grad_norm`, where this pipeline can clip by the global norm
        (runtime/grad_clip.py): a flush schedule."""
        limit = check_max_norm(value)
        if limit is None:
            return None
        if not kind(self.schedule_name).flush:
            raise PipelineInputError(
                f"clip_grad_norm needs every stage's gradients of a minibatch before any stage "
                f"updates, which schedule {self.schedule_name!r} does not wait for (each stage "
                "updates at its own time); use a flush schedule ('1f1b-flush', 'gpipe', "
                "'zb-h1'), or clip each stage's gradients in its optimizer")
        return limit

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs: one, or its chunks in an interleaved pipeline."""
        return stages_of(self.stage_ranks, rank)

    def state(self, rank: int, stage: int) -> RankState:
        """What `rank` keeps for `stage` (its module copy and optimizer)."""
        if (rank, stage) in self.chunk_states:
            return self.chunk_states[rank, stage]
        state = self.ranks.get(rank)
        if state is None or state.stage != stage:
            raise PipelineInputError(f"rank {rank} runs stages {list(self.stages_of(rank))}, "
                                     f"not stage {stage}")
        return state

    def replace_state(self, state: RankState) -> None:
        """Put `state` in place of the one of its rank and stage (e.g. a loaded optimizer)."""
        if (state.rank, state.stage) in self.chunk_states:
            self.chunk_states[state.rank, state.stage] = state
        else:
            self.state(state.rank, state.stage)  # checks that the rank runs that stage
            self.ranks[state.rank] = state

    def states(self) -> list[RankState]:
        """Every rank's state (each chunk's on ranks holding several), by rank then stage."""
        return sorted([*self.ranks.values(), *self.chunk_states.values()],
                      key=lambda st: (st.rank, st.stage))

    @property
    def all_ranks(self) -> list[int]:
        """Every rank of the pipeline, sorted."""
        return sorted({r for s in self.plan.stages for r in s.ranks})

    def _check(self) -> None:
        replicas = [s.replicas for s in self.plan.stages]
        if len(self.parts.stages) != len(replicas):
            raise PlanError(f"plan has {len(replicas)} stages but the split has "
                            f"{len(self.parts.stages)}")
        shared = [r for r in self.all_ranks if len(self.stages_of(r)) > 1]
        if shared and not kind(self.schedule_name).interleaved:
            raise PipelineInputError(
                f"ranks {shared} hold several stages (an interleaved placement); run it with "
                f"one of the interleaved schedules {', '.join(schedule_names('interleaved'))}, not "
                f"{self.schedule_name!r}")
        row = kind(self.schedule_name)
        if row.interleaved or row.split_backward:
            try:
                _, chunks = interleaved_shape(self.stage_ranks, v_shape=row.v_shape)
            except ScheduleError as err:
                raise PipelineInputError(f"schedule {self.schedule_name!r} cannot run plan "
                                         f"{self.plan.config}: {err}") from None
            if row.interleaved and chunks < 2:
                raise PipelineInputError(
                    f"schedule {self.schedule_name!r} needs a plan with several chunks per rank "
                    f"(stage c on rank c mod p); make one with "
                    f"pdcompile.planner.interleave.interleave(plan, ranks) or interleaved_plan("
                    f"graph, ranks, chunks)")
        if self.vertical_sync and (not kind(self.schedule_name).vertical_sync
                                   or len(set(replicas)) > 1):
            raise PipelineInputError("vertical_sync needs schedule '1f1b' and the same number of "
                                     f"replicas in every stage (got {self.schedule_name!r}, "
                                     f"replicas {replicas})")
        shares = self.plan.shares()
        if shares is not None:
            try:
                checked_shares(self.schedule_name, self.stage_ranks, shares)
            except ScheduleError as err:
                raise PipelineInputError(f"plan {self.plan.config}: {err}") from None
            if self.vertical_sync:
                raise PipelineInputError(f"vertical_sync needs replicas that take minibatches in "
                                         f"turn; the plan gives them shares {shares}: drop "
                                         "vertical_sync or the shares")
        if not kind(self.schedule_name).microbatched:
            rounds = [s.round_size for s in self.plan.stages]
            for tie in self.parts.ties:
                counts = {rounds[s] for s in tie.stages}
                if len(counts) > 1:
                    raise PlanError(f"parameter {tie.name!r} is shared by stages {tie.stages} "
                                    f"with different replica counts {sorted(counts)}; with "
                                    "'1f1b' they update at different rates; give them equal "
                                    "replicas or use a flush schedule")

    # ------------------------------------------------------------------ views
    @property
    def stage_programs(self) -> list[StageProgram]:
        """The split: inputs, outputs, sends and receives of every stage."""
        return self.parts.stages

    @property
    def stage_modules(self) -> list[fx.GraphModule]:
        """The module of every stage (replica 0's live copy)."""
        return [self.state(s.ranks[0], i).module for i, s in enumerate(self.plan.stages)]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every rank's optimizer, in rank order (attach LR schedulers to each)."""
        return [state.optimizer for state in self.states()]

    def stage_optimizers(self, stage: int) -> list[torch.optim.Optimizer]:
        """The optimizers of a stage's replicas."""
        return [self.state(r, stage).optimizer for r in self.plan.stages[stage].ranks]

    @property
    def graph_stages(self) -> dict[str, int]:
        """The stage whose code computes each node of the traced graph (its "pd.stage"; the
        export's record where the pipeline was loaded from one, so that exporting it again
        keeps the nodes plan.json is checked against); empty where there is no graph."""
        if self.recorded_graph_stages is not None:
            return dict(self.recorded_graph_stages)
        if self.graph is None:
            return {}
        return {n.name: int(n.meta["pd.stage"]) for n in self.graph.graph.nodes
                if "pd.stage" in n.meta}

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every stage."""
        return tuple(tuple(s.ranks) for s in self.plan.stages)

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The model's parameters by their original names (replica 0 of the stage holding them;
        a tied parameter under each of its names, from the first stage holding it)."""
        out: dict[str, torch.nn.Parameter] = {}
        for program, module in zip(self.parts.stages, self.stage_modules, strict=True):
            params = dict(module.named_parameters(remove_duplicate=False))
            for name, originals in program.param_names.items():
                for original in originals:
                    out.setdefault(original, params[name])
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the model's own names (compare with model.state_dict()),
        those forward never reads included (`SplitResult.unused`)."""
        out: dict[str, torch.Tensor] = {k: v.detach() for k, v in self.named_parameters().items()}
        for program, module in zip(self.parts.stages, self.stage_modules, strict=True):
            buffers = dict(module.named_buffers(remove_duplicate=False))
            for name, originals in program.buffer_names.items():
                if name in program.transient_buffers:
                    continue  # persistent=False: left out, as by torch.nn.Module.state_dict
                for original in originals:
                    out.setdefault(original, buffers[name])
        for name, value in self.parts.unused.items():  # never read by forward: never changed
            out.setdefault(name, value)
        return out

    def summary(self) -> str:
        """Per stage: replicas, first/last node, nodes, parameters, compute, bytes sent,
        communication, memory; then predicted totals, schedule, tied parameters."""
        from pdcompile.viz.stage_table import pipeline_summary

        return pipeline_summary(self)

    def draw(self, path: str, **options: Any) -> Any:
        """Draw the partitioned graph (.svg/.png/.dot); see pdcompile.viz.plan_graph.draw_plan."""
        from pdcompile.viz.plan_graph import draw_plan

        return draw_plan(self, path, **options)

    # ------------------------------------------------------------------ schedules and code
    def schedule(self, microbatches: int | None = None,
                 per_minibatch: int | None = None) -> Schedule:
        """The lowered schedule of a run of `microbatches` (default: the compile-time count);
        built once per run shape (the distributed backend asks for it at every call)."""
        n, per = self._run_shape("schedule", microbatches, per_minibatch)
        if (n, per) not in self._schedules:
            self._schedules[n, per] = build(
                self.schedule_name, self.stage_ranks, n, per_minibatch=per,
                stage_edges=self.parts.edges, vertical_sync=self.vertical_sync,
                # the planner's in-flight counts, where it planned this schedule
                warmup=self.plan.warmup() if self.plan.schedule == self.schedule_name else None,
                recompute=[i for i, s in enumerate(self.plan.stages) if s.recompute],
                shares=self.plan.shares())
        return self._schedules[n, per]

    def _run_shape(self, call: str, microbatches: Any, per_minibatch: Any) -> tuple[int, int]:
        """A run's microbatches and microbatches per minibatch as `call` was given them (None:
        the compile-time run's); 0, a fraction or a string once ran the default run or failed
        deep in the schedule builder."""
        defaults = {"microbatches": self.schedule_length(), "per_minibatch": self.per_minibatch}
        given = {"microbatches": microbatches, "per_minibatch": per_minibatch}
        for name, value in given.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise PipelineInputError(
                    f"{call}({name}={value!r}): give a whole number of microbatches >= 1, or "
                    f"leave it out for the compiled run's ({defaults[name]})")
        return tuple(int(defaults[k] if v is None else v)  # type: ignore[return-value]
                     for k, v in given.items())

    @property
    def per_minibatch(self) -> int:
        """Microbatches per minibatch (1 for '1f1b', where each microbatch is a minibatch)."""
        return kind(self.schedule_name).per_minibatch(self.microbatches)

    def schedule_length(self) -> int:
        """Microbatches in a run of the compile-time shape (2bw: enough minibatches to fill the
        pipeline)."""
        if kind(self.schedule_name).microbatched_stream:
            return self.microbatches * max(2, len(self.plan.stages))
        return self.microbatches

    def rank_sources(self, microbatches: int | None = None,
                     per_minibatch: int | None = None) -> dict[int, str]:
        """Generated `run_rank` source of every rank for a run of that shape."""
        n, per = self._run_shape("rank_sources", microbatches, per_minibatch)
        key = (n, per)
        if key not in self._sources:
            lowered = self.schedule(n, per)
            self._sources[key] = {r: generate_rank(lowered, r) for r in lowered.ranks}
        return self._sources[key]

    def use_sources(self, sources: dict[int, str], microbatches: int, per_minibatch: int) -> None:
        """Run this code for runs of that shape (e.g. the rank files of an export)."""
        self._sources[(microbatches, per_minibatch)] = dict(sources)
        self._functions.pop((microbatches, per_minibatch), None)

    def _rank_functions(self, n: int, per: int) -> dict[int, RankFn]:
        key = (n, per)
        if key not in self._functions:
            self._functions[key] = {r: load_rank(src, name=f"rank {r}")
                                    for r, src in self.rank_sources(n, per).items()}
        return self._functions[key]

    # ------------------------------------------------------------------ running
    def program(self) -> RunProgram:
        """What a backend runs (backends/program.py): the schedule and generated rank loops of
        every run shape, the stages' inputs and outputs, every rank's module and optimizer as
        they are now, the tie groups, the message shapes and the run configuration."""
        states = {(state.rank, state.stage): state for state in self.states()}
        return RunProgram(
            plan=self.plan, schedule_name=self.schedule_name, microbatches=self.microbatches,
            per_minibatch=self.per_minibatch, stash=self.stash, vertical_sync=self.vertical_sync,
            stages=tuple(self.parts.stages), output_refs=tuple(self.parts.output_refs),
            output_spec=self.parts.output_spec, loss_fn=self.loss_fn, states=states,
            ties=tuple(tuple(self.tie_groups(stage)) for stage in range(len(self.plan.stages))),
            schedule=self.schedule, rank_functions=self._rank_functions, prepare=self.prepare,
            microbatch_specs=self.microbatch_specs, clip_grad_norm=self.clip_grad_norm,
            autocast=self.autocast, samples=self.samples)

    def runtime(self, rank: int, *, config: RunConfig, transport: Any, data: Any,
                specs: Callable[[Tag], list[TensorSpec]] | None = None,
                recorder: Any = None) -> StageRuntime | ChunkRuntimes:
        """The runtime of one rank for one run (see RunProgram.runtime)."""
        return self.program().runtime(rank, config=config, transport=transport, data=data,
                                      specs=specs, recorder=recorder)

    def run_config(self, per_minibatch: int) -> RunConfig:
        """The runtime configuration of a run."""
        return self.program().run_config(per_minibatch)

    def tie_groups(self, stage: int) -> list[TieGroup]:
        """Tied parameters of `stage`, grouped by the set of stages sharing them."""
        groups: dict[tuple[int, ...], list[tuple[str, str]]] = {}
        for tie in self.parts.ties:
            mine = [name for s, name in tie.members if s == stage]
            if mine:
                groups.setdefault(tie.stages, []).append((tie.name, mine[0]))
        out = []
        for stages, members in sorted(groups.items()):
            # a rank holding several of the stages (chunks) joins the all-reduce once, with
            # the sum of its copies' gradients (runtime/rank_ties.py)
            ranks = tuple(sorted({r for s in stages for r in self.plan.stages[s].ranks}))
            out.append(TieGroup(ranks, tuple(name for _, name in sorted(members)), stages))
        return out

    def _run(self, data: MicrobatchData, n: int, per: int, *, first_step: int = 0,
             allow_nonfinite: bool = False) -> dict[int, torch.Tensor]:
        """All ranks' generated loops over `n` microbatches on the local backend; the losses."""
        run = run_program(self.program(), data, n, per, record=self.record,
                          first_step=first_step, allow_nonfinite=allow_nonfinite)
        self.last_runtimes = run.runtimes
        if run.timeline is not None:
            self.last_timeline = run.timeline
        return run.losses

    def step(self, *inputs: Any, target: Any = None, allow_nonfinite: bool = False) -> float:
        """One training step on one minibatch cut into `microbatches`; its mean loss.
        A NaN or infinite loss raises `NonFiniteLoss` unless `allow_nonfinite`.

        Under '1f1b' with replicated stages the minibatch is cut into one piece per replica
        of the round (see `prepare`), so that it trains as one data-parallel update.
        """
        names = self.parts.data_inputs
        if target is None and self.loss_fn is not None and len(inputs) == len(names) + 1:
            given = ", ".join(names)
            raise PipelineInputError(
                f"the model takes {len(names)} input{'s' if len(names) != 1 else ''} ({given}) "
                f"and step() got {len(inputs)}: is the last one the target? Pass it by name: "
                f"pipe.step({given}, target=y)")
        return self.train([(inputs, target)], allow_nonfinite=allow_nonfinite)[0]

    def train(self, batches: Iterable[tuple[Any, Any]], *, steps: int | None = None,
              allow_nonfinite: bool = False) -> list[float]:
        """Train on a stream of `(inputs, target)` minibatches; one loss per minibatch.

        A NaN or infinite loss stops the run at once with `NonFiniteLoss` (pdcompile.errors
        family) naming its step, rank and stage; `allow_nonfinite=True` keeps going.

        The stream is read as it is needed (an endless one trains until `steps`). Asynchronous
        schedules overlap the minibatches in the pipeline (PipeDream); the pipeline fills at the
        start and drains at the end of each run of at most one window of minibatches
        (runtime/stream_window.py: WINDOW, or fewer when they hold WINDOW_BYTES), so memory stays
        bounded. Flush schedules run one schedule (one synchronous update) per minibatch.
        Minibatches may differ in size (the short last one of an epoch) or shape; see `prepare`
        for how they are cut.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 0):
            raise PipelineInputError(f"train(steps={steps!r}): give a whole number of "
                                     "minibatches >= 0, or None for the whole stream")
        try:  # a tensor iterates over its rows: no minibatches
            stream = iter(batches) if not isinstance(batches, torch.Tensor) else None
        except TypeError:
            stream = None
        if stream is None:
            raise PipelineInputError(f"train() takes an iterable of (inputs, target) "
                                     f"minibatches, got {type(batches).__name__}; e.g. "
                                     "pipe.train([(x, y)]) or pipe.train(loader)")
        out: list[float] = []
        segment = 1 if kind(self.schedule_name).flush else None
        multiple, least = window_rounds(self.schedule_name,
                                        [s.round_size for s in self.plan.stages])
        while steps is None or len(out) < steps:
            limit = window_limit(len(out), steps=steps, segment=segment, multiple=multiple)
            items = take_window(stream, limit, convert=self.as_minibatch, first=len(out),
                                multiple=multiple, least=least)
            if not items:
                break
            first = len(out)
            run = self.prepare(items, first=first)
            self._keep_example_target(items)  # once checked by prepare
            out.extend(run.minibatch_losses(self._run(
                run.data, run.microbatches, run.per_minibatch, first_step=first,
                allow_nonfinite=allow_nonfinite)))
        return out

    def as_minibatch(self, item: Any, index: int) -> tuple[tuple[Any, ...], Any]:
        """One minibatch of `train` as (inputs, target), refused in one line where it is not."""
        if isinstance(item, Mapping):  # a dict of two keys would unpack into its key names
            names = self.parts.data_inputs
            others = [str(k) for k in item if k not in names]
            inputs_text = "{" + ", ".join(f"{n!r}: batch[{n!r}]" for n in names) + "}"
            target_text = f"batch[{others[0]!r}]" if len(others) == 1 else "target"
            raise PipelineInputError(
                f"minibatch {index} is a dict (keys {', '.join(map(str, item))}), not a pair "
                f"(inputs, target); yield ({inputs_text}, {target_text}), e.g. from a generator "
                "over the loader")
        try:
            inputs, target = item
        except (TypeError, ValueError):
            raise PipelineInputError(
                f"minibatch {index} is a {type(item).__name__}, not a pair (inputs, target); "
                "yield (x, y) or ((x1, x2), y)") from None
        if target is None and self.loss_fn is not None:
            raise PipelineInputError(
                f"minibatch {index} has no target, and the pipeline has a loss function "
                "(it computes loss_fn(output, target)): pass step(*inputs, target=y), "
                "or (inputs, target) pairs to train(); for a model that computes its own loss "
                "(a Hugging Face model given labels=), pass its labels as the target too and "
                "a loss_fn that reads the output's: lambda output, target: output.loss")
        return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target

    def _keep_example_target(self, items: Sequence[tuple[tuple[Any, ...], Any]]) -> None:
        """Without an `example_target` from compile(), keep the first target given with a
        minibatch shaped like the example inputs: the export then holds a whole example
        minibatch, which `pdcompile run` trains on when given no data."""
        if self.example_target is not None or self.example_inputs is None:
            return
        want = _signature(self.example_inputs)
        for inputs, target in items:
            if target is not None and _signature(inputs) == want:
                self.example_target = pytree.tree_map(
                    lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, target)
                return

    def prepare(self, batches: Sequence[tuple[Sequence[Any], Any]], *, first: int = 0
                ) -> RunInput:
        """The data of one run of the schedule over these minibatches, cut into microbatches
        and numbered as the schedule numbers them (backends run `rank_function` on it).

        Minibatches need not be shaped like the example (a short last batch of an epoch,
        another sequence length): each new shape is checked once (`check_minibatch`), and a
        minibatch whose size does not divide by the microbatch count is cut into microbatches
        that differ by at most one sample (each counts equally in the minibatch's loss).
        Under '1f1b' with replicated stages a run must complete the replicas' round (the least
        common multiple L of the replica counts): when the count of minibatches is not a
        multiple of L, the last minibatch is cut into as many pieces as complete it, which go
        round-robin like minibatches (`step` on config "2": each replica takes half of the
        minibatch, and they average their gradients into one update). `first`: the index of
        the first minibatch, for messages.
        """
        batches = [(tuple(x) if isinstance(x, tuple | list) else (x,), t) for x, t in batches]
        if kind(self.schedule_name).flush and len(batches) != 1:
            raise PipelineInputError(f"a {self.schedule_name!r} run covers one minibatch, got "
                                     f"{len(batches)}")
        for index, (inputs, target) in enumerate(batches, first):
            self.check_minibatch(index, inputs, target)
        if not kind(self.schedule_name).microbatched:
            lcm = _lcm([s.round_size for s in self.plan.stages])
            pieces = [1] * len(batches)
            if len(batches) % lcm:
                pieces[-1] = lcm - len(batches) % lcm + 1
            per = 1
        else:
            pieces = [self.microbatches] * len(batches)
            per = self.microbatches
        inputs_all: list[dict[str, Any]] = []
        targets: list[Any] = []
        groups: list[tuple[int, ...]] = []
        for index, ((inputs, target), count) in enumerate(zip(batches, pieces, strict=True),
                                                          first):
            start = len(inputs_all)
            if count == 1:
                inputs_all.append(self._named(inputs))
                targets.append(target)
            else:
                why = ("microbatches" if kind(self.schedule_name).microbatched else
                       f"pieces that complete the round of the replicas ({self.plan.config})")
                inputs_all.extend(self._cut(inputs, count, index=index, why=why))
                targets.extend(cut_target(target, count, index=index, why=why,
                                          dim=self.batch_dims.target))
            groups.append(tuple(range(start, len(inputs_all))))
        return RunInput(MicrobatchData(inputs_all, targets), len(inputs_all), per, tuple(groups))

    def _check_none_inputs(self, index: int, inputs: tuple[Any, ...]) -> None:
        """Refuse an input given as None where the example gave a value, or the other way: the
        graph was captured with the example's (`if mask is not None` resolved by it)."""
        if self.example_inputs is None:
            return
        given, example = self._named(inputs), self._named(self.example_inputs)
        for name in self.parts.data_inputs:
            if (given[name] is None) == (example[name] is None):
                continue
            now, then = ("None", "a value") if given[name] is None else ("a value", "None")
            raise PipelineInputError(
                f"minibatch {index}: input {name!r} is {now}, but example_inputs gave {then}, "
                f"and the compiled graph follows the example (what the model does with "
                f"{name!r} was decided by it); compile with example_inputs that give {name!r} "
                "as the minibatches will")
        # a number or string no stage reads was written into the graph at capture
        # (torch.export specialises them: `for _ in range(repeats)` unrolled for the example's)
        read = {r.name for program in self.parts.stages for r in program.inputs
                if r.stage is None}
        for name in self.parts.data_inputs:
            then, now = example[name], given[name]
            if name in read or not isinstance(then, bool | int | float | str):
                continue
            if type(now) is not type(then) or now != then:
                raise PipelineInputError(
                    f"minibatch {index}: input {name!r} is {now!r}, but example_inputs gave "
                    f"{then!r}, which the compiled graph holds as a constant (the model's code "
                    f"used it while capturing, e.g. in range() or an if); compile with "
                    f"example_inputs giving {name!r} as the minibatches will, or make it a "
                    "tensor")

    def check_minibatch(self, index: int, inputs: Sequence[Any], target: Any) -> None:
        """Refuse, in one line, a minibatch the pipeline cannot train, before any rank starts.

        One shaped like the example is fine if the tests torch.export recorded of its sizes,
        captured at the whole example, hold for its microbatches too. Another shape (a short last batch, another
        sequence length) is checked once per shape: the stages and the loss run forward on its
        first microbatch, without gradients or side effects; if they fail, the message names
        the input that differs from the example and the model's complaint.
        """
        names = self.parts.data_inputs
        by_name = len(inputs) == 1 and isinstance(inputs[0], Mapping)  # `_named` checks them
        if not by_name and len(inputs) != len(names):
            raise PipelineInputError(
                f"minibatch {index} has {len(inputs)} inputs but the pipeline takes "
                f"{len(names)} ({', '.join(names)}); pass them positionally as in "
                "example_inputs")
        self._check_none_inputs(index, tuple(inputs))
        misread = misread_batch(self._named(tuple(inputs)), target, self.whole_inputs,
                                self.unbatched, self.batch_dims)
        if misread is not None:
            raise PipelineInputError(f"minibatch {index}: {misread}")
        key = _signature((tuple(inputs), target))
        if key in self._checked_shapes:
            self._checked_shapes.move_to_end(key)
            return
        example = self.example_inputs
        # a target never checked (no example target to compare with) is checked like a new shape
        same = example is not None and _signature(tuple(inputs)) == _signature(example) and (
            target is None or self.loss_fn is None or (self.example_target is not None
            and _signature(target) == _signature(self.example_target)))
        if not same:
            if kind(self.schedule_name).microbatched:  # too few samples to cut: say so
                self._cut(tuple(inputs), self.microbatches, index=index, why="microbatches")
            self._refuse_shapes(index, tuple(inputs), tests_only=False)
            stage = "model"
            try:
                values = self._example_values(tuple(inputs), explain=False)
                stage = "loss function"
                self._dry_loss(tuple(inputs), target, values)
            except PdcompileError:
                raise
            except Exception as err:
                detail = str(err).splitlines()[0] if str(err) else type(err).__name__
                cannot = "model cannot run on it" if stage == "model" else \
                    "loss function cannot use it with the model's output"
                # the model never sees the target: a model that fails is not the target's fault
                what = self._difference(tuple(inputs), target if stage != "model" else None)
                raise PipelineInputError(
                    f"minibatch {index}: {what}, and the {cannot} "
                    f"({type(err).__name__}: {detail})") from None
        else:  # captured at the whole example, it runs on microbatches: the tests must hold
            self._refuse_shapes(index, tuple(inputs), tests_only=True)
        self._checked_shapes[key] = None
        while len(self._checked_shapes) > CHECKED_SHAPES_KEPT:
            self._checked_shapes.popitem(last=False)

    def _refuse_shapes(self, index: int, inputs: tuple[Any, ...], *, tests_only: bool) -> None:
        """Refuse inputs a graph from torch.export cannot run on (`input_shapes`; `tests_only`:
        only the tests of its sizes, for a minibatch shaped like the example)."""
        if self.input_shapes is None:  # a graph that runs on any shape the model does
            return
        m = kind(self.schedule_name).per_minibatch(self.microbatches)
        named = self._named(inputs)
        check = self.input_shapes.test_refusal if tests_only else self.input_shapes.refusal
        refusal = check(named, first_microbatch(named, m, self.whole_inputs, self.batch_dims),
                        microbatches=m)
        if refusal is not None:
            raise PipelineInputError(f"minibatch {index}: {refusal}")

    def _difference(self, inputs: tuple[Any, ...], target: Any) -> str:
        """What differs from the example minibatch, in words."""
        examples = self._named(self.example_inputs) if self.example_inputs else {}
        for name, given in self._named(inputs).items():
            want = examples.get(name)
            if name in examples and _signature(given) != _signature(want):
                return (f"input {name!r} is {_describe(given)} but the pipeline was compiled "
                        f"for {_describe(want)}")
        if target is None:
            return "its inputs are shaped like the example's" if examples else "no example to " \
                "compare it with"
        if self.example_target is not None:
            return (f"the target is {_describe(target)} but the example's is "
                    f"{_describe(self.example_target)}")
        return f"the target is {_describe(target)}"

    def _dry_loss(self, inputs: tuple[Any, ...], target: Any,
                  values: dict[tuple[int, str], Any]) -> None:
        """The loss of the first microbatch of a minibatch, from its stage outputs `values`
        (no gradients, random state kept)."""
        if self.loss_fn is None or target is None:
            return
        m = kind(self.schedule_name).per_minibatch(self.microbatches)
        output = self._output(self._named(inputs), values)
        with torch.random.fork_rng(), torch.no_grad(), \
                autocast_region(self.autocast, self.stage_modules[-1]):
            self.loss_fn(output, cut_target(target, m, index=0, why="microbatches",
                                            dim=self.batch_dims.target)[0])

    def rank_function(self, rank: int, microbatches: int, per_minibatch: int) -> RankFn:
        """The compiled generated loop of `rank` for a run of that shape."""
        return self._rank_functions(microbatches, per_minibatch)[rank]

    def collective_groups(self) -> list[tuple[int, ...]]:
        """Rank groups that all-reduce together (see RunProgram.collective_groups)."""
        return self.program().collective_groups()

    def spec_function(self, inputs: Sequence[Any] | torch.Tensor
                      ) -> Callable[[Tag], list[TensorSpec]]:
        """Tag -> shapes and dtypes of the message, for microbatches shaped like those of a
        minibatch like `inputs` (runtime/message_specs.py)."""
        table = self.edge_specs(inputs)
        return spec_function(lambda _microbatch: table, self.vertical_sync)

    def _named(self, inputs: Sequence[Any]) -> dict[str, Any]:
        names = self.parts.data_inputs
        # inputs given by name: a dict, or any mapping (a tokenizer's BatchEncoding, which
        # compile took and step refused as one positional input)
        if len(inputs) == 1 and isinstance(inputs[0], Mapping):
            given = dict(inputs[0])
            if len(names) == 1 and set(given) != set(names):  # forward(batch): one dict
                return {names[0]: inputs[0]}
            if set(given) != set(names):
                raise PipelineInputError(f"the model takes the inputs {', '.join(names)}; got "
                                         f"{', '.join(map(str, given)) or 'none'} by name")
            return {name: given[name] for name in names}
        if len(inputs) != len(names):
            raise PipelineInputError(f"the model takes {len(names)} inputs ({', '.join(names)}), "
                                     f"got {len(inputs)}; pass them positionally as in "
                                     "example_inputs")
        return dict(zip(names, inputs, strict=True))

    def _cut(self, inputs: Sequence[Any], m: int, *, index: int, why: str
             ) -> list[dict[str, Any]]:
        return cut_inputs(self._named(inputs), m, index=index, why=why, whole=self.whole_inputs,
                          dims=self.batch_dims)

    def samples(self, inputs: Sequence[Any]) -> int | None:
        """The batch size of a minibatch's inputs (None where none has the batch dimension)."""
        return batch_size(self._named(tuple(inputs)), self.whole_inputs, self.batch_dims)

    def __call__(self, *inputs: Any) -> Any:
        """The model's output, computed by the stage modules one after another (no schedule), in
        the mode the model was compiled in (a model in training mode: dropout draws, BatchNorm
        normalises by the minibatch and moves its statistics). For validation: `evaluate`."""
        with autocast_region(self.autocast, self.stage_modules[0]):
            return self._forward(self._named(inputs))

    def evaluate(self, *inputs: Any) -> Any:
        """The model's output in evaluation mode, as `model.eval()` computes it (dropout off,
        BatchNorm on its running statistics), on the pipeline's current weights, without
        gradients; weights, statistics and the random state are left as they were.

        A compiled pipeline runs the model's own forward on `state_dict()`. A loaded one (no
        model) runs its stage graphs with their modules in eval mode, and refuses a graph that
        fixed a training-mode operation at capture (torch.fx's functional dropout, torch.export's
        batch norm and dropout), naming it: such a graph computes training mode whatever its
        modules say.
        """
        named = self._named(inputs)  # the input count and names, checked as for `step`
        if self.model is not None:
            by_name = len(inputs) == 1 and isinstance(inputs[0], Mapping)
            with autocast_region(self.autocast, self.stage_modules[0]):
                return evaluate_model(self.model, self.state_dict(), () if by_name else inputs,
                                      named if by_name else {})
        if self.training_branches:
            shown = ", ".join(self.training_branches[:3]) + (
                f" and {len(self.training_branches) - 3} more"
                if len(self.training_branches) > 3 else "")
            raise PipelineInputError(
                f"this pipeline cannot evaluate: its graph took the forward's training-mode "
                f"branches at capture ({shown} run in training mode only). Load its weights "
                "into the model and evaluate that: model.load_state_dict(pipe.state_dict()); "
                "model.eval(); model(x)")
        fixed = {stage: calls for stage, module in enumerate(self.stage_modules)
                 if (calls := training_mode_calls(module))}
        if fixed:
            where = "; ".join(f"stage {stage}: {', '.join(calls[:3])}"
                              + (f" and {len(calls) - 3} more" if len(calls) > 3 else "")
                              for stage, calls in fixed.items())
            raise PipelineInputError(
                f"this pipeline cannot evaluate: its graphs fixed training mode at capture "
                f"({where}). Load its weights into the model and evaluate that: "
                "model.load_state_dict(pipe.state_dict()); model.eval(); model(x)")
        # the modules message shapes are worked out on, whose side effects that undoes
        with evaluation_mode([p.module for p in self.parts.stages]):
            return self._output(named, self._microbatch_values(named, inputs))

    def _forward(self, named: dict[str, Any]) -> Any:
        """The stage modules one after another on the model's inputs by name."""
        return self._output(named, self._stage_values(named, self.stage_modules))

    def _stage_values(self, named: dict[str, Any], modules: Sequence[torch.nn.Module],
                      explain: Callable[[StageProgram, list[Any], Exception], Exception]
                      | None = None) -> dict[tuple[int, str], Any]:
        """Every stage output, `modules` (one per stage) run one after another on the model's
        inputs by name; `explain(program, args, err)`: the error to raise where a stage fails."""
        values: dict[tuple[int, str], Any] = {}
        for program, module in zip(self.parts.stages, modules, strict=True):
            args = [named[r.name] if r.stage is None else values[r.stage, r.name]
                    for r in program.inputs]
            try:
                outputs = module(*args)
            except Exception as err:
                if explain is None:
                    raise
                raise explain(program, args, err) from None
            for name, value in zip(program.outputs, outputs, strict=True):
                values[program.index, name] = value
        return values

    def _output(self, named: dict[str, Any], values: dict[tuple[int, str], Any]) -> Any:
        """The model's output (its structure) from the inputs by name and the stage outputs."""
        leaves = [named[r.name] if r.stage is None else values[r.stage, r.name]
                  for r in self.parts.output_refs]
        return pytree.tree_unflatten(leaves, self.parts.output_spec)

    def lr_scheduler(self, factory: Callable[[torch.optim.Optimizer], Any]) -> _Schedulers:
        """One LR scheduler per rank's optimizer; `.step()` steps them all.

        The caller steps it between calls of `step` / `train` (e.g. once per epoch). Under
        asynchronous '1f1b' one `train()` call streams many minibatches through the pipeline and
        every update inside it uses the learning rate in force when the call began; to change
        the rate more often, train in shorter calls (each fills and drains the pipeline).
        Flush schedules make one update per minibatch, so stepping after each `step` is exact.
        """
        return _Schedulers([factory(opt) for opt in self.optimizers])

    def timed(self, record: bool = True) -> Pipeline:
        """Record a measured timeline of every action in later runs (`last_timeline`)."""
        self.record = record
        return self

    def _example_values(self, inputs: Sequence[Any] | torch.Tensor, *,
                        explain: bool = True) -> dict[tuple[int, str], Any]:
        """Every stage output for microbatch 0 of a minibatch like `inputs`, without side
        effects (no gradients, random state and buffers such as BatchNorm statistics restored).
        """
        inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
        m = kind(self.schedule_name).per_minibatch(self.microbatches)
        named = first_microbatch(self._named(inputs), m, self.whole_inputs, self.batch_dims)
        return self._microbatch_values(named, inputs, m, explain=explain)

    def _microbatch_values(self, named: dict[str, Any], inputs: Sequence[Any] = (),
                           m: int = 1, *, explain: bool = True) -> dict[tuple[int, str], Any]:
        """Every stage output for one microbatch (model inputs by name), without side effects;
        `inputs` and `m`: the minibatch it was cut from and into how many, for the message of
        a stage that fails on it (`explain=False`: the model's own error as it is)."""
        modules = [p.module for p in self.parts.stages]  # before any rank state exists too
        saved = [{k: b.clone() for k, b in mod.named_buffers()} for mod in modules]

        def failure(program: StageProgram, args: list[Any], err: Exception) -> Exception:
            return self._stage_failure(program.index, modules[program.index], args, err,
                                       self.samples(inputs or (named,)), m,
                                       fix=self._fixed_batch(named))

        try:
            with torch.random.fork_rng(), torch.no_grad(), \
                    autocast_region(self.autocast, modules[0]):
                return self._stage_values(named, modules, failure if explain else None)
        finally:
            for mod, buffers in zip(modules, saved, strict=True):
                for k, b in mod.named_buffers():
                    b.copy_(buffers[k])

    @staticmethod
    def _stage_failure(stage: int, module: fx.GraphModule, args: Sequence[Any], err: Exception,
                       minibatch: int | None, m: int, *, fix: str | None = None
                       ) -> PipelineInputError:
        """The model's own error in a stage, with the stage, the node and the microbatch size
        (`fix`: the way out where the caller knows it)."""
        from pdcompile.runtime.model_errors import stage_failure

        return stage_failure(stage, module, args, err, microbatches=m, minibatch=minibatch,
                             microbatch=-(-minibatch // m) if minibatch is not None else None,
                             fix=fix)

    def _fixed_batch(self, microbatch: Mapping[str, Any]) -> str | None:
        """Where torch.export fixed the batch size of an input at another size than this
        microbatch's (the model's code turned it into a Python number: `len(x)`), the cause
        and the way out in words; None otherwise. The graph then holds that size as a
        constant (`torch.arange(len(logits))` became `arange(4)`), which a smaller microbatch
        contradicts."""
        if self.input_shapes is None:
            return None
        for name, shape in self.input_shapes.inputs.items():
            value, dim = microbatch.get(name), self.batch_dims.of(name)
            if name in self.whole_inputs or not isinstance(value, torch.Tensor) \
                    or dim >= min(value.dim(), len(shape.dims)):
                continue
            fixed = shape.dims[dim]
            if isinstance(fixed, int) and fixed != value.shape[dim]:
                return (f"torch.export fixed the batch size of input {name!r} at {fixed} (the "
                        "model's code turns it into a Python number, e.g. len(tensor) or "
                        "int(x.shape[0])), so the graph holds it as a constant that a "
                        f"microbatch of {value.shape[dim]} contradicts; read it as "
                        "x.shape[0] or x.size(0) in the model, or compile with microbatches=1")
        return None

    def _learn_kinds(self, inputs: Sequence[Any]) -> None:
        """Record which exchanged values are not tensors (they travel as 0-d tensors)."""
        from pdcompile.runtime.stage_runtime import value_kind

        values = self._example_values(inputs)
        for program in self.parts.stages:
            for dst, names in program.sends.items():
                for name in names:
                    kind = value_kind(values[program.index, name])
                    if kind is not None:
                        program.kinds[name] = kind
                        self.parts.stages[dst].kinds[name] = kind

    def edge_specs(self, inputs: Sequence[Any] | torch.Tensor) -> dict[Tag, list[TensorSpec]]:
        """Shapes and dtypes of every message of microbatch 0 for a minibatch like `inputs`."""
        return message_table(self.parts.stages, self._example_values(inputs))

    def microbatch_specs(self, named: dict[str, Any]) -> dict[Tag, list[TensorSpec]]:
        """Shapes and dtypes of every message of one microbatch (model inputs by name, as
        `RunInput.data.inputs(m)` gives them), keyed by the tags of microbatch 0.

        Working them out runs every stage forward on the microbatch (a whole minibatch under
        asynchronous 1F1B), which the first reader of a distributed run did at the start of
        every run while the other ranks waited; a table is kept per input shape
        (`shape_key`: tensors' shapes and dtypes, numbers and strings by value; inputs holding
        other objects are worked out every time), MESSAGE_TABLES_KEPT at most."""
        key = shape_key(named)
        found = self._message_tables.get((key, self.autocast)) if key is not None else None
        if found is None:
            found = message_table(self.parts.stages, self._microbatch_values(named))
            if key is not None:
                self._message_tables[key, self.autocast] = found
                while len(self._message_tables) > MESSAGE_TABLES_KEPT:
                    self._message_tables.popitem(last=False)
        else:
            self._message_tables.move_to_end((key, self.autocast))
        return {tag: list(specs) for tag, specs in found.items()}

    # ------------------------------------------------------------------ elsewhere
    def export(self, path: str) -> None:
        """Write everything needed to run or reload this pipeline (see pdcompile.export)."""
        from pdcompile.export.write import export_pipeline

        export_pipeline(self, path)

    def run_distributed(self, *args: Any, **kwargs: Any) -> Any:
        """Train on torch.distributed (pdcompile.backends.distributed.run_distributed)."""
        from pdcompile.backends import distributed

        runner = getattr(distributed, "run_distributed", None)
        if runner is None:
            raise PipelineInputError("the distributed backend has no run_distributed yet; "
                                     "export the pipeline and use `pdcompile run`")
        return runner(self.program(), *args, **kwargs)


class _Schedulers:
    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()


def _copy(module: fx.GraphModule) -> fx.GraphModule:
    return copy_module(module)


def _default_microbatches(schedule: str, plan: Plan) -> int:
    """'1f1b': the length of an exported run, at least twice the workers that hold a stage
    and a multiple of every replica count (each replica takes its turn); else one microbatch
    per stage. Idle workers do not count: a plan file saying 10**12 workers made a stream of
    2 * 10**12 microbatches."""
    if not kind(schedule).microbatched:
        need = _lcm([s.round_size for s in plan.stages])
        held = len({rank for stage in plan.stages for rank in stage.ranks})
        return need * -(-2 * held // need)
    return max(1, len(plan.stages))


def _lcm(values: list[int]) -> int:
    import math

    return math.lcm(*values) if values else 1


__all__ = ["MicrobatchData", "Pipeline", "RankState", "RunInput", "default_optimizer"]
