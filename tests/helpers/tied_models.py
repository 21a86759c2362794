"""Models with tied parameters, cuts that put two holders of a tie on one rank, and the check
that every copy of every parameter, on every rank and chunk, equals single-process training.

A V (ZB-V, DualPipeV) puts the first and the last stage on rank 0, so the bundled GPT-2's tied
embedding (`wte`, read again as `lm_head`) has both holders there; `interleaved_tie_plan`
does the same under interleaved 1F1B by putting `wte` in stage 1 and `lm_head` in stage 3, both
on rank 1. `TiedLM` reads its embedding in three places (input, middle, head), so random cuts
give ties held by one rank alone, by two ranks, and by two chunks of one rank and another rank;
its layer `mix`, called twice in the middle, gives ties that leave out the first stage.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

import pdcompile
from pdcompile.models import gpt2
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.planner.interleave import interleave, v_plan
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.transparency import momentum

BATCH = 8
Case = tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Any]


def gpt2_case(batch: int = BATCH) -> Case:
    """The bundled GPT-2 (tied wte / lm_head), 2 layers of width 16, in float64."""
    torch.manual_seed(0)
    model, (idx,) = gpt2.factory(size="tiny", layers=2, d=16, heads=2, vocab_size=50,
                                 seq_len=6, batch_size=batch, dropout=0.0)
    return model.double(), (idx,), gpt2.make_target((idx,), vocab_size=50), gpt2.loss_fn


class TiedLM(nn.Module):
    """A token embedding read three times: at the input, in the middle (as a projection onto
    the vocabulary and back) and as the output head; and a layer `mix` called twice in the
    middle, a tie that need not reach the first stage."""

    def __init__(self, vocab: int = 11, width: int = 6, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i in (0, 2):
                h = h + torch.tanh(self.mix(h))
            if i == 1:
                scores = torch.tanh(nn.functional.linear(h, self.emb.weight))
                h = h + 0.5 * scores @ self.emb.weight
        return self.head(h)


def tied_lm_case(seed: int = 0, batch: int = BATCH) -> Case:
    """TiedLM in float64, a minibatch of `batch` sequences of 3 tokens and their targets."""
    torch.manual_seed(seed)
    model = TiedLM().double()
    idx = torch.randint(0, 11, (batch, 3))
    return model, (idx,), torch.randint(0, 11, (batch, 3)), gpt2.loss_fn


def interleaved_tie_plan(model: nn.Module) -> pdcompile.Plan:
    """GPT-2 in four chunks on 2 ranks (stage c on rank c mod 2) with both users of the tied
    embedding on rank 1: the positions | wte and block 0 | block 1 | ln_f and lm_head."""
    gm = trace(model)
    order = [n.name for n in gm.graph.nodes]
    starts = [order.index(name) for name in ("wte", "h_1_ln_1", "ln_f")]
    return interleave(manual_plan(gm, lambda n: sum(order.index(n.name) >= s for s in starts)),
                      2)


def v_shaped(model: nn.Module, ranks: int = 2) -> pdcompile.Plan:
    """A V on `ranks` ranks (stages 0 and 2p - 1 on rank 0)."""
    return v_plan(trace(model), ranks)


def ties_within_a_rank(pipe: pdcompile.pipeline.Pipeline) -> list[str]:
    """The tied parameters two of whose holders are chunks of one rank."""
    return [tie.name for tie in pipe.parts.ties
            if len({pipe.plan.stages[s].ranks for s in tie.stages}) < len(tie.stages)]


def assert_every_copy(pipe: pdcompile.pipeline.Pipeline, state: dict[str, torch.Tensor],
                      case: object = "") -> None:
    """Every parameter every rank holds, in every chunk, equals `state`'s of that name (a tied
    parameter's copies each, not only the first)."""
    for held in pipe.states():
        program = pipe.parts.stages[held.stage]
        for name, param in held.module.named_parameters(remove_duplicate=False):
            for original in program.param_names.get(name, (name,)):
                torch.testing.assert_close(
                    param.detach(), state[original],
                    msg=lambda m, o=original, h=held: f"{case} rank {h.rank} stage {h.stage} "
                                                      f"{o}: {m}")


def trains_like_one_process(case: Case, *, schedule: str, plan: pdcompile.Plan, micro: int,
                            steps: int = 3, clip: float | None = None
                            ) -> pdcompile.pipeline.Pipeline:
    """`steps` updates of the pipeline give the losses of gradient accumulation over `micro`
    microbatches in one process (with `clip`: gradients clipped by their global norm), and
    every copy of every parameter its weights."""
    model, inputs, target, loss_fn = case
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=micro,
                             plan=plan, clip_grad_norm=clip)
    losses = [pipe.step(*inputs, target=target) for _ in range(steps)]
    want, state = flush_reference(model, inputs, target, loss_fn, micro, steps, momentum,
                                  clip=clip)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64),
                               msg=lambda m: f"{schedule}: {m}")
    assert_every_copy(pipe, state, schedule)
    return pipe
