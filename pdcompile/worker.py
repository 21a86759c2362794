"""A worker of an exported pipeline: it loads the export and trains its rank on torch.distributed.

    torchrun --nproc-per-node=N -m pdcompile.worker EXPORT_DIR [--steps S]
        [--checkpoint-dir D --checkpoint-every K] [--fault-timeout T] [--data FILE.py:FUNCTION]

`main` is one worker, as `pdcompile run` and torchrun start it: it initialises the default
process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), loads
the export, trains it with `run_distributed` and prints the progress on the rank that computes
the losses and the summary on rank 0. Without `--data`, the example minibatch saved at export
time is trained again and again (`--steps`, default DEFAULT_STEPS). With a checkpoint folder, a
worker restarted by `torchrun --max-restarts` resumes from the newest checkpoint every rank
saved. `train_processes` starts N workers on this machine from Python instead.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pdcompile.backends.launch import DEFAULT_FAULT_TIMEOUT
from pdcompile.backends.run_report import LOSSES_FILE, RunReport, default_run_dir, summary
from pdcompile.errors import AnnouncedInputError, DistributedError, PdcompileError

if TYPE_CHECKING:
    from pdcompile.backends.distributed import DistributedRun
    from pdcompile.backends.launch import Worker

# test hook only: "RANK:MINIBATCH" makes that rank (one that reads data) kill itself (SIGKILL)
# when it reads that minibatch in the first attempt of a torchrun run (restart count 0)
DIE_ENV = "PDCOMPILE_TEST_DIE_AT"
# minibatches trained on the exported example when neither --steps nor --data is given
DEFAULT_STEPS = 20


def parser() -> argparse.ArgumentParser:
    """The worker's command line."""
    out = argparse.ArgumentParser(prog="python -m pdcompile.worker",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("export_dir", metavar="EXPORT_DIR")
    add_training_options(out, fault_timeout=DEFAULT_FAULT_TIMEOUT)
    return out


def add_training_options(group: Any, *, fault_timeout: float | None) -> None:
    """The training options, declared once: the worker's, and `pdcompile run`'s, which passes
    them through (`training_arguments`). `fault_timeout`: the default (None: the worker's)."""
    group.add_argument("--steps", type=int, default=None,
                       help="minibatches to train (default: all of --data; without --data, "
                            f"the exported example minibatch {DEFAULT_STEPS} times)")
    group.add_argument("--checkpoint-dir", default=None)
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                       help="checkpoint every K minibatches")
    group.add_argument("--fault-timeout", type=float, default=fault_timeout, metavar="SECONDS",
                       help="a worker that dies, or stops answering for this long, is named "
                            f"by the others, which stop (default {DEFAULT_FAULT_TIMEOUT:g})")
    group.add_argument("--data", default=None, metavar="FILE.py:FUNCTION",
                       help="FUNCTION() returns an iterable of (inputs, target) minibatches, the "
                            "same in every process (default: the exported example minibatch, "
                            "repeated)")
    group.add_argument("--threads", type=int, default=None,
                       help="torch threads per worker process (default: torch's, "
                            "OMP_NUM_THREADS)")
    group.add_argument("--timeline", default=None, metavar="FILE.json",
                       help="record a measured timeline of every rank; rank 0 writes it here")
    group.add_argument("--allow-nonfinite", action="store_true",
                       help="keep training after a NaN or infinite loss (default: stop, naming "
                            "its step, rank and stage)")
    group.add_argument("--resume-anyway", action="store_true",
                       help="resume from --checkpoint-dir even where its checkpoints record the "
                            "model's layers or operations under other names or settings (a "
                            "torch upgrade can change them) or record no model (written by an "
                            "older pdcompile); never where its parameters, their order or the "
                            "graph differ")
    group.add_argument("--trust", action="store_true",
                       help="let the export import modules other than torch, pdcompile and "
                            "those it recorded (an export is code: only for exports you trust)")
    group.add_argument("--seed", type=int, default=None,
                       help="seed of every worker's random numbers, set before --data is "
                            "called (default: the seed recorded in the export): two runs "
                            "with the same seed are bit-equal")
    group.add_argument("--slowdown", default=None, metavar="F0,F1,...",
                       help="emulate a mixed cluster on this machine: each rank's forward and "
                            "backward take this many times as long (>= 1, one per rank, e.g. "
                            "1,2: rank 1 twice as slow); compare with `pdcompile simulate` on "
                            "the cluster with those speeds")
    group.add_argument("--run-dir", default=None, metavar="DIR",
                       help=f"where the run writes every loss ({LOSSES_FILE}; default: "
                            "--checkpoint-dir, else EXPORT_DIR/runs/<date>)")


_FLAGS = ("allow_nonfinite", "trust", "resume_anyway")
_VALUED = ("steps", "checkpoint_dir", "checkpoint_every", "fault_timeout", "data", "threads",
           "timeline", "seed", "slowdown", "run_dir")


def training_arguments(args: argparse.Namespace) -> list[str]:
    """The worker's command-line arguments for the training options set in `args`."""
    out: list[str] = []
    for name in _VALUED:
        value = getattr(args, name, None)
        if value is not None and value != "":
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out + [f"--{name.replace('_', '-')}" for name in _FLAGS if getattr(args, name, False)]


def seed_process(seed: int) -> None:
    """Seed every random-number generator a run draws from (torch, Python's, NumPy's), so that
    two runs with the same seed and data are bit-equal."""
    import random

    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def load_data(spec: str) -> Callable[[], Iterable[Any]]:
    """`path/to/file.py:function` or `package.module:function`, imported (one-line errors)."""
    from pdcompile.util.user_code import find_callable, import_user_module, split_spec

    path, name = split_spec(spec, what="--data", name="function", example="data.py:batches")
    module = import_user_module(path, what="--data")
    return find_callable(module, name, spec=spec,
                         hint=f"define 'def {name}(): return an iterable of (inputs, target)'")


def example_data(pipe: Any, export_dir: str) -> Iterable[Any]:
    """The exported example minibatch, repeated forever."""
    inputs = getattr(pipe, "example_inputs", None)
    target = getattr(pipe, "example_target", None)
    if inputs is None:
        raise PdcompileError(f"{export_dir} holds no example minibatch (exported before "
                             "pdcompile saved one); pass --data FILE.py:FUNCTION")
    if target is None and pipe.loss_fn is not None:
        raise PdcompileError(f"{export_dir} holds the example inputs but no target for the loss "
                             "function (compile(..., example_target=y) saves one); pass --data "
                             "FILE.py:FUNCTION")
    return itertools.repeat((inputs, target))


def _die_hook(stream: Iterable[Any], rank: int) -> Iterable[Any]:
    """`stream` itself (its `state_dict`, its indexing kept), or, under the test hook, a
    generator over it that kills this process at the minibatch named."""
    spec = os.environ.get(DIE_ENV, "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not spec or not first_attempt or int(spec.split(":")[0]) != rank:
        return stream
    return _dying(stream, rank, int(spec.split(":")[1]))


def _dying(stream: Iterable[Any], rank: int, at: int) -> Iterator[Any]:
    for index, item in enumerate(stream):
        if index == at:
            print(f"rank {rank}: killing myself at minibatch {at} ({DIE_ENV})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        yield item


def _init_process_group(rank: int, world: int) -> None:
    """The default group from torchrun's environment, under a key prefix of its own attempt.

    torchrun's static rendezvous keeps one store across restarts, so a restarted worker would
    read the gloo addresses the dead attempt left there; a per-attempt prefix avoids them.
    """
    import torch.distributed as dist

    from pdcompile.backends.launch import connect_store

    timeout = datetime.timedelta(seconds=120)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)  # env://: rank 0 hosts the store
        return
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pdcompile/pg/{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    """Run one worker; returns the exit status (errors print one line)."""
    from pdcompile.backends.launch import end_with_launcher, launcher_from_env

    # first of all: a worker whose launcher (torchrun, `pdcompile run`) is killed ends too
    end_with_launcher(launcher_from_env(), what=f"rank {os.environ.get('RANK', '?')}")
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except AnnouncedInputError:
        return 1  # the rank that read the data prints what was wrong with it
    except PdcompileError as err:
        if err.__cause__ is not None and type(err).__name__ == "ModelError":
            import traceback  # the model's own traceback, once, above the one line

            traceback.print_exception(err.__cause__)
        print(f"pdcompile: error: {err}", file=sys.stderr, flush=True)
        return 1


def _main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from pdcompile.backends.distributed import reads_data, run_distributed
    from pdcompile.backends.launch import PeerFailure, monitor_from_env
    from pdcompile.export.read import load_pipeline
    from pdcompile.runtime.allocator import tune_allocator

    tune_allocator()  # freed memory stays for reuse (runtime/allocator.py)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise DistributedError(f"{', '.join(missing)} not set: start the workers with torchrun "
                               "or `pdcompile run EXPORT_DIR --nproc N`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pipe = load_pipeline(args.export_dir, trust=args.trust)
    program = pipe.program()  # what the backend runs
    if args.data is None and args.steps is None:
        args.steps = DEFAULT_STEPS
        if rank == 0:
            print(f"training on the exported example minibatch, {DEFAULT_STEPS} times (--steps "
                  "N for another count)", flush=True)
    seed_process(args.seed if args.seed is not None else pipe.seed)
    data: Iterable[Any] | None = None
    if reads_data(program, rank):  # stage 0 reads; the last stage gets its targets from it
        data = load_data(args.data)() if args.data else example_data(pipe, args.export_dir)
    _init_process_group(rank, world)
    monitor = monitor_from_env(rank=rank, world_size=world, fault_timeout=args.fault_timeout)
    failed = True
    reporter = program.plan.stages[-1].ranks[0] == rank  # the first to know the losses
    report = None
    if reporter:
        report = RunReport(args.run_dir or default_run_dir(args.export_dir), total=args.steps)
    try:
        run = run_distributed(program, None if data is None else _die_hook(data, rank),
                              steps=args.steps,
                              checkpoint_dir=args.checkpoint_dir,
                              checkpoint_every=args.checkpoint_every, monitor=monitor,
                              record=args.timeline is not None, progress=report,
                              allow_nonfinite=args.allow_nonfinite, slowdown=args.slowdown,
                              resume_anyway=args.resume_anyway)
        if rank == 0:
            if run.resumed_from is not None:
                print(f"resumed from the checkpoint after minibatch {run.resumed_from}",
                      flush=True)
            if args.timeline and run.timeline is not None:
                run.timeline.save(args.timeline)
        if report is not None:
            report.close(run.losses)
            print(summary(run.losses, trained=run.steps, seconds=run.seconds,
                          samples=run.samples), flush=True)
            print(f"losses: {report.path}", flush=True)
            report = None
        failed = False
    except BaseException as err:
        if isinstance(err, AnnouncedInputError):  # the reader's refusal: the reader's cause
            if monitor is not None:
                monitor.report(err.reader, str(err))
        elif monitor is not None and not isinstance(err, PeerFailure):
            own = isinstance(err, PdcompileError)  # pdcompile's messages say what happened
            monitor.report(rank, str(err) if own else f"{type(err).__name__}: {err}")
        raise
    finally:
        if report is not None:
            report.close()
        if monitor is not None:
            monitor.stop(done=not failed)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Launching from Python: one process per worker on this machine


def _train_worker(worker: Worker, export_dir: str, data: Callable[[], Iterable[Any]],
                  options: dict[str, Any], channel: Any, seed: int | None) -> DistributedRun:
    from pdcompile.backends.distributed import reads_data, run_distributed
    from pdcompile.export.read import load_pipeline  # the worker loads what the user exported

    pipe = load_pipeline(export_dir, trust=options.pop("trust", False))
    seed_process(pipe.seed if seed is None else seed)
    program = pipe.program()
    progress = None if channel is None else (lambda step, loss: channel.put((step, loss)))
    batches = data() if reads_data(program, worker.rank) else None  # only the readers load it
    return run_distributed(program, batches, monitor=worker.monitor, progress=progress, **options)


def train_processes(export_dir: str | os.PathLike[str], nproc: int,
                    data: Callable[[], Iterable[Any]], *, steps: int | None = None,
                    timeout: float = 600, fault_timeout: float = DEFAULT_FAULT_TIMEOUT,
                    record: bool = False,
                    checkpoint_dir: str | os.PathLike[str] | None = None,
                    checkpoint_every: int | None = None,
                    progress: Callable[[int, float], None] | None = None,
                    allow_nonfinite: bool = False, trust: bool = False,
                    seed: int | None = None,
                    slowdown: Sequence[float] | str | None = None,
                    resume_anyway: bool = False) -> DistributedRun:
    """Train an exported pipeline on `nproc` local processes (gloo); rank 0's result. A plan
    that leaves workers idle (the planner found a plan on fewer of them faster) starts only
    its own workers' processes.

    Each worker loads `export_dir` (pdcompile.load) and calls `run_distributed` on `data()`, so
    `data` must be picklable (a module-level function or a functools.partial of one) and give
    the same stream in every process that reads data (stage 0; the others do not call it).
    `progress(step, loss)` is called here, in this process. A NaN or infinite loss stops the
    run unless `allow_nonfinite`; `trust`: as `pdcompile.load(..., trust=True)`. `seed`: every
    worker's random seed, set before `data()` is called (default: the export's, `Pipeline.seed`).
    `slowdown`: per rank, the factor its compute is stretched by (an emulated slower device,
    runtime/slowdown.py), e.g. [1, 2]. `resume_anyway`: as `run_distributed`'s (a checkpoint
    recorded under other layer names or none resumed). Raises `LaunchError` naming the rank that
    failed first;
    no process outlives the call.
    """
    import multiprocessing

    from pdcompile.backends.launch import launch

    asked, nproc = nproc, _started(export_dir, nproc)
    options: dict[str, Any] = {"steps": steps, "record": record, "checkpoint_dir": checkpoint_dir,
               "checkpoint_every": checkpoint_every, "allow_nonfinite": allow_nonfinite,
               "trust": trust, "slowdown": None, "resume_anyway": resume_anyway}
    if slowdown is not None:  # checked here: one line, before any worker starts
        from pdcompile.runtime.slowdown import check_slowdowns

        options["slowdown"] = check_slowdowns(slowdown, asked)[:nproc]
    channel = multiprocessing.get_context("spawn").Queue() if progress is not None else None
    stop = threading.Event()
    relay: threading.Thread | None = None
    if channel is not None and progress is not None:
        relay = threading.Thread(target=_relay, args=(channel, progress, stop),
                                 name="pdcompile-progress", daemon=True)
        relay.start()
    try:
        values = launch(_train_worker, nproc, args=(str(export_dir), data, options, channel, seed),
                        timeout=timeout, fault_timeout=fault_timeout)
    finally:
        stop.set()
        if relay is not None:
            relay.join(timeout=5)
    result: DistributedRun = values[0]
    return result


def _started(export_dir: str | os.PathLike[str], nproc: int) -> int:
    """The processes to start for `nproc` asked: the plan's workers where it uses fewer (the
    planner may leave workers idle where they would cost more than they save; an idle process
    would have no stage to run), else `nproc` (the backend refuses a count it cannot run)."""
    from pdcompile.export.files import plan_workers

    workers = plan_workers(export_dir)
    return workers if workers is not None and 0 < workers < nproc else nproc


def _relay(channel: Any, progress: Callable[[int, float], None], stop: threading.Event) -> None:
    """Call `progress` in the parent for what the reporting worker sent, until told to stop."""
    import queue

    while True:
        try:
            step, loss = channel.get(timeout=0.05)
        except queue.Empty:
            if stop.is_set():
                return
            continue
        except (EOFError, OSError):
            return
        progress(step, loss)


if __name__ == "__main__":
    sys.exit(main())
