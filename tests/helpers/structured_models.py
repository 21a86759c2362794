"""Random models of unusual but valid structure, for the property tests that cut them.

A `StructuredNet` runs drawn steps over one hidden value (batch, WIDTH): Linear layers, one
Linear called at several depths (its parameters read by several stages), in-place changes
(`F.relu(inplace=True)`, `nn.ReLU(inplace=True)`, `add_`, `mul_`), BatchNorm, a counter buffer
and a running mean buffer changed in forward (the counter read back into the hidden value),
integer and bool tensors made at one step and read at a later one (so that they may cross a
cut), `detach`, a `torch.no_grad()` region, a zero-width slice concatenated back, an int
argument, an optional mask (None or a tensor), side values returned beside the result. Its
output is a dict (with None and a number beside the tensors), a tuple, a list or a tensor,
and always holds its `log_var` parameter as it is (the loss weights by it); one Linear layer is
never called. It is called by position (`(x,)`, `(x, None)`) or by name (`{"x": x, "scale":
3}`, `{"x": x, "mask": m}`), on minibatches of 1 to 8 samples that the drawn microbatch count
need not divide.

`structured_reference` trains it in one process with gradient accumulation over the
microbatches the pipeline cuts (`torch.tensor_split`: sizes differing by at most one sample,
each microbatch's loss weighted 1/m) and passes numbers and None whole, as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.transparency import momentum

WIDTH = 4
KINDS = ("linear", "shared", "relu_", "relu_module", "add_", "mul_", "batchnorm", "counter",
         "running", "int_make", "int_use", "bool_make", "bool_use", "detach", "no_grad",
         "zero_width", "scale", "mask", "tanh", "side")
# kinds whose state a replicated stage keeps per replica (README, Limits): drawn without replicas
STATEFUL = frozenset({"batchnorm", "counter", "running"})
FORMS = ("dict", "tuple", "list", "tensor")
CALLS = ("position", "position_none", "name", "name_mask", "name_scale")
Inputs = tuple[Any, ...] | dict[str, Any]


class StructuredNet(nn.Module):
    """Runs `kinds` over one hidden value; returns it in `form` (see the module docstring)."""

    def __init__(self, kinds: Sequence[str], form: str) -> None:
        super().__init__()
        self.kinds, self.form = tuple(kinds), form
        self.embed, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)  # no gradient, no update, in one process too
        self.log_var = nn.Parameter(torch.tensor(0.1))
        if "shared" in kinds:
            self.shared = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleDict()
        for index, kind in enumerate(self.kinds):
            if kind == "linear":
                self.layers[str(index)] = nn.Linear(WIDTH, WIDTH)
            elif kind == "batchnorm":
                self.layers[str(index)] = nn.BatchNorm1d(WIDTH)
            elif kind == "relu_module":
                self.layers[str(index)] = nn.ReLU(inplace=True)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(WIDTH))

    def extra_repr(self) -> str:
        """The drawn structure, so that a failing example says which model it was."""
        return f"kinds={list(self.kinds)}, form={self.form!r}"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: int = 2) -> Any:
        h = self.embed(x)
        ints: list[torch.Tensor] = []
        bools: list[torch.Tensor] = []
        sides: list[torch.Tensor] = []
        for index, kind in enumerate(self.kinds):
            if kind in ("linear", "batchnorm", "relu_module"):
                h = self.layers[str(index)](h)
            elif kind == "shared":
                h = self.shared(h)
            else:
                h = self._step(kind, h, ints, bools, sides, mask, scale)
        out = self.head(h)
        if self.form == "dict":
            return {"out": out, "sides": sides, "log_var": self.log_var, "n": 3, "none": None}
        if self.form == "tuple":
            return out, tuple(sides), self.log_var
        if self.form == "list":
            return [out, self.log_var, *sides]
        return out * torch.exp(self.log_var)

    def _step(self, kind: str, h: torch.Tensor, ints: list[torch.Tensor],
              bools: list[torch.Tensor], sides: list[torch.Tensor], mask: torch.Tensor | None,
              scale: int) -> torch.Tensor:
        if kind == "relu_":
            return F.relu(h, inplace=True)
        if kind == "add_":
            return h.add_(0.5)
        if kind == "mul_":
            return h.mul_(0.5)
        if kind == "counter":
            self.count += 1
            return h + self.count.to(h.dtype) * 0.01
        if kind == "running":
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
            return h - self.running
        if kind == "int_make":
            ints.append((h > 0).long().sum(-1, keepdim=True))
        elif kind == "int_use" and ints:
            return h + ints[-1].to(h.dtype) * 0.1
        elif kind == "bool_make":
            bools.append(h > 0)
        elif kind == "bool_use" and bools:
            return torch.where(bools[-1], h, h * 0.5)
        elif kind == "detach":
            return h + h.detach() * 0.5
        elif kind == "no_grad":
            with torch.no_grad():
                centre = h.mean(-1, keepdim=True)
            return h - centre
        elif kind == "zero_width":
            return torch.cat([h, h[:, :0] * 2.0], dim=-1)
        elif kind == "scale":
            return h * scale
        elif kind == "mask" and mask is not None:
            return h * mask
        elif kind == "tanh":
            return torch.tanh(h)
        elif kind == "side":
            sides.append(h.sum(-1))
        return h


def structured_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Squared error of the result weighted by exp(-log_var), plus log_var and the side values'
    means (every form)."""
    if isinstance(output, dict):
        out, sides, log_var = output["out"], output["sides"], output["log_var"]
    elif isinstance(output, tuple):
        out, sides, log_var = output[0], list(output[1]), output[2]
    elif isinstance(output, list):
        out, log_var, sides = output[0], output[1], output[2:]
    else:
        out, sides, log_var = output, [], torch.zeros((), dtype=output.dtype)
    loss = torch.exp(-log_var) * ((out - target) ** 2).mean() + log_var
    return loss + sum((0.1 * s.mean() for s in sides), torch.zeros((), dtype=out.dtype))


@st.composite
def structured_models(draw: st.DrawFn) -> dict[str, Any]:
    """A StructuredNet in float64, how it is called, a target, and a microbatch count of at
    most the batch size (2 samples each where BatchNorm trains)."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=2, max_size=10))
    form = draw(st.sampled_from(FORMS))
    least = 2 if "batchnorm" in kinds else 1
    batch = draw(st.sampled_from([b for b in (1, 2, 3, 5, 8) if b >= least]))
    micro = draw(st.integers(1, min(4, batch // least)))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = StructuredNet(kinds, form).double()
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    mask = (torch.rand(batch, WIDTH) > 0.3).double()
    call = draw(st.sampled_from(CALLS))
    inputs: Inputs = {"position": (x,), "position_none": (x, None), "name": {"x": x},
                      "name_mask": {"x": x, "mask": mask},
                      "name_scale": {"x": x, "scale": 3}}[call]
    return {"model": model, "inputs": inputs, "micro": micro,
            "target": torch.randn(batch, WIDTH, dtype=torch.float64),
            "stateful": bool(STATEFUL & set(kinds))}


def structured_reference(model: nn.Module, inputs: Inputs, target: torch.Tensor, micro: int,
                         steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and state after `steps` updates of one-process training (SGD with momentum, as
    `momentum`), each accumulating the microbatches' gradients."""
    return flush_reference(model, inputs, target, structured_loss, micro, steps, momentum)
