"""Random models and random cuts for the split's property tests.

A model is a drawn list of steps over a pool of values, each (batch, TIME, WIDTH) or
broadcastable to it: branches and skips (a step reads any earlier value), Linear layers, one
shared Linear called by several steps, LSTMs (a tuple of a tensor and a tuple, read with
getitem), `max` and `split` (tuple outputs), constants built in forward (arange, zeros, ones,
full) used by several steps, and in-place changes of earlier values (`add_`, `mul_`, `+=`,
`F.relu(..., inplace=True)`, `nn.ReLU(inplace=True)`, and `mul_` of a view, which changes the
value it views), and values computed under `torch.no_grad()` (a centre and a gate from a Linear
layer that therefore gets no gradient), complex values (an FFT, scaled, transformed back) and
frozen Linear layers. It has one or two inputs and returns one to three values. A cut is a
random topological order of the traced graph (in-place order made explicit, as the planner sees
it) split into chunks of random sizes, each stage with 1 or 2 replicas.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from pdcompile.passes.inplace import make_mutations_explicit
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.plan import Plan

TIME, WIDTH = 3, 4
KINDS = ("linear", "shared", "tanh", "add", "mul", "lstm", "max", "split", "constant",
         "use_constant", "add_", "mul_", "iadd", "relu_inplace", "relu_module", "view_mul_",
         "no_grad", "spectrum", "frozen")
CONSTANTS = ("arange", "zeros", "ones", "full")


@dataclass(frozen=True)
class Step:
    """One step: `kind` reads values `a` and `b` (indices into the pool, or constant `c`)."""

    kind: str
    a: int
    b: int
    c: int = 0


class RandomNet(nn.Module):
    """Runs its steps over the pool of values; the inputs are the first values."""

    def __init__(self, steps: Sequence[Step], inputs: int, outputs: Sequence[int]) -> None:
        super().__init__()
        self.steps = tuple(steps)
        self.inputs = inputs
        self.outputs = tuple(outputs)
        if any(step.kind == "shared" for step in self.steps):  # every parameter gets a grad
            self.shared = nn.Linear(WIDTH, WIDTH)
        self.embed = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(inputs))
        self.layers = nn.ModuleDict()
        for index, step in enumerate(self.steps):
            if step.kind in ("linear", "no_grad"):
                self.layers[str(index)] = nn.Linear(WIDTH, WIDTH)
            elif step.kind == "frozen":  # requires_grad=False: trained by nobody
                self.layers[str(index)] = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
            elif step.kind == "lstm":
                self.layers[str(index)] = nn.LSTM(WIDTH, WIDTH, batch_first=True)
            elif step.kind == "relu_module":
                self.layers[str(index)] = nn.ReLU(inplace=True)

    def extra_repr(self) -> str:
        """The steps, so that a failing example says which model it was."""
        return f"inputs={self.inputs}, outputs={self.outputs}, steps={list(self.steps)}"

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        xs = (x,) if y is None else (x, y)
        pool = [embed(v) for embed, v in zip(self.embed, xs, strict=True)]
        constants: list[torch.Tensor] = []
        for index, step in enumerate(self.steps):
            a, b = pool[step.a % len(pool)], pool[step.b % len(pool)]
            layer = self.layers[str(index)] if str(index) in self.layers else None
            if step.kind in ("linear", "frozen"):
                pool.append(layer(a))  # type: ignore[misc]
            elif step.kind == "shared":
                pool.append(self.shared(a))
            elif step.kind == "tanh":
                pool.append(torch.tanh(a))
            elif step.kind == "add":
                pool.append((a + b) * 0.5)
            elif step.kind == "mul":
                pool.append(torch.tanh(a * b))  # values stay small: float rounding stays small
            elif step.kind == "lstm":
                out, (h, _) = layer(a)  # type: ignore[misc]
                pool.append(out)
                pool.append(h.transpose(0, 1))  # (batch, 1, WIDTH)
            elif step.kind == "max":
                pool.append(a.max(dim=-1, keepdim=True)[0] - a)
            elif step.kind == "split":
                left, right = torch.split(a, [1, WIDTH - 1], dim=-1)
                pool.append(torch.cat([right, left * 2.0], dim=-1))
            elif step.kind == "no_grad":  # neither the centre nor the gate carries a gradient
                with torch.no_grad():
                    centre = a.mean(dim=1, keepdim=True)
                    gate = torch.sigmoid(layer(b))  # type: ignore[misc]
                pool.append(torch.tanh(a - centre) * gate)
            elif step.kind == "spectrum":  # complex values between the FFTs: a cut may fall there
                spectrum = torch.fft.fft(a, dim=-1)
                pool.append(torch.real(torch.fft.ifft(spectrum * torch.tanh(b), dim=-1)))
            elif step.kind == "constant":
                constants.append(_constant(step.c))
            elif step.kind == "use_constant":
                value = constants[step.c % len(constants)] if constants else torch.ones(WIDTH)
                pool.append(a * value + value)
            else:  # in place: readers after it see the change, readers before it do not
                _mutate(step.kind, a, b, layer)
        # every value reaches the loss, so every parameter gets a gradient
        total = sum(v.mean(dim=(1, 2), keepdim=True) for v in pool)
        return tuple(pool[i % len(pool)] + total for i in self.outputs)


def _constant(which: int) -> torch.Tensor:
    kind = CONSTANTS[which % len(CONSTANTS)]
    if kind == "arange":
        return torch.arange(WIDTH) * 0.25 + 0.5
    if kind == "zeros":
        return torch.zeros(1, 1, WIDTH) + 0.5
    if kind == "ones":
        return torch.ones(WIDTH)
    return torch.full((1, WIDTH), 1.5)


def _mutate(kind: str, target: torch.Tensor, other: torch.Tensor, layer: nn.Module | None) -> None:
    if kind == "add_":
        target.add_(other.mean(dim=1, keepdim=True))  # broadcasts to any value's shape
    elif kind == "mul_":
        target.mul_(0.5)
    elif kind == "iadd":
        target += other.mean(dim=1, keepdim=True)
    elif kind == "relu_inplace":
        F.relu(target, inplace=True)
    elif kind == "view_mul_":
        target.narrow(-1, 0, 2).mul_(0.5)  # changes the first two features of `target`
    else:
        layer(target)  # type: ignore[misc]


def squared_error(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """The loss of a RandomNet: the sum over its outputs (target broadcast to each)."""
    return sum((((o - target) ** 2).mean() for o in output), torch.zeros(()))


@st.composite
def random_models(draw: st.DrawFn, max_steps: int = 8) -> tuple[RandomNet, tuple[torch.Tensor,
                                                                                    ...]]:
    """A RandomNet and its inputs (batch 8), in float64: a pipeline sums microbatch gradients
    in another order than one process, and in float32 a model that doubles a value twice in
    place differs from it by rounding alone (6.8e-6 relative, over torch's float32 tolerance);
    in float64 only a real difference shows."""
    inputs = draw(st.integers(1, 2))
    count = draw(st.integers(2, max_steps))
    steps = [Step(draw(st.sampled_from(KINDS)), draw(st.integers(0, 50)),
                  draw(st.integers(0, 50)), draw(st.integers(0, 7))) for _ in range(count)]
    outputs = draw(st.lists(st.integers(-3, -1), min_size=1, max_size=3, unique=True))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = RandomNet(steps, inputs, outputs).double()
    xs = tuple(torch.randn(8, TIME, WIDTH, dtype=torch.float64) for _ in range(inputs))
    return model, xs


def trains_in_one_process(model: nn.Module, inputs: Sequence[torch.Tensor], *,
                          also_rows: Sequence[int] = ()) -> bool:
    """Whether autograd accepts the drawn model on the whole minibatch (and on its first
    `also_rows` samples): PyTorch itself refuses an in-place change of a value a backward needs,
    pipelined or not, at some batch sizes only (an LSTM's input changed in place: at 1)."""
    for rows in (inputs[0].shape[0], *also_rows):
        try:
            out = copy.deepcopy(model)(*(x[:rows] for x in inputs))
            squared_error(out, torch.zeros(())).backward()
        except RuntimeError as err:
            if "modified by an inplace operation" in str(err):
                return False
            raise
    return True


def explicit_graph(model: nn.Module, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The traced graph with in-place order as data edges (what the planner's CostGraph has)."""
    gm = trace(model, num_positional=len(inputs))
    make_mutations_explicit(gm)
    return gm


def random_cut(gm: fx.GraphModule, rng: random.Random, *, stages: int,
               replicas: Sequence[int]) -> Plan:
    """A random topological order of `gm`'s nodes cut into `stages` chunks of random sizes,
    each chunk with at least one operation (placeholders go wherever the order puts them)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    waiting = {n: sum(1 for p in n.all_input_nodes if p.op != "get_attr") for n in nodes}
    ready = [n for n in nodes if waiting[n] == 0]
    order: list[fx.Node] = []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
    ops = [i for i, n in enumerate(order) if n.op != "placeholder"]
    stages = max(1, min(stages, len(ops)))
    starts = sorted(rng.sample(ops[1:], stages - 1)) if stages > 1 else []
    stage_of, stage = {}, 0
    for index, node in enumerate(order):
        while stage < len(starts) and index >= starts[stage]:
            stage += 1
        stage_of[node.name] = stage
    return manual_plan(gm, stage_of, replicas=list(replicas)[:stages])
