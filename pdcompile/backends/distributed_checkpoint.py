"""Checkpoints of a distributed run: where it resumes, and what each rank saves.

Every rank saves its weights, optimizer, RNG state, the losses so far and the data position
(runtime/checkpoint.py); a rank holding several chunks (interleaved and V-shaped schedules)
saves every chunk's weights and optimizer in its one file, under `chunks` by stage. Those
schedules all flush each minibatch, so at a checkpoint no weight version or gradient is in
flight. A run resumes from the newest step that every rank saved and that
verifies against its manifest on every rank, agreed over the group (a damaged newer one is
skipped, and rank 0 says so), and only when the checkpoint was written by the same pipeline and
stage, and by the same model: each checkpoint holds the fingerprint of what each of its stages
runs (runtime/stage_fingerprint.py), and a resume whose stages run something else is refused:
always where the parameters, their order or the graph differ; where only the layers' classes,
settings or operation names differ (what a torch upgrade can change), or the checkpoint recorded
no print, unless the user says it is the same model (`resume_anyway`, `--resume-anyway`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.backends.distributed_guard import guarded
from pdcompile.backends.launch import FaultMonitor
from pdcompile.backends.program import RunProgram
from pdcompile.errors import DamagedFileError, DistributedError
from pdcompile.runtime.checkpoint import Checkpointer, module_state, restore_module_state
from pdcompile.runtime.rank_state import RankState
from pdcompile.runtime.stage_fingerprint import first_drift, stage_fingerprint, stage_print


@dataclass
class Resume:
    """Where a rank's run starts: `done` minibatches trained before (0 from scratch), their
    `losses`, the RNG state saved with them, and the checkpointer to save to (None: none)."""

    checkpointer: Checkpointer | None = None
    done: int = 0
    losses: list[float] = field(default_factory=list)
    resumed: int | None = None  # the checkpoint step resumed from
    rng: torch.Tensor | None = None
    data_state: Any = None  # a reader's data.state_dict() at `done` (where the data has one)


def identity(program: RunProgram, stage: int | tuple[int, ...]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by a pipeline's rank (`stage`: its one
    stage, or the stages of its chunks)."""
    stages = (stage,) if isinstance(stage, int) else tuple(stage)
    return {"config": program.plan.config, "schedule": program.schedule_name,
            "stage": stages[0] if len(stages) == 1 else list(stages),
            "microbatches": program.microbatches}


RESUME_ANYWAY = "resume_anyway=True (--resume-anyway)"


def fingerprints(states: Sequence[RankState]) -> dict[str, dict[str, Any]]:
    """The print of what each stage a rank holds runs, by stage (a checkpoint's field; its
    strict and drifting parts, runtime/stage_fingerprint.py)."""
    return {str(s.stage): stage_print(s.module, s.param_order) for s in states}


def check_same_model(saved: dict[str, Any], states: Sequence[RankState],
                     folder: str | os.PathLike[str], step: int, *,
                     resume_anyway: bool = False) -> list[str]:
    """Refuse a checkpoint whose stages ran another model than `states` (same plan and
    parameter shapes, other layers: its weights would load and train on without a word).

    The contract: a difference in the strict part (state names, shapes, dtypes, parameter
    order, graph structure) is always refused. A difference only in the drifting part (module
    classes and settings, operation names: what a torch upgrade may rename), or a checkpoint
    that recorded no print of this form (written before), is refused unless `resume_anyway`;
    the lines saying what was resumed despite a difference are returned (to be printed)."""
    found = saved.get("fingerprints")
    notes = []
    for state in states:
        stage = str(state.stage)
        theirs = found.get(stage) if isinstance(found, dict) else None
        mine = stage_print(state.module, state.param_order)
        where = f"step {step} of stage {stage} in {folder}"
        if isinstance(theirs, dict) and theirs.get("strict") != mine["strict"]:
            raise DistributedError(
                f"the checkpoints in {folder} were written by another model: {where} holds the "
                f"state of another model (its parameters' or buffers' names, shapes or dtypes, "
                f"their order, or the graph its layers are called in differ); give this run "
                "another checkpoint folder, or delete this one to start afresh")
        if isinstance(theirs, dict):
            if theirs.get("drifting") == mine["drifting"]:
                continue
            what = (f"the checkpoint at {where} was written by this model's parameters and "
                    f"graph, but with other layers or operations: "
                    f"{first_drift(theirs.get('drifting'), mine['drifting'])} (a torch "
                    "upgrade can rename or reconfigure these; another model does too)")
        elif isinstance(theirs, str) and theirs == stage_fingerprint(state.module,
                                                                     state.param_order):
            continue  # written before the split, by this very model
        elif isinstance(theirs, str):
            what = (f"the checkpoint at {where} recorded its model in an older form, which "
                    "differs from this model's and cannot tell a renamed operation (a torch "
                    "upgrade) from another model")
        else:
            what = (f"the checkpoint at {where} was written before checkpoints recorded the "
                    "model they hold, so it cannot be checked to be this model's")
        if not resume_anyway:
            raise DistributedError(
                f"{what}; if this is the model that wrote it, resume anyway with "
                f"{RESUME_ANYWAY}, else give this run another checkpoint folder, or delete "
                "this one to start afresh")
        notes.append(f"{what}; resumed anyway, as {RESUME_ANYWAY} asks")
    return notes


def resume_point(program: RunProgram, states: RankState | Sequence[RankState],
                 checkpoint_dir: str | os.PathLike[str] | None, *, every: int | None,
                 keep: int, monitor: FaultMonitor | None, resume_anyway: bool = False) -> Resume:
    """The newest step every rank has saved in `checkpoint_dir` (agreed over the group: every
    rank calls it), with this rank's weights and optimizers restored into `states` (one per
    chunk it holds). `resume_anyway`: as `check_same_model`."""
    if checkpoint_dir is None:
        return Resume()
    states = _as_list(states)
    rank = states[0].rank
    ckpt = Checkpointer(checkpoint_dir, rank=rank, every=every or 1, keep=keep)
    ckpt.claim()  # before the agreement: every rank of a second run is refused at once
    try:
        ckpt.remove_stale()  # temporary files of a writer that was killed
        good, damaged = ckpt.verified_steps()
        everyone: list[Any] = [None] * dist.get_world_size()
        with guarded(monitor, "the agreement on the checkpoint to resume from"):
            dist.all_gather_object(everyone, (good, [(d.step, d.reason) for d in damaged]))
        common = set.intersection(*(set(steps_of) for steps_of, _ in everyone))
        bad = sorted((step, reason) for _, notes in everyone for step, reason in notes)
        fallback = fallback_note(checkpoint_dir, max(common, default=None), bad)
        if fallback and rank == 0:
            print(f"pdcompile: {fallback}", file=sys.stderr, flush=True)
        if not common:
            return Resume(ckpt)
        done = max(common)
        saved = ckpt.load(done)
        mine = identity(program, tuple(s.stage for s in states))
        if saved.get("pipeline") != mine:
            raise DistributedError(
                f"the checkpoints in {checkpoint_dir} were written by another pipeline "
                f"({saved.get('pipeline')}, this one is {mine}); "
                "name another checkpoint folder or delete this one")
        for note in check_same_model(saved, states, checkpoint_dir, done,
                                     resume_anyway=resume_anyway):
            print(f"pdcompile: rank {rank}: {note}", file=sys.stderr, flush=True)
        origin = f"the checkpoint of rank {rank} at step {done} in {checkpoint_dir}"
        if len(states) == 1:
            restore_module_state(saved, states[0].module, states[0].optimizer, origin=origin)
            _restore_stage_rng(saved, states[0], origin)
        else:
            chunks = saved.get("chunks")
            for state in states:
                part = chunks.get(str(state.stage)) if isinstance(chunks, dict) else None
                if not isinstance(part, dict):
                    raise DamagedFileError(f"{origin} holds no state for stage {state.stage}; "
                                           "delete it to resume from an older checkpoint")
                restore_module_state({**part, "rng": None}, state.module, state.optimizer,
                                     origin=f"{origin} (stage {state.stage})")
                _restore_stage_rng(part, state, f"{origin} (stage {state.stage})")
            _restore_rng(saved.get("rng"), origin)
        return Resume(ckpt, done, saved_losses(saved, done, origin), done, saved.get("rng"),
                      saved.get("data_state"))
    except BaseException:
        ckpt.release()  # refused or failed: the folder is free again at once
        raise


def saved_losses(saved: dict[str, Any], done: int, origin: str) -> list[float]:
    """The losses of the `done` minibatches a checkpoint holds. A checkpoint always holds one
    per minibatch (`save_checkpoint` after they are gathered); another count (a file edited
    and its manifest written anew) would surface later as a missing minibatch, deep in the run."""
    losses = saved.get("losses")
    if isinstance(losses, list) and len(losses) == done and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in losses):
        return [float(v) for v in losses]
    found = (f"{len(losses)} entries" if isinstance(losses, list) else
             "none" if losses is None else f"a {type(losses).__name__}")
    raise DamagedFileError(f"{origin} does not hold the loss of each of its {done} minibatches "
                           f"(its losses: {found}, or not all numbers); delete it to resume "
                           "from an older checkpoint")


def fallback_note(folder: str | os.PathLike[str], chosen: int | None,
                  damaged: list[tuple[int, str]]) -> str | None:
    """The line that says a newer checkpoint was skipped because it does not verify (None when
    none newer than `chosen` was)."""
    newer = [(step, reason) for step, reason in damaged if chosen is None or step > chosen]
    if not newer:
        return None
    step, reason = max(newer)
    then = (f"resuming from step {chosen}, the newest checkpoint that verifies" if chosen
            is not None else "no other checkpoint verifies, so training starts from the "
            "beginning")
    return f"the checkpoint at step {step} in {folder} is damaged ({reason}); {then}"


def save_checkpoint(ckpt: Checkpointer, program: RunProgram,
                    states: RankState | Sequence[RankState], done: int,
                    losses: list[float], *, data_state: Any = None) -> None:
    """This rank's checkpoint after `done` minibatches (every rank saves at the same step);
    `states`: one per chunk the rank holds; `data_state`: a reader's data position (its
    data's `state_dict()`), where it has one."""
    states = _as_list(states)
    extra: dict[str, Any] = {} if data_state is None else {"data_state": data_state}
    pipeline = identity(program, tuple(s.stage for s in states))
    if len(states) == 1:
        ckpt.save(done, module_state(states[0].module, states[0].optimizer, losses=list(losses),
                                     data_position=done, pipeline=pipeline,
                                     fingerprints=fingerprints(states),
                                     **_stage_rng(states[0]), **extra))
        return
    chunks = {str(s.stage): {k: v for k, v in module_state(s.module, s.optimizer,
                                                           **_stage_rng(s)).items()
                             if k != "rng"} for s in states}
    ckpt.save(done, {"chunks": chunks, "rng": torch.get_rng_state(), "losses": list(losses),
                     "data_position": done, "pipeline": pipeline,
                     "fingerprints": fingerprints(states), **extra})


def _stage_rng(state: RankState) -> dict[str, Any]:
    """The stage's own random stream (runtime/stage_random.py), where it has one."""
    return {} if state.random is None else {"stage_rng": state.random.state()}


def _restore_stage_rng(saved: dict[str, Any], state: RankState, origin: str) -> None:
    """Back to the stage stream a checkpoint holds (one written before the streams holds
    none: the stream then goes on from its seed)."""
    cpu = saved.get("stage_rng")
    if cpu is None or state.random is None:
        return
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise DamagedFileError(f"{origin} holds no random state of its stage's forwards; "
                               "delete it to resume from an older checkpoint")
    state.random.restore(cpu)


def _as_list(states: RankState | Sequence[RankState]) -> list[RankState]:
    return [states] if isinstance(states, RankState) else list(states)


def _restore_rng(rng: Any, origin: str) -> None:
    """The random-number state saved with a chunked rank's checkpoint (once for the rank)."""
    if rng is None:
        return
    try:
        torch.set_rng_state(rng)
    except (TypeError, RuntimeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedFileError(f"{origin} holds no valid random-number state ({detail}); "
                               "delete it to resume from an older checkpoint") from None


__all__ = ["RESUME_ANYWAY", "Resume", "check_same_model", "fallback_note", "fingerprints", "identity",
           "resume_point", "save_checkpoint", "saved_losses"]
