"""Random cuts placed for any shipped schedule, and single-process references to compare with.

`placed_cut` draws a valid cut of a graph for one schedule: a random topological order cut into
K stages (tests/helpers/random_models.random_cut), with replicas where the schedule takes them,
two or three chunks per rank on a random permutation of the ranks where it interleaves, and a
V on a random permutation where it folds one. `micro_options` are the microbatch counts the
schedule's order runs with. `flush_reference` is ordinary training with gradient accumulation
over the same microbatches; `delayed_reference` is 2BW's rule (W(t+1) = W(t) - lr *
grad_t(W(t-1))), both on inputs given as a tuple or by name.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.func import functional_call

from pdcompile.passes.frontend import capture
from pdcompile.passes.inplace import make_mutations_explicit
from pdcompile.plan import Plan
from pdcompile.schedule.generators import warmup_depth
from pdcompile.schedule.kinds import KINDS, kind
from pdcompile.schedule.placement import v_position
from tests.helpers import random_models
from tests.helpers.random_models import TIME, WIDTH, RandomNet, Step, random_cut

# every shipped schedule but '1f1b' (its own reference: tests/runtime/test_async_semantics.py)
SCHEDULES = tuple(name for name in KINDS if name != "1f1b")
Inputs = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
Loss = Callable[[Any, torch.Tensor], torch.Tensor]
Optimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def cut_graph(model: nn.Module, inputs: Inputs) -> fx.GraphModule:
    """The graph a cut names: the model captured as compile captures it, in-place order as
    data edges (what split sees)."""
    captured = capture(model, () if isinstance(inputs, dict) else inputs,
                       inputs if isinstance(inputs, dict) else None)
    make_mutations_explicit(captured.graph)
    return captured.graph


def placed_cut(gm: fx.GraphModule, rng: random.Random, schedule: str, *,
               ranks: int | None = None) -> Plan:
    """A random valid cut of `gm` placed as `schedule` places stages (chunked ones on `ranks`
    ranks where given, else 2 or 3), about one stage in four recomputing its activations in
    its backward."""
    placed = _placed_stages(gm, rng, schedule, ranks)
    return replace(placed, stages=tuple(replace(s, recompute=rng.random() < 0.25)
                                        for s in placed.stages))


def _placed_stages(gm: fx.GraphModule, rng: random.Random, schedule: str,
                   ranks: int | None) -> Plan:
    row = kind(schedule)
    if row.v_shape:
        ranks = ranks or rng.choice([2, 3])
        plan = random_cut(gm, rng, stages=2 * ranks, replicas=[1] * 2 * ranks)
        return _placed(plan, rng, ranks, v_shape=True)
    if row.interleaved:
        ranks, chunks = (ranks, rng.choice([2, 3])) if ranks else \
            rng.choice([(2, 2), (2, 3), (3, 2)])
        plan = random_cut(gm, rng, stages=ranks * chunks, replicas=[1] * ranks * chunks)
        return _placed(plan, rng, ranks, v_shape=False)
    stages = rng.choice([1, 2, 3, 4])
    replicas = [1] * 4 if row.split_backward else [rng.choice([1, 2]) for _ in range(4)]
    return random_cut(gm, rng, stages=stages, replicas=replicas)


def _placed(plan: Plan, rng: random.Random, ranks: int, *, v_shape: bool) -> Plan:
    """`plan`'s stages on `ranks` ranks in a random order: chunk c on the rank of chunk c mod p
    (interleaved) or of `v_position(c, p)` (a V)."""
    stages = len(plan.stages)
    if stages < 2 * ranks or (v_shape and stages != 2 * ranks) or stages % ranks:
        return plan  # too few operations for the chunks: a straight plan, drawn again
    owner = list(range(ranks))
    rng.shuffle(owner)
    where = [owner[v_position(c, ranks) if v_shape else c % ranks] for c in range(stages)]
    extra = {**plan.extra, "chunks_per_rank": stages // ranks}
    if v_shape:
        extra["placement"] = "v"
    return replace(plan, stages=tuple(replace(s, ranks=(r,)) for s, r in
                                      zip(plan.stages, where, strict=True)),
                   workers=ranks, extra=extra)


def fits(plan: Plan, schedule: str) -> bool:
    """Whether `placed_cut` placed the plan as the schedule needs (else too few operations)."""
    row = kind(schedule)
    ranks = len({r for s in plan.stages for r in s.ranks})
    if row.interleaved:
        return ranks >= 2 and len(plan.stages) >= 2 * ranks
    return True


def micro_options(schedule: str, plan: Plan, batch: int) -> list[int]:
    """Microbatch counts the schedule's order runs with on this placement that cut `batch`
    samples evenly (the references cut with `torch.tensor_split`), at least 2 samples each
    (BatchNorm in training needs 2)."""
    return [m for m in _runs_with(schedule, plan) if batch % m == 0 and batch // m >= 2]


def _runs_with(schedule: str, plan: Plan) -> list[int]:
    row = kind(schedule)
    ranks = len({r for s in plan.stages for r in s.ranks})
    if row.microbatches_per_rank:
        return [row.microbatches_per_rank * ranks]
    if row.chunked:  # rounds of p microbatches, or fewer than p
        return sorted({m for m in (1, 2, ranks, 2 * ranks) if m < ranks or m % ranks == 0})
    replicas = [s.replicas for s in plan.stages]
    if schedule == "2bw":  # a multiple of every replica count, and each replica at least as
        # many of a minibatch's microbatches as it runs forwards ahead (else refused)
        shape = [s.ranks for s in plan.stages]
        least = max(len(r) * max(1, warmup_depth(shape, s)) for s, r in enumerate(shape))
        return [m for m in (2, 4, 6, 12) if m >= least and all(m % r == 0 for r in replicas)]
    return [1, 2, 4]


def _parts(inputs: Inputs, target: torch.Tensor, micro: int
           ) -> list[tuple[Inputs, torch.Tensor]]:
    """`micro` microbatches as the pipeline cuts them: tensors by `tensor_split` along the
    batch (sizes differ by at most one where `micro` does not divide it); numbers, None and
    0-d tensors go whole to every microbatch."""
    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return list(torch.tensor_split(value, micro))
        return [value] * micro

    targets = cut(target)
    if isinstance(inputs, dict):
        pieces = {name: cut(v) for name, v in inputs.items()}
        return [({name: p[i] for name, p in pieces.items()}, targets[i]) for i in range(micro)]
    columns = [cut(v) for v in inputs]
    return [(tuple(c[i] for c in columns), targets[i]) for i in range(micro)]


def _call(model: nn.Module, inputs: Inputs) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def flush_reference(model: nn.Module, inputs: Inputs, target: torch.Tensor, loss_fn: Loss,
                    micro: int, steps: int, optimizer: Optimizer, *, clip: float | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` updates of ordinary training, each accumulating the gradients of the loss
    over `micro` microbatches (the loss of each scaled by 1/micro); with `clip`, the
    gradients clipped by `clip_grad_norm_` before each update."""
    model = copy.deepcopy(model)
    opt = optimizer(list(model.parameters()))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for part, part_target in _parts(inputs, target, micro):
            loss = loss_fn(_call(model, part), part_target)
            (loss / micro).backward()
            total += loss.item() / micro
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def delayed_reference(model: nn.Module, data: list[tuple[Inputs, torch.Tensor]],
                      loss_fn: Loss, micro: int, optimizer: Optimizer
                      ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """2BW: minibatch t's gradient is taken at W(t-1) and applied to W(t) (W(-1) = W(0))."""
    model = copy.deepcopy(model)
    live = dict(model.named_parameters())
    opt = optimizer(list(live.values()))
    history = [{n: p.detach().clone() for n, p in live.items()}]
    losses = []
    for step, (inputs, target) in enumerate(data):
        used = {n: v.clone().requires_grad_(live[n].requires_grad)  # frozen ones stay so
                for n, v in history[max(step - 1, 0)].items()}
        total = 0.0
        for part, part_target in _parts(inputs, target, micro):
            args = (part,) if isinstance(part, dict) else part
            kwargs: dict[str, Any] = {}
            if isinstance(part, dict):
                args, kwargs = (), part
            output = functional_call(model, used, args, kwargs)
            loss = loss_fn(output, part_target)
            (loss / micro).backward()
            total += loss.item() / micro
        losses.append(total)
        for name, param in live.items():
            param.grad = used[name].grad
        opt.step()
        history.append({n: p.detach().clone() for n, p in live.items()})
    return losses, model.state_dict()


def seeded_random_net(seed: int, batch: int
                      ) -> tuple[RandomNet, tuple[torch.Tensor, ...], torch.Tensor]:
    """A random model of tests/helpers/random_models.py drawn from `seed` alone (not by
    hypothesis), so that processes build the same one; float64, with inputs of `batch` samples
    and a target for `squared_error`."""
    rng = random.Random(seed)
    inputs = rng.choice([1, 2])
    steps = [Step(rng.choice(random_models.KINDS), rng.randrange(51), rng.randrange(51),
                  rng.randrange(8)) for _ in range(rng.randint(2, 8))]
    outputs = rng.sample([-3, -2, -1], rng.randint(1, 3))
    torch.manual_seed(seed)
    model = RandomNet(steps, inputs, outputs).double()
    xs = tuple(torch.randn(batch, TIME, WIDTH, dtype=torch.float64) for _ in range(inputs))
    return model, xs, torch.randn(batch, 1, WIDTH, dtype=torch.float64)
