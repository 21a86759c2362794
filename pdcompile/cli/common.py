"""Options and loaders shared by several subcommands (model spec, cluster, progress)."""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import PRESET_HELP, Cluster
from pdcompile.util.manifest import read_json_bytes

if TYPE_CHECKING:
    import networkx as nx

    from pdcompile.plan import Plan

CLUSTER_HELP = (
    "cluster: a preset (" + ", ".join(PRESET_HELP) + "), a short form such as "
    "'4x4@1e10,1.25e9:v100' (levels innermost first, bandwidths in bytes/s or with units like "
    "10Gbps, device after ':', or device groups in rank order for a mixed cluster, "
    "':a100*16,v100*16'), or a .json/.yaml file"
)


def add_cluster_option(parser: argparse.ArgumentParser, default: str = "local-2") -> None:
    """--cluster with the presets listed in --help."""
    presets = "\n".join(f"  {name:<11} {text}" for name, text in PRESET_HELP.items())
    parser.add_argument("--cluster", default=default, metavar="CLUSTER",
                        help=f"{CLUSTER_HELP} (default: {default}). Presets:\n{presets}")


def add_cost_option(parser: argparse.ArgumentParser) -> None:
    """--cost, as every subcommand that traces a MODEL takes it (plan, simulate): how the
    model's operators are costed (`load_cost_graph`)."""
    parser.add_argument("--cost", default="measured", choices=("measured", "analytic"),
                        help="for a MODEL: measured on this machine (default) or analytic on "
                        "the cluster's device (FLOPs and bytes), e.g. --cost analytic")


def load_cluster(text: str, *, planned: bool = True) -> Cluster:
    """A cluster from a file path or a string; `planned`: one the planner can plan for (not
    too large: refused here, before any tracing or profiling). A path that exists and is no
    folder is a file even where it is not a plain one (a FIFO: refused as one, not taken for
    a preset's name)."""
    path = Path(text)
    if text.endswith((".json", ".yaml", ".yml")) or (path.exists() and not path.is_dir()):
        cluster = Cluster.load(text)
    else:
        cluster = Cluster.parse(text)
    if planned:
        from pdcompile.planner import check_plannable

        check_plannable(cluster)
    return cluster


class Factory(NamedTuple):
    """What a model factory spec gave: the module that defines the factory (where `loss_fn`
    and `make_target` may sit beside it), the model and its example inputs."""

    module: types.ModuleType
    model: Any
    inputs: tuple[Any, ...] | dict[str, Any]


def check_sgd_options(lr: float, momentum: float = 0.0) -> None:
    """--lr and --momentum of the SGD a command builds: finite, lr >= 0, momentum in [0, 1).
    torch refused a negative lr only in a traceback, and took NaN, infinite ones and a
    momentum of 1 or more (velocity that never decays) without a word: the run diverged."""
    import math

    if not (math.isfinite(lr) and lr >= 0):
        raise PdcompileError(f"--lr {lr!r}: a learning rate is a finite number 0 or more, "
                             "e.g. --lr 0.01")
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise PdcompileError(f"--momentum {momentum!r}: SGD's momentum is at least 0 and below "
                             "1 (at 1 or more a gradient never fades: the weights diverge), "
                             "e.g. --momentum 0.9")


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...] | dict[str, Any]]:
    """Call `path/to/file.py:factory` (or `package.module:factory`); returns (model, inputs):
    a tuple, or a dict that binds the model's inputs by name (as `compile()` takes it).
    Every failure (no such module or name, an error inside the factory) is one line."""
    found = call_factory(spec)
    return found.model, found.inputs


def call_factory(spec: str) -> Factory:
    """`load_factory`, with the factory's module too."""
    from pdcompile.util.user_code import call_user, find_callable, import_user_module, split_spec

    path, name = split_spec(spec, what="model", name="factory",
                            example="pdcompile/models/vgg16.py:factory")
    module = import_user_module(path, what="model")
    factory = find_callable(module, name, spec=spec,
                            hint=f"define 'def {name}(): return model, example_inputs'")
    result = call_user(factory, spec=spec)
    if not isinstance(result, tuple) or len(result) != 2:
        # a third value (a target, a loss) was dropped without a word: the run trained on
        # targets and a loss other than those the factory returned
        got = (f"a tuple of {len(result)} value{'s' * (len(result) != 1)}"
               if isinstance(result, tuple) else type(result).__name__)
        raise PdcompileError(f"{spec}() must return (model, example_inputs), two values, got "
                             f"{got}; define a loss beside the factory as def loss_fn(output, "
                             "target), and a target for the inputs as def make_target(inputs)")
    model, inputs = result
    if isinstance(inputs, Mapping):  # bound by name, as compile() binds a dict
        return Factory(module, model, dict(inputs))
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return Factory(module, model, inputs)


def read_plan_file(path: str) -> Plan:
    """The Plan in a file from `pdcompile plan --json` (one line naming the file otherwise)."""
    from pdcompile.plan import Plan

    file = Path(path)
    fix = "write one with `pdcompile plan MODEL --json > plan.json`"
    if not file.is_file():
        raise PdcompileError(f"plan file {path!r} does not exist; {fix}")
    # as the loader reads JSON: a plain file of bounded size (a plan is kilobytes; a file of
    # gigabytes was read whole), refused before a byte is read
    data = read_json_bytes(file, fix=fix)
    try:
        return Plan.from_json(data.decode())
    except UnicodeDecodeError:
        raise PdcompileError(f"plan file {path!r} is not text; {fix}") from None
    except PdcompileError as err:
        raise PdcompileError(f"plan file {path!r}: {err}; {fix}") from None


def load_cost_graph(args: argparse.Namespace, cluster: Cluster, *, cost: str = "measured",
                    progress: bool = False) -> nx.DiGraph:
    """The CostGraph from exactly one of MODEL (`args.model`: traced and costed, `cost`
    "measured" on this machine in the cache state the cluster's workers will meet, or
    "analytic" on the cluster's device), --profile (a PipeDream graph.txt) or --costgraph (a
    CostGraph JSON file): the choice `plan` and `simulate` make."""
    sources = [x for x in (args.model, args.profile, args.costgraph) if x]
    if len(sources) != 1:
        raise PdcompileError("give exactly one of MODEL (file.py:factory), --profile graph.txt "
                             "or --costgraph graph.json")
    if args.profile:
        from pdcompile.profiles import load_pipedream

        return load_pipedream(args.profile)
    if args.costgraph:
        from pdcompile.cost.costgraph import load

        return load(args.costgraph)
    try:
        from pdcompile.cost.costed_graph import costed_graph
    except ModuleNotFoundError as err:
        raise PdcompileError(f"tracing a model needs {err.name}, which this installation lacks; "
                             "use --profile or --costgraph") from None
    import torch

    # one thread, as the workers run and as `inspect` and `export` measure: more threads than
    # free cores make small operators' timings meaningless
    torch.set_num_threads(1)
    model, inputs = load_factory(args.model)
    return costed_graph(model, inputs, cluster, cost=cost, name=args.model,
                        device=cluster.device if cost == "analytic" else None, progress=progress)


class Spinner:
    """Progress on stderr once the work has taken more than `delay` seconds: a spinner with the
    elapsed time on a terminal, one line otherwise."""

    def __init__(self, label: str, *, delay: float = 1.0) -> None:
        self.label = label
        self.delay = delay
        self.tty = sys.stderr.isatty()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._shown = False
        self._started = 0.0

    def __enter__(self) -> Spinner:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        if self._shown:
            elapsed = time.perf_counter() - self._started
            start = "\r" if self.tty else ""
            sys.stderr.write(f"{start}{self.label}: done in {elapsed:.1f} s\n")
            sys.stderr.flush()

    def _spin(self) -> None:
        if self._done.wait(self.delay):
            return
        self._shown = True
        if not self.tty:
            sys.stderr.write(f"{self.label} ...\n")
            sys.stderr.flush()
            return
        for char in itertools.cycle("|/-\\"):
            elapsed = time.perf_counter() - self._started
            sys.stderr.write(f"\r{self.label} {char} {elapsed:.0f} s")
            sys.stderr.flush()
            if self._done.wait(0.2):
                return
