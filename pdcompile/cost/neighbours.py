"""Busy neighbours: helper processes that keep the other cores working while the cost pass times
nodes.

Why: a pipeline worker does not run alone. On one host every stage computes at the same time
and all of them share the last-level cache and the memory bandwidth, so the same layer runs
slower in a pipeline than in a profiler that has the machine to itself (on the 2-core
development VM a busy neighbour slowed whole-model forward+backward by 5-10%; the larger gap
between profile and run seen there had other causes: benchmarks/results/simulator.md). Timing
each node while N-1 other processes run a realistic workload (by default the same model's
forward and backward) measures the compute a worker of an N-process pipeline actually gets.

    with busy_neighbours(1, TrainStep(model, (x,))):
        ...  # time things here; one other core runs model's forward + backward in a loop
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from pdcompile.errors import PdcompileError

PICKLE_FIX = ("each neighbour process gets its own copy of the workload (the model and its "
              "example inputs), so it must pickle: define the model's classes and the functions "
              "it calls at module level of an importable module (not inside a function or as a "
              "lambda), or profile with neighbours=0")


@dataclass(frozen=True)
class Neighbours:
    """The running helper processes (what `busy_neighbours` yields)."""

    processes: tuple[BaseProcess, ...]

    @property
    def pids(self) -> tuple[int | None, ...]:
        return tuple(p.pid for p in self.processes)


class TrainStep:
    """One training step's compute on fixed inputs: forward with autograd, then backward from
    all-ones gradients of the float outputs. This is what every pipeline worker spends its time
    on, so it loads the shared caches and memory bandwidth the way real neighbours would."""

    def __init__(self, model: nn.Module, inputs: Sequence[Any],
                 kwargs: dict[str, Any] | None = None) -> None:
        self.model = model
        self.inputs = tuple(tree_map(_leaf, list(inputs)))
        self.kwargs = dict(tree_map(_leaf, dict(kwargs or {})))

    def __call__(self) -> None:
        out = self.model(*self.inputs, **self.kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["model"] = _portable(self.model)
        return state


def _leaf(x: Any) -> Any:
    """Tensors as autograd leaves (a non-leaf tensor cannot be pickled), same requires_grad."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _portable(model: nn.Module) -> nn.Module:
    """A GraphModule that unpickles anywhere: fx rebuilds a pickled GraphModule by retracing its
    generated code with the tracer class it was traced with, which fails for tracers that take
    constructor arguments (pdcompile's policy tracer); the generated code only calls submodules
    and functions, so fx's plain Tracer rebuilds the same graph. Shares the parameters; the
    original module and its graph are left untouched."""
    if not isinstance(model, fx.GraphModule):
        return model
    clone = fx.GraphModule(model, copy.deepcopy(model.graph), class_name=type(model).__name__)
    clone._tracer_cls = None
    clone._tracer_extras = {}
    return clone


def check_count(count: object, what: str = "neighbours") -> int:
    """`count` as a number of neighbour processes, or a PdcompileError saying what is allowed."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise PdcompileError(f"{what} must be a whole number >= 0 (got {count!r}): the number of "
                             "other busy pipeline workers sharing this machine (N-1 for N "
                             "workers on one host)")
    return count


@contextlib.contextmanager
def busy_neighbours(count: int, work: Callable[[], object] | None, *, threads: int = 1,
                    start_timeout: float = 120.0,
                    stop_timeout: float = 10.0) -> Iterator[Neighbours]:
    """Run `work()` in a loop in `count` helper processes (spawned, daemon, `threads` torch
    threads each) for the duration of the block.

    Each process gets its own pickled copy of `work` and signals once it has run it once, so
    when the block starts every neighbour is warm and busy. On leaving (also on an exception)
    they are terminated and joined within `stop_timeout` seconds, then killed. A neighbour that
    cannot load or run its workload, or does not start within `start_timeout` seconds, raises a
    PdcompileError; so does one that stopped while the block ran (the timings taken there had
    fewer neighbours than asked). `count` 0 runs nothing.
    """
    check_count(count)
    if count == 0:
        yield Neighbours(())
        return
    if work is None:
        raise PdcompileError(f"busy_neighbours({count}) needs a workload to run (e.g. "
                             "TrainStep(model, example_inputs))")
    try:
        payload = pickle.dumps(work)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as err:
        raise PdcompileError(f"the neighbours' workload cannot be pickled ({err}); "
                             f"{PICKLE_FIX}") from None
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        for index in range(count):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            proc = ctx.Process(target=_neighbour_main,
                               args=(payload, writer, threads, os.getpid()),
                               name=f"pdcompile-neighbour-{index}", daemon=True)
            try:
                proc.start()
            finally:
                writer.close()  # the child holds its own end; EOF here means it exited
            procs.append(proc)
        _wait_ready(procs, readers, start_timeout)
        yield Neighbours(tuple(procs))
        stopped = [i for i, p in enumerate(procs) if not p.is_alive()]
        if stopped:
            raise PdcompileError(
                f"neighbour(s) {stopped} stopped while the block ran (exit codes "
                f"{[procs[i].exitcode for i in stopped]}), so part of it ran with fewer "
                "neighbours than asked; see their stderr")
    finally:
        for reader in readers:
            reader.close()
        _stop(procs, stop_timeout)


def _wait_ready(procs: list[BaseProcess], readers: list[Connection], timeout: float) -> None:
    """Block until every neighbour has run its workload once (or raise why one did not)."""
    deadline = time.monotonic() + timeout
    for index, (proc, reader) in enumerate(zip(procs, readers, strict=True)):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not reader.poll(remaining):
            raise PdcompileError(f"neighbour {index} did not run its workload once within "
                                 f"{timeout:.0f} s; a smaller workload or a larger "
                                 "start_timeout is needed")
        try:
            stage, detail = reader.recv()
        except EOFError:
            proc.join(1.0)
            raise PdcompileError(f"neighbour {index} exited (code {proc.exitcode}) before it "
                                 "ran its workload once; see its stderr") from None
        if stage == "load":
            raise PdcompileError(f"neighbour {index} could not load its workload ({detail}); "
                                 f"{PICKLE_FIX}")
        if stage == "run":
            raise PdcompileError(f"neighbour {index} failed running its workload: {detail}")


def _stop(procs: list[BaseProcess], timeout: float) -> None:
    """Terminate, join within `timeout` seconds in all, kill what is left."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout)


def _neighbour_main(payload: bytes, conn: Connection, threads: int, parent: int) -> None:
    """A neighbour process: load the workload, run it once, report, then loop until killed, or
    until its parent is gone (a parent killed outright cannot stop it; it must not spin on)."""
    from pdcompile.runtime.allocator import tune_allocator

    torch.set_num_threads(threads)
    tune_allocator()  # as a pipeline worker runs
    try:
        try:
            work = pickle.loads(payload)
        except Exception as err:
            conn.send(("load", f"{type(err).__name__}: {err}"))
            return
        try:
            work()
        except Exception as err:
            conn.send(("run", f"{type(err).__name__}: {err}"))
            return
        conn.send(("ready", ""))
    finally:
        conn.close()
    while os.getppid() == parent:
        work()
