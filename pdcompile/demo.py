"""The demo: the whole path on this machine, end to end (what `pdcompile demo` runs).

profile the demo model on this CPU -> plan it for `local-N` -> export -> train it for a few dozen
minibatches on N real processes (torch.distributed, gloo) -> write the predicted (simulator) and
measured timelines -> compare them -> plan the same costs for PipeDream's cluster A and report the
predicted speed-up over data parallelism. Everything it prints is also written to `out/demo.md`.

The model and its size are chosen in one place, `DemoSize`: a wide MLP (models/demomlp.py) on
a few images per minibatch, whose weights are large against their compute. That is where
pipelining pays on any cluster, a 2-core machine included: data parallelism all-reduces every
weight after every minibatch, a pipeline sends only the activations at its cuts, so the planner
(free to replicate) chooses a pipeline and predicts it faster than data parallelism.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import networkx as nx
import torch

from pdcompile.cost.cache_flush import caches_for
from pdcompile.cost.optimizer_timing import time_optimizer_steps, time_weight_copies
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.local import oversubscription_note
from pdcompile.plan import Plan
from pdcompile.timeline import Timeline
from pdcompile.units import format_bytes, format_seconds


@dataclass(frozen=True)
class DemoSize:
    """The demo's model and run, in one place (see the module docstring for why this model):
    minibatches trained, images per minibatch and their side, the MLP's width and depth, and
    repetitions of each measurement when profiling."""

    steps: int = 48
    batch_size: int = 8
    image_size: int = 16
    hidden: int = 1536
    depth: int = 6
    repeats: int = 5

    @classmethod
    def quick(cls) -> DemoSize:
        """A reduced setting for CI: fewer minibatches, a narrower model (still a pipeline)."""
        return cls(steps=12, batch_size=4, image_size=8, hidden=1024, depth=4, repeats=2)


@dataclass
class DemoResult:
    """What the demo measured and predicted (also in `out/demo.json`)."""

    plan: Plan
    losses: list[float]
    backend: str
    seconds: float
    samples_per_second: float
    predicted_per_minibatch: float
    measured_per_minibatch: float
    cluster_a: Plan
    out: Path
    files: list[Path] = field(default_factory=list)

    @property
    def predicted_over_measured(self) -> float:
        """The simulator's time per minibatch over the measured one (1.0: exact)."""
        if self.measured_per_minibatch <= 0:
            return float("inf")
        return self.predicted_per_minibatch / self.measured_per_minibatch

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `demo.json`."""
        return {"config": self.plan.config, "workers": self.plan.workers,
                "backend": self.backend, "losses": self.losses, "seconds": self.seconds,
                "samples_per_second": self.samples_per_second,
                "predicted_time_per_minibatch": self.predicted_per_minibatch,
                "measured_time_per_minibatch": self.measured_per_minibatch,
                "predicted_over_measured": self.predicted_over_measured,
                "cluster_a_config": self.cluster_a.config,
                "cluster_a_speedup_over_dp": self.cluster_a.speedup_over_dp,
                "files": [str(p) for p in self.files]}


def machine() -> str:
    """One line about this machine (CPU, cores, Python, torch)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def demo_batches(steps: int, batch_size: int, image_size: int,
                 seed: int = 0) -> Any:
    """The demo's data stream (module level, so worker processes can unpickle it)."""
    from pdcompile.models import demomlp

    return demomlp.batches(steps, batch_size=batch_size, image_size=image_size, seed=seed)


class _Log:
    """Prints to the console and keeps the lines for `demo.md`."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lines: list[str] = []

    def __call__(self, text: str = "", *, block: bool = False) -> None:
        print(text, file=self.stream, flush=True)
        if block:
            self.lines += ["```", text, "```"]
        else:
            self.lines.append(text)


class TrainingProgress:
    """Progress of training: a tqdm bar on a terminal, a line every few minibatches otherwise.
    Called as `progress(step, loss)`; shows the minibatch, its loss and samples/s so far."""

    def __init__(self, total: int, batch_size: int, *, stream: TextIO | None = None,
                 bar: bool | None = None) -> None:
        self.total = total
        self.batch_size = batch_size
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self._first: tuple[int, float] | None = None  # (step, time) of the first report
        self.every = max(1, total // 8)
        self._bar: Any = None
        use_bar = self.stream.isatty() if bar is None else bar
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="training", unit="minibatch", file=self.stream,
                             dynamic_ncols=True)

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        now = time.perf_counter()
        if self._first is None:
            self._first = (done, now)
        first, at = self._first
        # samples/s since the first report (process start-up and pipeline fill left out)
        # (a burst of reports, e.g. a one-stage pipeline reporting at the end, shows no rate)
        rate = (done - first) * self.batch_size / (now - at) if now - at > 0.05 else 0.0
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", samples_per_s=f"{rate:.0f}")
            self._bar.update(max(0, done - self._bar.n))
        elif done % self.every == 0 or done == self.total or done == 1:
            speed = f"{rate:8.1f} samples/s" if rate > 0 else ""
            print(f"  minibatch {done:>4}/{self.total}  loss {loss:7.4f}  {speed}".rstrip(),
                  file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar (if any)."""
        if self._bar is not None:
            self._bar.close()


def profile(size: DemoSize, *, progress: bool = False, seed: int = 0, caches: str = "warm"
            ) -> tuple[torch.nn.Module, tuple[torch.Tensor], nx.DiGraph]:
    """The demo model, its example minibatch and its CostGraph measured on this CPU (`caches`:
    as `annotate_costs`)."""
    from pdcompile.cost.costed_graph import costed_graph
    from pdcompile.models import demomlp

    torch.manual_seed(seed)
    model, inputs = demomlp.factory(batch_size=size.batch_size, image_size=size.image_size,
                                    hidden=size.hidden, depth=size.depth)
    return model, inputs, costed_graph(model, inputs, name="DemoMLP", repeats=size.repeats,
                                       progress=progress, caches=caches)


def predict(graph: nx.DiGraph, plan: Plan, cluster: Cluster, minibatches: int,
            optimizer_steps: tuple[float, ...] | None = None,
            weight_copies: tuple[float, ...] | None = None) -> Timeline:
    """The simulator's timeline of `minibatches` streamed through `plan` on `cluster` (the
    plan's schedule and in-flight counts, as the pipeline runs them).

    `optimizer_steps`, `weight_copies`: seconds of each stage's optimizer step and weight
    snapshot (cost/optimizer_timing.py); None: the cost model's memory-bandwidth estimates."""
    from dataclasses import replace

    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.planner.simulation import simulate_plan

    costs = StageCosts.from_plan(graph, plan, microbatches=plan.microbatches)
    if optimizer_steps is not None:
        costs = replace(costs, optimizer=optimizer_steps)
    if weight_copies is not None:
        costs = replace(costs, stash=weight_copies)
    return simulate_plan(graph, plan, cluster, minibatches=minibatches, costs=costs)[1].timeline


def _distributed_trainer() -> Callable[..., Any] | None:
    try:
        from pdcompile.worker import train_processes
    except ImportError:
        return None
    return train_processes


def run_demo(*, workers: int = 2, out: str | Path = "pdcompile-demo",
             size: DemoSize | None = None, backend: str = "distributed",
             stream: TextIO | None = None, progress: bool | None = None,
             timeout: float = 600, lr: float = 1e-4, straight: bool = False,
             command: str | None = None) -> DemoResult:
    """Run the demo (see the module docstring); prints as it goes to `stream` (stdout).

    `backend`: "distributed" (one process per worker, gloo) or "local" (one process; the
    reference semantics). `progress`: bars on stderr (default: when stderr is a terminal).
    `command`: the command line to name in the report.
    `straight`: ask the planner for a straight pipeline (one worker per stage) on local-N;
    by default it is free to replicate stages, data parallelism included. Cluster A is always
    planned without restriction.
    """
    from pdcompile.api import compile as compile_pipeline
    from pdcompile.models import demomlp
    from pdcompile.planner import plan as make_plan
    from pdcompile.viz.chrome_trace import write_chrome_trace
    from pdcompile.viz.gantt import draw_gantt
    from pdcompile.viz.plan_graph import draw_plan

    if workers < 1:
        raise PdcompileError(f"the demo needs at least 1 worker (got {workers}); try --workers 2")
    if backend not in ("distributed", "local"):
        raise PdcompileError(f"backend must be 'distributed' or 'local', not {backend!r}")
    size = size or DemoSize()
    if size.steps < 2 * workers:
        raise PdcompileError(f"--steps {size.steps} is too few to fill a pipeline of {workers} "
                             f"workers; give at least {2 * workers}")
    torch.set_num_threads(1)
    log = _Log(stream or sys.stdout)
    bars = sys.stderr.isatty() if progress is None else progress
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []

    log("# pdcompile demo")
    log()
    if command:
        log(f"command: `{command}`")
    log(f"machine: {machine()}")
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        log(f"load average before the run (1, 5, 15 min): {load}")
    except OSError:
        pass
    log(f"model: DemoMLP (pdcompile.models.demomlp), {size.depth} layers {size.hidden} wide, "
        f"minibatch {size.batch_size} images {size.image_size}x{size.image_size} (flattened), "
        f"{size.steps} minibatches, Adam lr {lr:g}: weights large against their compute, "
        "where a pipeline pays (DemoSize)")
    log()
    log("## 1. profile on this CPU")
    started = time.perf_counter()
    cluster = Cluster.preset(f"local-{workers}")
    model, inputs, graph = profile(size, progress=bars, caches=caches_for(cluster))
    fwd = sum(d["fwd"] for _, d in graph.nodes(data=True))
    bwd = sum(d["bwd"] for _, d in graph.nodes(data=True))
    weights = sum(float(d["params"]) for _, d in graph.nodes(data=True))
    log(f"{graph.number_of_nodes()} nodes, {format_bytes(weights)} of weights, forward "
        f"{format_seconds(fwd)} + backward {format_seconds(bwd)} per minibatch, measured in "
        f"{time.perf_counter() - started:.1f} s")

    log()
    log(f"## 2. plan for local-{workers}")
    plan = make_plan(graph, cluster, time_limit=5, straight=straight)
    target = demomlp.make_target(inputs)
    optimizer = functools.partial(torch.optim.Adam, lr=lr)
    pipe = compile_pipeline(model, cluster, example_inputs=inputs, loss_fn=demomlp.loss_fn,
                            optimizer=optimizer, plan=plan, example_target=target)
    log(f"cluster: {cluster.describe()}"
        + ("; a straight pipeline was asked (--straight)" if straight else ""))
    log(pipe.summary(), block=True)
    log(why_this_plan(plan, graph, cluster))
    files += [draw_plan(pipe, folder / f"plan.{ext}", graph=graph) for ext in ("svg", "png")]
    (folder / "plan.json").write_text(plan.to_json())
    files.append(folder / "plan.json")

    log()
    steps = size.steps // _lcm(plan) * _lcm(plan)
    export_dir = folder / "pipeline"
    pipe.export(str(export_dir))
    files.append(export_dir)
    trainer = _distributed_trainer() if backend == "distributed" else None
    if backend == "distributed" and trainer is None:
        log("NOTE: the distributed backend is not available in this installation; training on "
            "the local backend (one process) instead")
    used = "distributed" if trainer is not None else "local"
    how = (f"{plan.workers} processes (torch.distributed, gloo on 127.0.0.1)"
           if used == "distributed" else "the local backend (one process, all ranks)")
    note = oversubscription_note(plan.workers) if used == "distributed" else None
    if note is not None:
        log(note)
    log(f"## 3. train {steps} minibatches on {how}")
    bar = TrainingProgress(steps, size.batch_size, bar=bars)
    data = functools.partial(demo_batches, steps, size.batch_size, size.image_size)
    started = time.perf_counter()
    try:
        if trainer is not None:
            run = trainer(str(export_dir), plan.workers, data, steps=steps, record=True,
                          progress=bar, timeout=timeout)
            losses, measured = list(run.losses), run.timeline
            seconds = run.seconds
        else:
            pipe.timed()
            losses = pipe.train(data())
            seconds = time.perf_counter() - started
            measured = pipe.last_timeline
            for index, loss in enumerate(losses):
                bar(index, loss)
    finally:
        bar.close()
    if measured is None:
        raise PdcompileError("the training run recorded no timeline")
    samples_per_second = steps * size.batch_size / seconds if seconds > 0 else 0.0
    log(f"losses: {' '.join(f'{x:.3f}' for x in losses)}")
    log(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} minibatches; "
        f"{seconds:.2f} s, {samples_per_second:.0f} samples/s")

    log()
    log("## 4. predicted against measured")
    predicted = predict(graph, plan, cluster, steps, time_optimizer_steps(pipe),
                        time_weight_copies(pipe))
    stage_of = plan.rank_to_stage()
    for name, line in (("predicted", predicted), ("measured", measured)):
        line.save(folder / f"{name}_timeline.json")
        per = line.time_per_minibatch()
        pictures = [folder / f"{name}_gantt.png", folder / f"{name}_gantt.svg"]
        draw_gantt(line, pictures, stage_of_rank=stage_of, width=16.0,
                   title=f"{pipe.name} {plan.config} 1f1b on local-{workers}, {name}: "
                   f"{format_seconds(per)} per minibatch")
        files += [folder / f"{name}_timeline.json", *pictures,
                  write_chrome_trace(line, folder / f"{name}_trace.json")]
    files.append(_side_by_side(predicted, measured, folder, stage_of,
                               f"{pipe.name} {plan.config} 1f1b on local-{workers}"))
    predicted_per, measured_per = predicted.time_per_minibatch(), measured.time_per_minibatch()
    log(f"time per minibatch: predicted {format_seconds(predicted_per)}, measured "
        f"{format_seconds(measured_per)} (predicted / measured = "
        f"{predicted_per / measured_per if measured_per > 0 else float('inf'):.2f})")
    log(f"two predictions, both from the profile, before the run: the planner's "
        f"{format_seconds(plan.time_per_minibatch)} simulates the plan in steady state with "
        f"optimizer steps and weight copies estimated from memory bandwidth; this "
        f"{format_seconds(predicted_per)} simulates this run ({steps} minibatches, warm-up and "
        "drain included) with the steps and copies timed on this machine")
    try:
        from pdcompile.viz.compare import compare

        log(compare(predicted, measured).table(), block=True)
    except PdcompileError as err:  # the comparison is a bonus; the figures above stand
        log(f"(no per-stage comparison: {err})")

    log()
    log("## 5. the same model on PipeDream's cluster A")
    cluster_a = Cluster.preset("A")
    plan_a = make_plan(graph, cluster_a, time_limit=5)
    log(f"cluster: {cluster_a.describe()}")
    log(plan_a.summary(), block=True)
    log(f"predicted speed-up over data parallelism on cluster A: {plan_a.speedup_over_dp:.2f}x "
        f"(configuration {plan_a.config}, {format_seconds(plan_a.time_per_minibatch)} against "
        f"{format_seconds(plan_a.dp_time)} per minibatch)")
    (folder / "cluster_A_plan.json").write_text(plan_a.to_json())
    files.append(folder / "cluster_A_plan.json")

    result = DemoResult(plan=plan, losses=losses, backend=used, seconds=seconds,
                        samples_per_second=samples_per_second,
                        predicted_per_minibatch=predicted_per, measured_per_minibatch=measured_per,
                        cluster_a=plan_a, out=folder, files=files)
    (folder / "demo.json").write_text(json.dumps(result.to_dict(), indent=1))
    (folder / "demo.md").write_text("\n".join(log.lines) + "\n")
    result.files += [folder / "demo.json", folder / "demo.md"]
    log()
    log(f"wrote {folder}/: " + ", ".join(_listed(result.files, folder))
        + " (gantt.png: predicted over measured; *_trace.json: open in ui.perfetto.dev)")
    (folder / "demo.md").write_text("\n".join(log.lines) + "\n")
    return result


def why_this_plan(plan: Plan, graph: nx.DiGraph, cluster: Cluster) -> str:
    """One line: what the planner chose on `cluster` and why, in the terms of its cost model
    (data parallelism's compute share and weight all-reduce against the plan's time)."""
    from pdcompile.cost.links import ring_allreduce_seconds

    compute = sum(float(d["fwd"]) + float(d["bwd"]) for _, d in graph.nodes(data=True))
    weights = sum(float(d["params"]) for _, d in graph.nodes(data=True))
    workers = cluster.workers
    level = cluster.levels[cluster.slowest_level_of(list(range(workers)))]
    # one ring all-reduce per round of `workers` minibatches, shared by them
    sync = ring_allreduce_seconds(weights, workers, level) / workers
    sharing = cluster.shared_cores()
    turns = (f", its {min(sharing[0], workers)} workers taking turns on {sharing[1]} cores"
             if sharing is not None and sharing[0] > sharing[1] else "")
    dp = (f"data parallelism would compute {format_seconds(compute / workers)} per worker and "
          f"all-reduce all {format_bytes(weights)} of weights once per round of {workers} "
          f"minibatches ({format_seconds(sync)} per minibatch at "
          f"{format_bytes(level.allreduce_rate)}/s of all-reduce bus bandwidth){turns}")
    if len(plan.stages) == 1:
        return (f"why: the planner chose data parallelism ({plan.config}): {dp}, which beats "
                "every pipeline it priced")
    faster = "faster" if plan.speedup_over_dp >= 1 else "slower"
    return (f"why {plan.config}: {dp}, {format_seconds(plan.dp_time)} in all with its "
            f"optimizer steps; the pipeline sends only the activations at its cuts and each "
            f"stage steps only its own weights: {format_seconds(plan.time_per_minibatch)}, "
            f"{plan.speedup_over_dp:.2f}x {faster}")


def _listed(files: list[Path], folder: Path) -> list[str]:
    """The names of the files (and folders, with '/') that exist, relative to `folder`."""
    names = []
    for path in files:
        if path.exists():
            name = str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)
            names.append(name + ("/" if path.is_dir() else ""))
    return names


def _side_by_side(predicted: Timeline, measured: Timeline, folder: Path,
                  stage_of: dict[int, int], title: str) -> Path:
    """gantt.png: the predicted chart above the measured one, on the same time axis."""
    import tempfile

    from pdcompile.timeline import Event
    from pdcompile.viz.gantt import draw_gantt

    span = max(predicted.makespan, measured.makespan)
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, line in (("predicted", predicted), ("measured", measured)):
            # a zero-length send (not drawn) at the common end stretches the shorter axis
            rank = line.ranks[0]
            end = Event(rank, f"{stage_of.get(rank, 0)}SEND_F0->1", line.start + span,
                        line.start + span)
            padded = Timeline([*line.events, end], line.source, dict(line.meta))
            path = Path(tmp) / f"{name}.png"
            draw_gantt(padded, path, stage_of_rank=stage_of, width=16.0,
                       title=f"{title}, {name}: {format_seconds(line.time_per_minibatch())} "
                       "per minibatch")
            parts.append(path)
        return _stack_images(parts, folder / "gantt.png")


def _stack_images(parts: list[Path], target: Path) -> Path:
    """One PNG with the given PNGs one above the other (predicted over measured)."""
    import numpy as np
    from matplotlib import image

    images = [image.imread(str(p)) for p in parts]
    width = max(i.shape[1] for i in images)
    padded = [np.pad(i, ((0, 0), (0, width - i.shape[1]), (0, 0)), constant_values=1.0)
              for i in images]
    image.imsave(str(target), np.concatenate(padded, axis=0))
    return target


def _lcm(plan: Plan) -> int:
    import math

    return math.lcm(*(s.replicas for s in plan.stages))


__all__ = ["DemoResult", "DemoSize", "TrainingProgress", "machine", "predict", "profile",
           "run_demo"]
