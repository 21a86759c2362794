"""The handlers a generated rank loop calls: `rt.forward(m)`, `rt.backward(m)`, `rt.step(k)`...

One `StageRuntime` serves one rank (one replica of one stage) for one run of a schedule. Every
handler is a generator (`yield from rt.<op>(...)` in the generated code) that yields only while it
waits for a message or a collective, so one driver interleaves all ranks in one process (local
backend) and another runs a rank to exhaustion over torch.distributed.

Semantics per schedule (PipeDream, Narayanan et al., SOSP 2019; PipeDream-2BW and -Flush,
Narayanan et al., ICML 2021; GPipe, Huang et al., NeurIPS 2019):

- "1f1b": a weight update after every backward (with r replicas: after each round of r
  backwards, gradients averaged over the replicas; where the replicas take unequal shares of
  a round of n, `RunConfig.shares`, after a replica's last backward of the round, its share's
  gradients summed and averaged over the n); with stashing, minibatch m's forward and
  backward use the same weight version (the one current at its forward), and the update applies
  that gradient to the latest weights. `vertical_sync`: every stage uses the version stage 0 used
  for m (the version travels with the activations). `stash=False` recomputes the forward with the
  latest weights at backward time (what happens without stashing; for comparison only).
- "1f1b-flush", "gpipe": gradients of the M microbatches (loss scaled by 1/M) accumulate, one
  update at the end: ordinary training with gradient accumulation.
- "2bw": minibatch t (microbatches tM .. tM+M-1) runs forward and backward with version
  max(t-1, 0) and its summed gradient updates the latest weights:
  W(t+1) = W(t) - lr * grad(W(t-1)). At most two versions are in use.
- "interleaved-1f1b", "zb-h1", "interleaved-zb": flush schedules like "1f1b-flush". A rank with
  several chunks has one runtime per chunk (runtime/chunks.py). Where the backward is split,
  `backward` (B) computes the input gradients and the gradients of weights whose work cannot
  wait, and defers the Linear layers' weight gradients to `backward_weight` (W; linear_grads.py),
  which also releases the microbatch's stash.

Where the schedule does not split the backward, a stage that sends input gradients upstream
still defers its Linear layers' weight gradients, to the end of its last `send_b` of the
microbatch: the previous stage's backward waits for that message, and on the loop between two
stages (PipeDream's 1F1B keeps no slack on it) every weight gradient computed before the send
would delay it. The gradients and their order of accumulation are the same; the backward's
timeline event spans its sends.

A stage in `RunConfig.recompute` runs its forward without keeping activations (no autograd
graph; only its inputs and the random state stay in the stash) and runs it again, with the same
weights and random state, at the start of its backward, on the buffers as the first run found
them (later microbatches' forwards have changed those it changes since); the buffers are then
put back, so the result equals the stage's without recomputation.

Parameters tied across stages (tied embeddings) have their gradients summed over the stages that
hold them inside `step` (an all-reduce among those ranks), so the copies stay equal; where one
rank holds several of those stages as chunks, its copies' gradients are summed on the rank first
and the rank joins the all-reduce once (runtime/chunks.py, runtime/rank_ties.py).

Buffers of a replicated stage (BatchNorm running statistics) are synchronised over its replicas
in every `step`, before the optimizer step (one all-reduce per dtype, started together with the
tied-gradient ones; at a run's first update one more per dtype, see below): a floating-point buffer
moves by the mean of the replicas' changes since the last update, so it becomes the mean over
replicas (elements no replica changes, such as a constant mask, stay bit for bit); an integer
buffer moves by their sum, so a count such as `num_batches_tracked` is what single-process
training counts. Changes are measured from the start of the run, then from each sync; the first
sync of a run also gives every replica replica 0's buffers at the start of the run as the common
base (they differ when the pipeline was called outside training, which runs replica 0: in
training mode that call updates replica 0's statistics, as calling the model would). Boolean
buffers are left alone.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from pdcompile.errors import PipelineInputError, ScheduleError
from pdcompile.runtime.finite_loss import LossGuard
from pdcompile.runtime.grad_clip import clip_factor, square_norm
from pdcompile.runtime.input_writes import read_only_inputs
from pdcompile.runtime.linear_grads import FusedRegion, run_weight_grads
from pdcompile.runtime.precision import autocast_region
from pdcompile.runtime.slowdown import stretch
from pdcompile.runtime.stage_random import StageRandom
from pdcompile.runtime.stash import StashBuffer, StashEntry, WeightVersions
from pdcompile.runtime.transport import Pending, Tag, TensorSpec, Transport
from pdcompile.runtime.weight_swap import ParameterSlots
from pdcompile.schedule.generators import copies_weights
from pdcompile.schedule.ir import Action, Kind, replica_of
from pdcompile.schedule.kinds import ScheduleKind, kind

Op = Generator[Pending, None, None]


class ValueSource(Protocol):
    """Where a stage-module input comes from (see passes/split.ValueRef)."""

    @property
    def name(self) -> str:
        """The value's name (a model input, or an output of `stage`)."""

    @property
    def stage(self) -> int | None:
        """The producing stage; None for a model input."""


class StageIO(Protocol):
    """What the runtime needs to know of a stage (see passes/split.StageProgram)."""

    index: int
    inputs: tuple[Any, ...]
    outputs: tuple[str, ...]
    receives: dict[int, tuple[str, ...]]
    sends: dict[int, tuple[str, ...]]
    kinds: dict[str, str]


class DataSource(Protocol):
    """The data of one run: model inputs and targets per microbatch (as numbered by the
    schedule)."""

    def inputs(self, microbatch: int) -> Mapping[str, Any]:
        """Model inputs by placeholder name."""

    def target(self, microbatch: int) -> Any:
        """The loss function's target."""


@dataclass(frozen=True)
class RunConfig:
    """How a run behaves (schedule semantics) and its shape."""

    schedule: str
    stage_ranks: tuple[tuple[int, ...], ...]
    microbatches_per_minibatch: int = 1
    stash: bool = True
    vertical_sync: bool = False
    recompute: frozenset[int] = frozenset()
    slowdowns: tuple[float, ...] = ()  # per rank: compute stretched (runtime/slowdown.py)
    # per stage, microbatches each replica takes per round (Schedule.shares); (): round robin
    shares: tuple[tuple[int, ...], ...] = ()
    # the largest global gradient norm of a minibatch (runtime/grad_clip.py); None: no clipping
    clip_grad_norm: float | None = None
    # the dtype name of the forwards' autocast region (runtime/precision.py); None: none
    autocast: str | None = None

    def replica_rank(self, stage: int, microbatch: int) -> int:
        """The rank of `stage` that handles `microbatch` (`Schedule.rank_of`)."""
        ranks = self.stage_ranks[stage]
        if not self.shares:
            return ranks[microbatch % len(ranks)]
        return ranks[replica_of(self.shares[stage], microbatch)]

    def round_size(self, stage: int) -> int:
        """Microbatches per round of `stage`'s replicas (its replica count under round robin)."""
        return sum(self.shares[stage]) if self.shares else len(self.stage_ranks[stage])

    def slowdown_of(self, rank: int) -> float:
        """The factor `rank`'s compute is stretched by (1.0: none)."""
        return self.slowdowns[rank] if rank < len(self.slowdowns) else 1.0

    @property
    def kind(self) -> ScheduleKind:
        """What the schedule means (`schedule.kinds`)."""
        return kind(self.schedule)

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into B (input gradients) and W (weight gradients)."""
        return self.kind.split_backward

    @property
    def loss_scale(self) -> float:
        """Flush schedules and 2bw average the loss over a minibatch's microbatches."""
        return self.kind.loss_scale(self.microbatches_per_minibatch)


@dataclass(frozen=True)
class TieGroup:
    """Tied parameters of this stage shared with other stages: summed over `ranks` (each
    rank once, however many of the stages it holds). `stages`: the stages sharing them, which
    order a rank's reductions where it holds several chunks (runtime/chunks.py), merge the
    copies of chunks of one rank (runtime/rank_ties.py) and name the stage whose copy a global
    gradient norm counts (the first)."""

    ranks: tuple[int, ...]
    names: tuple[str, ...]
    stages: tuple[int, ...]


SpecFn = Callable[[Tag], list[TensorSpec]]


class StageRuntime:
    """One rank's state for one run; the generated `run_rank(rt)` calls its handlers."""

    def __init__(self, *, rank: int, io: StageIO, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, config: RunConfig, transport: Transport,
                 data: DataSource, loss_fn: Callable[..., torch.Tensor] | None = None,
                 output_refs: Sequence[ValueSource] = (), output_spec: Any = None,
                 ties: Sequence[TieGroup] = (), specs: SpecFn | None = None,
                 recorder: Any = None, random: StageRandom | None = None) -> None:
        self.rank = rank
        # the stream the forwards draw from (runtime/stage_random.py); None: the process's
        self._random = random
        self.io = io
        self.stage = io.index
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.transport = transport
        self.data = data
        self.loss_fn = loss_fn
        self.output_refs = tuple(output_refs)
        self.output_spec = output_spec
        # a model whose output is one tensor: the loss reads it as it is (tree_unflatten costs
        # about 7 Python calls a microbatch)
        self._single_output = isinstance(output_spec, pytree.TreeSpec) and output_spec.is_leaf()
        self.ties = tuple(ties)
        # where the rank holds several chunks: their runtimes, which reduce every chunk's ties
        # in one order across ranks (set by ChunkRuntimes)
        self.rank_chunks: Any = None
        self.specs = specs
        self.recorder = recorder
        self.replicas = len(config.stage_ranks[self.stage])
        # read once: the handlers consult the schedule's meaning for every microbatch
        self.kind = config.kind
        self._loss_scale = config.loss_scale
        self.is_last = self.stage == len(config.stage_ranks) - 1
        self._slowdown = config.slowdown_of(rank)  # read for every action
        # the peer of a stage with one rank, for every message to or from it
        self._only_rank = {s: ranks[0] for s, ranks in enumerate(config.stage_ranks)
                           if len(ranks) == 1}
        self.recomputes = self.stage in config.recompute
        # a stage that sends input gradients upstream computes its Linear layers' weight
        # gradients after those sends, where the schedule does not split them off itself: the
        # previous stage's backward waits for the message, not for them (module docstring)
        self._weights_after_send = not self.kind.split_backward and bool(io.receives)
        self._defers = self.kind.split_backward or self._weights_after_send
        # the fused Linear (linear_grads.py) only pays where a weight's gradient accumulates
        # over several backwards before an update, or where its weight gradients wait; a stage
        # with one backward per update that defers nothing runs plain autograd, which computes
        # the same products (and fires gradient hooks) without an autograd Function per layer
        self._fused = self._defers or config.microbatches_per_minibatch > 1 \
            or self.replicas > 1
        self._after_send: dict[int, float] = {}  # microbatch -> its backward's start
        # received values that an input of the stage module may write in place: copied; those
        # that only operators reading them use are handed over as they are
        # (runtime/input_writes.py)
        read_only = read_only_inputs(module) if io.receives else frozenset()
        self._copied = frozenset((ref.stage, ref.name) for i, ref in enumerate(io.inputs)
                                 if i not in read_only and ref.stage is not None)
        self.params: dict[str, torch.Tensor] = dict(
            module.named_parameters(remove_duplicate=False))
        self.versions = WeightVersions(self.params, copy=copies_weights(
            config.schedule, config.stage_ranks, self.stage, vertical_sync=config.vertical_sync,
            shares=config.shares or None))
        self._slots: ParameterSlots | None = None  # found at the first stashed forward
        self.stash = StashBuffer()
        self.losses: dict[int, torch.Tensor] = {}
        # what runs now: (kind, stage, microbatch, start), for a watchdog or a model's error
        self.current: tuple[str, int, int, float] | None = None
        # a NaN or infinite loss stops the run (runtime/finite_loss.py; None: keep going)
        self.loss_guard: LossGuard | None = LossGuard(
            per_minibatch=config.microbatches_per_minibatch)
        self.completed = 0  # actions finished (the local driver watches it for progress)
        self._received: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._grads_in: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._grads_out: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._sync_version: dict[int, int] = {}
        self._forwards_done: dict[int, int] = {}
        self._fresh = True  # next gradient contribution starts a new accumulation
        # replicated stage: buffer values at the last sync (the start of the run at first), in
        # groups of one dtype and device (one all-reduce each, the same order on every replica)
        self._synced: dict[str, torch.Tensor] = {}
        self._sync_groups: list[list[str]] = []
        self._base_pending = True  # the first sync takes replica 0's starting values
        if self.replicas > 1:
            groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
            for name, buffer in module.named_buffers():
                if buffer.dtype == torch.bool or buffer.is_complex():
                    continue
                self._synced[name] = buffer.detach().clone()
                groups.setdefault((buffer.dtype, buffer.device), []).append(name)
            self._sync_groups = list(groups.values())

    # ------------------------------------------------------------------ helpers
    def _peer_rank(self, stage: int, microbatch: int) -> int:
        only = self._only_rank.get(stage)
        return only if only is not None else self.config.replica_rank(stage, microbatch)

    def _wait(self, pending: Pending) -> Generator[Pending, None, list[torch.Tensor]]:
        while not pending.ready():
            yield pending
        return pending.wait()

    def _record(self, kind: Kind, number: int, peer: int | None, start: float, *,
                counted: bool = False) -> None:
        """One action done (`counted`: its completion was counted when it ended its part
        that others wait for); its event, if this run records a timeline."""
        if not counted:
            self.completed += 1
        if self.recorder is not None:
            self.recorder.add(Action(self.stage, kind, number, peer), start, time.time())

    def _spec(self, tag: Tag) -> list[TensorSpec]:
        return self.specs(tag) if self.specs is not None else []

    def _carries_version(self) -> bool:
        return self.config.vertical_sync

    # ------------------------------------------------------------------ communication
    def recv_f(self, microbatch: int, src: int) -> Op:
        """Receive the activations `src` stage sends this stage for `microbatch`."""
        start = time.time()
        tag = Tag("act", src, self.stage, microbatch)
        got = yield from self._wait(
            self.transport.recv(self._spec(tag), self._peer_rank(src, microbatch), tag))
        if self._carries_version():
            self._sync_version[microbatch] = int(got[-1].item())
            got = got[:-1]
        leaves = [_decode(t, self.io.kinds.get(name))
                  for name, t in zip(self.io.receives[src], got, strict=True)]
        self._received.setdefault(microbatch, {})[src] = leaves
        self._record(Kind.RECV_F, microbatch, src, start)

    def send_f(self, microbatch: int, dst: int) -> Op:
        """Send `dst` stage the values it needs from this stage's forward of `microbatch`."""
        start = time.time()
        entry = self.stash.get(microbatch)
        tensors = [_encode(entry.values[name], name) for name in self.io.sends[dst]]
        if self._carries_version():
            tensors.append(torch.tensor(entry.version, dtype=torch.int64))
        self.transport.send(tensors, self._peer_rank(dst, microbatch),
                            Tag("act", self.stage, dst, microbatch))
        self._record(Kind.SEND_F, microbatch, dst, start)
        yield from ()

    def recv_b(self, microbatch: int, src: int) -> Op:
        """Receive the gradients of the values sent to `src` stage for `microbatch`."""
        start = time.time()
        tag = Tag("grad", src, self.stage, microbatch)
        got = yield from self._wait(
            self.transport.recv(self._spec(tag), self._peer_rank(src, microbatch), tag))
        self._grads_in.setdefault(microbatch, {})[src] = got
        self._record(Kind.RECV_B, microbatch, src, start)

    def send_b(self, microbatch: int, dst: int) -> Op:
        """Send `dst` stage the gradients of the activations it sent for `microbatch`."""
        start = time.time()
        grads = self._grads_out[microbatch].pop(dst)
        if not self._grads_out[microbatch]:
            del self._grads_out[microbatch]
        self.transport.send(grads, self._peer_rank(dst, microbatch),
                            Tag("grad", self.stage, dst, microbatch))
        self._record(Kind.SEND_B, microbatch, dst, start)
        if microbatch not in self._grads_out and microbatch in self._after_send:
            self._finish_backward(microbatch)  # every send is on its way: the weight gradients
        yield from ()

    # ------------------------------------------------------------------ compute
    def _version_for(self, microbatch: int) -> int:
        """The weight version this stage's forward of `microbatch` uses."""
        config = self.config
        if self.kind.double_buffered:
            return max(microbatch // config.microbatches_per_minibatch - 1, 0)
        if config.vertical_sync and self.stage > 0:
            return self._sync_version[microbatch]
        return self.versions.current

    def _arguments(self, microbatch: int, received: dict[int, list[torch.Tensor]]) -> list[Any]:
        by_name: dict[tuple[int, str], Any] = {}
        for src, tensors in received.items():
            for name, tensor in zip(self.io.receives[src], tensors, strict=True):
                # a non-leaf copy where the stage may modify its input in place
                # (ReLU(inplace=True)), autograd forbidding it on a leaf
                by_name[src, name] = tensor.clone() if (src, name) in self._copied and \
                    _carries_grad(tensor) else tensor
        data = self.data.inputs(microbatch) if any(r.stage is None for r in self.io.inputs) \
            else {}
        return [data[ref.name] if ref.stage is None else by_name[ref.stage, ref.name]
                for ref in self.io.inputs]

    def _run(self, entry: StashEntry, microbatch: int, *, graph: bool = True) -> None:
        """The stage module (and, on the last stage, the loss) on the stashed inputs; with
        `graph=False` no autograd graph is kept (a recomputing stage's first forward)."""
        fused = FusedRegion(entry.weight_grads if self._defers else None) if self._fused \
            else nullcontext()
        with torch.enable_grad() if graph else torch.no_grad(), fused, \
                autocast_region(self.config.autocast, self.module):
            if self.versions.is_master(entry.params):
                outputs = self.module(*entry.inputs)
            else:  # a stashed version in the parameters' places (torch.func.functional_call)
                if self._slots is None:
                    self._slots = ParameterSlots(self.module, list(self.params))
                outputs = self._slots.call(entry.params, entry.inputs)
            entry.values = dict(zip(self.io.outputs, outputs, strict=True))
            if self.is_last:
                entry.loss = self._loss(entry, microbatch)

    def _loss(self, entry: StashEntry, microbatch: int) -> torch.Tensor:
        leaves = []
        data: Mapping[str, Any] = {}
        for ref in self.output_refs:
            if ref.stage is None:
                data = data or self.data.inputs(microbatch)
                leaves.append(data[ref.name])
            elif ref.stage == self.stage:
                leaves.append(entry.values[ref.name])
            else:
                names = self.io.receives[ref.stage]
                leaves.append(entry.received[ref.stage][names.index(ref.name)])
        output = leaves[0] if self._single_output and len(leaves) == 1 \
            else pytree.tree_unflatten(leaves, self.output_spec)
        if self.loss_fn is None:
            loss = output
        else:
            loss = self.loss_fn(output, self.data.target(microbatch))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise PipelineInputError(
                "the loss must be a tensor with one element; pass loss_fn=(output, target) -> "
                "scalar to compile(), or make the model return its loss (got "
                f"{type(loss).__name__}{shape})")
        return loss.reshape(())

    def forward(self, microbatch: int) -> Op:
        """Forward of `microbatch` through the stage with its weight version; stash it."""
        start = time.time()
        self.current = ("forward", self.stage, microbatch, start)
        version = self._version_for(microbatch)
        if version > self.versions.current:
            raise ScheduleError(
                f"stage {self.stage} (rank {self.rank}) needs weight version {version} for "
                f"microbatch {microbatch} but has only reached version {self.versions.current}; "
                "with '2bw' use at least as many microbatches per minibatch as stages")
        if self.config.vertical_sync and self.stage > 0:
            self.versions.unkeep_below(version)
        received = self._received.pop(microbatch, {})
        params = self.versions.acquire(version) if self.config.stash else self.params
        entry = StashEntry(version, params, self._arguments(microbatch, received), received)
        with nullcontext() if self._random is None else self._random.drawing():
            self._forward_entry(entry, microbatch)
        if entry.loss is not None:
            if self.loss_guard is not None:
                self.loss_guard.check(entry.loss, rank=self.rank, stage=self.stage,
                                      microbatch=microbatch)
            # a copy: torch's CPU mse_loss returns its mean as a view of the whole elementwise
            # buffer, so a window of kept losses pinned a window of output-sized buffers
            self.losses[microbatch] = entry.loss.detach().clone()
        self.stash.put(microbatch, entry)
        if self.kind.double_buffered:
            self._count_forward(microbatch)
        if self._slowdown > 1.0:
            stretch(start, self._slowdown)
        self._record(Kind.F, microbatch, None, start)
        yield from ()

    def _forward_entry(self, entry: StashEntry, microbatch: int) -> None:
        """The forward itself: with its autograd graph, or without one (a stage that
        recomputes, whose backward runs it again from the random state recorded here)."""
        if self.recomputes:
            entry.rng = _random_state()
        if self.config.stash and not self.recomputes:
            self._run(entry, microbatch)
        elif self.recomputes:
            before = [(b, b.detach().clone()) for b in self.module.buffers()]
            self._run(entry, microbatch, graph=False)
            # what the recomputation must find in the buffers that this forward changes (the
            # forwards of later microbatches change them again before it runs)
            entry.buffers = [(b, old) for b, old in before if not torch.equal(b, old)]
        else:
            with torch.no_grad():
                self._run(entry, microbatch)

    def _count_forward(self, microbatch: int) -> None:
        """2bw: once all of minibatch t's forwards ran here, version t-1 may be dropped."""
        per = self.config.microbatches_per_minibatch
        t = microbatch // per
        self._forwards_done[t] = self._forwards_done.get(t, 0) + 1
        if self._forwards_done[t] == per // self.replicas:
            self.versions.unkeep(max(t - 1, 0))

    def backward(self, microbatch: int) -> Op:
        """Backward of `microbatch` with its stashed version; gradients go to the live weights."""
        start = time.time()
        self.current = ("backward", self.stage, microbatch, start)
        entry = self.stash.get(microbatch)
        if not self.config.stash:  # no stashing: recompute with the latest weights
            for tensors in entry.received.values():
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        t.grad = None
            entry.params = self.params
            self._run(entry, microbatch)
        elif self.recomputes:  # the activations again, as the forward made them
            self._recompute(entry, microbatch)
        self._start_accumulation()
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if entry.loss is not None and entry.loss.requires_grad:
            # a scale of 1 (asynchronous 1F1B's whole minibatches) would add a multiply and its
            # backward to the graph for a product equal to the loss
            scale = self._loss_scale
            roots.append(entry.loss if scale == 1 else entry.loss * scale)
            grads.append(None)
        for dst, received in self._grads_in.pop(microbatch, {}).items():
            floating = [n for n in self.io.sends[dst] if _carries_grad(entry.values[n])]
            for name, grad in zip(floating, received, strict=True):  # only floats get gradients
                value = entry.values[name]
                if value.requires_grad:
                    roots.append(value)
                    grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)  # type: ignore[arg-type]
        out: dict[int, list[torch.Tensor]] = {}
        for src, tensors in entry.received.items():
            out[src] = [t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in tensors if _carries_grad(t)]
        if out:
            self._grads_out[microbatch] = out
        if self.kind.split_backward or (out and entry.weight_grads):
            # W, or the last send_b, finishes the microbatch; free what it does not need
            entry.inputs, entry.received, entry.values, entry.loss = [], {}, {}, None
        else:
            run_weight_grads(entry.weight_grads)  # deferred, but nothing to send first
            self._release(entry, microbatch)
        if self._slowdown > 1.0:
            stretch(start, self._slowdown)
        if self.kind.split_backward or not (out and entry.weight_grads):
            self._record(Kind.B, microbatch, None, start)
        else:  # recorded once its weight gradients are done (`_finish_backward`)
            self._after_send[microbatch] = start
            self.completed += 1
        yield from ()

    def _finish_backward(self, microbatch: int) -> None:
        """The weight gradients a backward left until its input gradients were sent; then the
        microbatch leaves the stash. Its event spans the whole backward, sends included."""
        start = self._after_send.pop(microbatch)
        entry = self.stash.get(microbatch)
        begun = time.time()
        run_weight_grads(entry.weight_grads)
        if self._slowdown > 1.0:
            stretch(begun, self._slowdown)
        self._release(entry, microbatch)
        self._record(Kind.B, microbatch, None, start, counted=True)

    def _finish_backwards(self) -> None:
        """Every backward still waiting for its sends (none where every send follows its
        backward, as lowering places them): before an update reads the gradients."""
        for microbatch in list(self._after_send):
            self._finish_backward(microbatch)

    def backward_weight(self, microbatch: int) -> Op:
        """The weight gradients `backward` deferred (W of a split backward), into the live
        weights' `.grad`; then the microbatch leaves the stash."""
        start = time.time()
        entry = self.stash.get(microbatch)
        run_weight_grads(entry.weight_grads)
        self._release(entry, microbatch)
        if self._slowdown > 1.0:
            stretch(start, self._slowdown)
        self._record(Kind.W, microbatch, None, start)
        yield from ()

    def _release(self, entry: StashEntry, microbatch: int) -> None:
        """The microbatch's gradients are all computed: hand them to the live weights, drop
        its stash and its hold on its weight version."""
        self._collect(entry.params)
        self.stash.pop(microbatch)
        if self.config.stash:
            self.versions.release(entry.version)

    def _recompute(self, entry: StashEntry, microbatch: int) -> None:
        """Run the forward of `microbatch` again with its weights and random state, keeping
        the activations this time, on the buffers as its forward found them (a forward that
        reads what it changes, such as spectral norm's power iteration, computes the same
        activations); the buffers then keep their values (BatchNorm statistics)."""
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        for buffer, before in entry.buffers:
            buffer.data.copy_(before)
        entry.inputs = self._arguments(microbatch, entry.received)  # fresh: in-place ops
        now = _random_state()
        _set_random_state(entry.rng)
        try:
            self._run(entry, microbatch)
        finally:
            _set_random_state(now)
        for buffer, saved in buffers:  # untracked: the new graph saved the running statistics
            buffer.data.copy_(saved)

    def _collect(self, params: dict[str, torch.Tensor]) -> None:
        """Move gradients from a stashed version's leaves into the live parameters' `.grad`."""
        if params is self.params:
            return
        seen: set[int] = set()
        for name, leaf in params.items():
            if id(leaf) in seen or leaf.grad is None:
                continue
            seen.add(id(leaf))
            p = self.params[name]
            # the first contribution is moved, not copied: the leaf lets go of it below
            p.grad = leaf.grad if p.grad is None else p.grad.add_(leaf.grad)
            leaf.grad = None

    def _start_accumulation(self) -> None:
        """Drop the gradients of the last update before the first contribution to the next
        one: at the first backward after a step, or at an all-reduce or step that comes before
        any (a replica that no microbatch of the minibatch reached, with fewer microbatches than
        replicas), which would otherwise apply the gradients of the last update again."""
        if self._fresh:
            for p in self.params.values():
                p.grad = None
            self._fresh = False

    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The live parameters, their gradients (zeros where none was computed) and a flag per
        parameter, 1 where this replica computed a gradient for it. Summed over the replicas
        with the gradients, a flag left at 0 says that no microbatch gave the parameter a
        gradient (frozen, used only under no_grad, or used by no microbatch), so that it keeps
        none, as in one process: the optimizer then leaves it alone (a zero gradient is not the
        same: weight decay moves it)."""
        params = list(_unique(self.params.values()))
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.bool)
        flags = torch.tensor([float(p.grad is not None) for p in params],  # one flat all-reduce
                             dtype=dtype if dtype.is_floating_point or dtype.is_complex
                             else torch.float32)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return params, [p.grad for p in params], flags  # type: ignore[misc]

    # ------------------------------------------------------------------ updates
    def all_reduce(self, index: int) -> Op:
        """Sum the gradients over the stage's replicas (for asynchronous 1f1b, averaged over the
        round's minibatches: each replica has summed those of its share)."""
        start = time.time()
        self.settle_gradients()
        params, grads, flags = self._grads()
        ranks = self.config.stage_ranks[self.stage]
        if grads:
            yield from self._wait(self.transport.all_reduce([*grads, flags], ranks))
            if self.kind.averages_replicas:
                for g in grads:
                    g.div_(self.config.round_size(self.stage))
            for p, flag in zip(params, flags.tolist(), strict=True):
                if not flag:
                    p.grad = None
        self._record(Kind.ALLREDUCE, index, None, start)

    def step(self, index: int) -> Op:
        """Optimizer step: a new weight version (tied gradients summed over stages first, a
        replicated stage's buffers synchronised)."""
        start = time.time()
        self.settle_gradients()
        # every collective is started before any is awaited: the last rank to join them all
        # finishes the step at once (the local driver sees progress only when an action ends)
        pending = []
        if self.rank_chunks is not None:
            pending.extend(self.rank_chunks.reduce_ties(index))
        else:
            pending.extend(self.reduce_tie(group) for group in self.ties)
        finish_sync = self._start_buffer_sync(pending)
        for started in pending:
            yield from self._wait(started)
        finish_sync()
        if self.config.clip_grad_norm is not None and self.rank_chunks is not None:
            yield from self.rank_chunks.clip_gradients(index, self.config.clip_grad_norm)
        elif self.config.clip_grad_norm is not None:
            yield from self._clip_gradients(self.config.clip_grad_norm)
        self._keep_for_later()
        self.optimizer.step()
        self.versions.advance()
        self._fresh = True
        self._record(Kind.STEP, index, None, start)

    def settle_gradients(self) -> None:
        """Before an update reads the gradients: every deferred part of a backward done, and
        those of the last update dropped where no backward came since (`_start_accumulation`)."""
        self._finish_backwards()
        self._start_accumulation()

    def reduce_tie(self, group: TieGroup) -> Pending:
        """Start summing the gradients of a tie group over its ranks (each replica's share)."""
        tied = [self.params[name] for name in group.names]
        for p in tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.replicas)
        return self.transport.all_reduce([p.grad for p in tied],  # type: ignore[misc]
                                         group.ranks)

    def _clip_gradients(self, max_norm: float) -> Generator[Pending, None, None]:
        """Scale this stage's gradients by the factor of the whole model's gradient norm
        (runtime/grad_clip.py): one all-reduce of a number over every rank."""
        total = self.gradient_squares()
        yield from self._wait(self.transport.all_reduce([total], self.everyone()))
        self.scale_gradients(clip_factor(total, max_norm))

    def gradient_squares(self) -> torch.Tensor:
        """This stage's share of the squared global gradient norm: the sum of the squares of
        its gradients, a replica's divided by the replicas, a tied parameter counted by the
        first stage holding it only (one of several chunks of a rank included)."""
        elsewhere = {id(self.params[name]) for group in self.ties
                     if min(group.stages) != self.stage for name in group.names}
        counted = [p.grad for p in _unique(self.params.values())
                   if p.grad is not None and id(p) not in elsewhere]
        return square_norm(counted, share=self.replicas)  # type: ignore[arg-type]

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient of the stage by `factor` (the clipping factor)."""
        for p in _unique(self.params.values()):
            if p.grad is not None:
                p.grad.mul_(factor)

    def everyone(self) -> list[int]:
        """Every rank of the pipeline (the group of the global gradient norm)."""
        return sorted({r for ranks in self.config.stage_ranks for r in ranks})

    def _start_buffer_sync(self, pending: list[Pending]) -> Callable[[], None]:
        """Replicated stage: start the all-reduces (appended to `pending`) after which every
        replica's buffers move by the mean (floating point) or the sum (integers) of all
        replicas' changes since the last sync; the function returned applies them once done
        (see the module docstring)."""
        if not self._sync_groups:
            return lambda: None
        ranks = self.config.stage_ranks[self.stage]
        buffers = dict(self.module.named_buffers())
        deltas: dict[str, torch.Tensor] = {}
        bases: dict[str, torch.Tensor] = {}
        for names in self._sync_groups:
            if self._base_pending:  # a broadcast from replica 0: the others add zeros
                group = [self._synced[name].clone() if self.rank == ranks[0] else
                         torch.zeros_like(self._synced[name]) for name in names]
                pending.append(self.transport.all_reduce(group, ranks))
                bases.update(zip(names, group, strict=True))
            group = [_change(buffers[name].detach(), self._synced[name]) for name in names]
            pending.append(self.transport.all_reduce(group, ranks))
            deltas.update(zip(names, group, strict=True))
        self._base_pending = False

        def finish() -> None:
            for name, base in bases.items():  # equal values stay as they are (-0.0, NaN)
                own = self._synced[name]
                self._synced[name] = torch.where((base == own) | (base.isnan() & own.isnan()),
                                                 own, base) if own.is_floating_point() else base
            with torch.no_grad():
                for name, delta in deltas.items():
                    synced = self._synced[name]
                    if synced.is_floating_point():  # unchanged elements (inf, -0.0) stay as is
                        synced.copy_(torch.where(delta == 0, synced,
                                                 synced + delta / self.replicas))
                    else:
                        synced.add_(delta)
                    # through .data: the autograd graphs of microbatches in flight (1f1b) saved
                    # the running statistics, which a training-mode backward does not read; a
                    # tracked write would fail their version check like any in-place change
                    buffers[name].data.copy_(synced)
        return finish

    def _keep_for_later(self) -> None:
        """Before an update: hold the current version if a later forward will still use it."""
        current = self.versions.current
        if self.kind.double_buffered:
            per = self.config.microbatches_per_minibatch // self.replicas
            if self._forwards_done.get(current + 1, 0) < per:
                self.versions.keep(current)
        elif self.config.vertical_sync and self.stage > 0:
            self.versions.keep(current)

    def finish(self) -> None:
        """End of the run: nothing may remain in flight; drop every kept version."""
        self._finish_backwards()
        if self.stash.entries:
            raise ScheduleError(f"rank {self.rank}: microbatches {sorted(self.stash.entries)} "
                                "were forwarded but never backpropagated")
        self.versions.clear()
        # the run's minibatches: a finished runtime stays inspectable (Pipeline.last_runtimes)
        # without holding a window of data until the next run replaces it
        self.data = RunOver(self.rank)


class RunOver:
    """The data of a finished run: none (a runtime asked for it after `finish` is a bug)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def inputs(self, microbatch: int) -> Mapping[str, Any]:
        raise ScheduleError(f"rank {self.rank} read microbatch {microbatch}'s inputs after "
                            "its run finished")

    def target(self, microbatch: int) -> Any:
        raise ScheduleError(f"rank {self.rank} read microbatch {microbatch}'s target after "
                            "its run finished")


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This process's CPU and CUDA random states (a recomputed forward draws the same)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _carries_grad(value: Any) -> bool:
    """Floating-point and complex tensors travel with gradients (an FFT's output is complex);
    ints, masks and Python numbers do not."""
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _change(value: torch.Tensor, synced: torch.Tensor) -> torch.Tensor:
    """How far a buffer moved since the last sync; zero where it did not (infinities and NaNs
    that stayed included)."""
    if not value.is_floating_point():
        return value - synced
    same = (value == synced) | (value.isnan() & synced.isnan())
    return torch.where(same, torch.zeros_like(value), value - synced)


# dtypes that cross stages travel as their index here (a model read `x.dtype` in one stage
# and used it in a later one)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
           torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
           torch.bool)


def _encode(value: Any, name: str) -> torch.Tensor:
    """A value as a tensor for the transport (Python numbers and sizes as 0-d / 1-d tensors, a
    float as float64 so that it arrives exactly, a dtype as its index in `_DTYPES`, a device as
    a 0-d tensor: `_decode` makes it the receiver's own, where its activations live)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, float):  # Python floats are doubles: float32 (torch's default)
        return torch.tensor(value, dtype=torch.float64)  # rounded them (1e-8 off a scale)
    if isinstance(value, bool | int):
        return torch.tensor(value)
    if isinstance(value, torch.Size | tuple | list) and all(isinstance(v, int) for v in value):
        return torch.tensor(list(value), dtype=torch.int64)
    if isinstance(value, torch.dtype) and value in _DTYPES:
        return torch.tensor(_DTYPES.index(value), dtype=torch.int64)
    if isinstance(value, torch.device):
        return torch.tensor(0, dtype=torch.int64)
    raise PipelineInputError(f"value {name!r} ({type(value).__name__}) crosses stages, but only "
                             "tensors, numbers, sizes, dtypes and devices can; move the cut so "
                             "that it stays inside one stage")


def _decode(tensor: torch.Tensor, kind: str | None) -> Any:
    """Inverse of `_encode`; received tensors that carry gradients (`_carries_grad`) become
    leaves that collect them."""
    if kind is None:
        return tensor.detach().requires_grad_(True) if _carries_grad(tensor) else tensor
    if kind == "size":
        return torch.Size(tensor.tolist())
    if kind in ("tuple", "list"):
        return {"tuple": tuple, "list": list}[kind](tensor.tolist())
    if kind == "dtype":
        return _DTYPES[int(tensor.item())]
    if kind == "device":
        return tensor.device
    return {"int": int, "float": float, "bool": bool}[kind](tensor.item())


def value_kind(value: Any) -> str | None:
    """How a non-tensor value travels (None for tensors); see `_encode`."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, torch.Size):
        return "size"
    return type(value).__name__


def _unique(tensors: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


__all__ = ["DataSource", "RunConfig", "StageIO", "StageRuntime", "TieGroup", "ValueSource",
           "value_kind"]
