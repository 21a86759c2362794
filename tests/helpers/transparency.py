"""The transparency check: a pipeline against single-process training with gradient
accumulation (losses, gradients, weights, buffers), and the models and plans it is run on."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import pdcompile
from pdcompile.models import gnmt, gpt2, resnet50, vgg16
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.planner.interleave import interleave

STEPS = 3


def momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class SkipNet(nn.Module):
    """An MLP whose first activation skips to the last stage (not relayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 12)
        self.mid = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.out = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        y = h
        for layer in self.mid:
            y = torch.tanh(layer(y))
        return self.out(y + h)


class TiedBN(nn.Module):
    """Tied input/output embedding across stages plus BatchNorm in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(1)
        h = torch.relu(self.bn(self.proj(h)))
        return self.head(h)


class CrossedTies(nn.Module):
    """Two parameters each read by two chunks of 2 ranks, in crossed order: `a` by stages 0
    and 3, `b` by stages 1 and 2 (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l0(x) * self.a)
        h = torch.tanh(self.l1(h) + self.b)
        h = torch.tanh(self.l2(h) - self.b)
        return self.l3(h) * self.a


def crossed_ties() -> tuple[CrossedTies, torch.Tensor, torch.Tensor]:
    """CrossedTies in float64 and a minibatch of 8 (input, target)."""
    torch.manual_seed(0)
    return CrossedTies().double(), torch.randn(8, 4, dtype=torch.float64), \
        torch.randn(8, 4, dtype=torch.float64)


def crossed_ties_plan(model: nn.Module) -> pdcompile.Plan:
    """CrossedTies' four layers as four chunks interleaved on 2 ranks."""
    stage = {"l0": 0, "mul": 0, "tanh": 0, "l1": 1, "add": 1, "tanh_1": 1, "l2": 2, "sub": 2,
             "tanh_2": 2, "l3": 3, "mul_1": 3}
    return interleave(manual_plan(trace(model), lambda n: stage.get(n.name, 0)), 2)


def ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


Case = tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Callable[..., torch.Tensor]]


def skipnet() -> Case:
    x = torch.randn(8, 10)
    return SkipNet(), (x,), torch.randn(8, 5), nn.functional.mse_loss


def tied_bn() -> Case:
    idx = torch.randint(0, 20, (8, 3))
    return TiedBN(), (idx,), torch.randint(0, 20, (8,)), ce


def vgg(batch_norm: bool = False) -> Case:
    model, inputs = vgg16.factory(batch_size=8, image_size=32, width=16, batch_norm=batch_norm)
    return model, inputs, vgg16.make_target(inputs), vgg16.loss_fn


def resnet() -> Case:
    model, inputs = resnet50.factory(batch_size=8, image_size=64, width=16, blocks=(1, 1, 1, 1))
    return model, inputs, resnet50.make_target(inputs), resnet50.loss_fn


def gnmt_case() -> Case:
    model, inputs = gnmt.factory(batch_size=8, src_len=5, tgt_len=5, vocab_size=40, hidden=16,
                                 layers=2)
    return model, inputs, gnmt.make_target(inputs, vocab_size=40), gnmt.loss_fn


def gpt_case() -> Case:
    model, inputs = gpt2.factory(size="tiny", layers=2, d=16, heads=2, vocab_size=50, seq_len=6,
                                 batch_size=8, dropout=0.0)
    return model, inputs, gpt2.make_target(inputs, vocab_size=50), gpt2.loss_fn


def reference(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
              loss_fn: Callable[..., torch.Tensor], micro: int
              ) -> tuple[list[float], dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Ordinary training with gradient accumulation over `micro` microbatches."""
    opt = momentum(list(model.parameters()))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for part in zip(*(t.chunk(micro) for t in inputs), target.chunk(micro), strict=True):
            loss = loss_fn(model(*part[:-1]), part[-1])
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        losses.append(total)
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, model.state_dict()


def replicated_buffers(pipe: pdcompile.pipeline.Pipeline) -> set[str]:
    """Original names of the buffers that live on a replicated stage."""
    return {original for program, stage in zip(pipe.parts.stages, pipe.plan.stages, strict=True)
            if len(stage.ranks) > 1 for originals in program.buffer_names.values()
            for original in originals}


def check(case: Case, *, schedule: str, micro: int, plan: Any,
          replicated_stats: bool = True, **options: Any) -> pdcompile.pipeline.Pipeline:
    """Compare with `reference`; `replicated_stats=False` leaves out the buffers (BatchNorm
    statistics) of replicated stages, which are the mean over replicas of statistics each kept
    from its own microbatches (tests/pipeline/test_transparency.py checks how close they are).
    `options` go to `compile` (e.g. frontend="export")."""
    model, inputs, target, loss_fn = case
    for module in model.modules():  # a pipeline draws dropout masks in another order
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=micro,
                             plan=plan(model) if callable(plan) else plan, **options)
    with torch.no_grad():
        torch.testing.assert_close(pipe(*inputs), model(*inputs))
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    ref_losses, ref_grads, ref_state = reference(model, inputs, target, loss_fn, micro)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    params = pipe.named_parameters()
    for name, grad in ref_grads.items():
        if grad is None:  # frozen, or used under no_grad only: no gradient, no update
            got = params[name].grad
            assert got is None or not got.any(), f"{name} has a gradient; in one process none"
            continue
        torch.testing.assert_close(params[name].grad, grad, msg=lambda m, n=name: f"{n}: {m}")
    state = pipe.state_dict()
    assert set(state) == set(ref_state)
    left_out = set() if replicated_stats else replicated_buffers(pipe)
    for name, value in ref_state.items():
        if name in left_out:
            continue
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")
    return pipe


def skip_plan(model: nn.Module) -> pdcompile.Plan:
    """inp | mid.0 | mid.1 | mid.2 + out: h jumps from stage 0 to stage 3."""
    gm = trace(model)
    order = {"inp": 0, "tanh": 0, "mid_0": 1, "tanh_1": 1, "mid_1": 2, "tanh_2": 2}
    return manual_plan(gm, lambda n: order.get(n.name, 0 if n.op == "placeholder" else 3),
                       replicas=[1, 2, 1, 1])


def tied_plan(model: nn.Module) -> pdcompile.Plan:
    """emb | proj+bn | head: the tied embedding lives in stages 0 and 2."""
    gm = trace(model)
    order = {"proj": 1, "bn": 1, "relu": 1, "head": 2}
    return manual_plan(gm, lambda n: order.get(n.name, 0))


# every example model, small
MODELS: dict[str, Callable[[], Case]] = {"vgg16": vgg, "resnet50": resnet, "gnmt": gnmt_case,
                                         "gpt2": gpt_case}
