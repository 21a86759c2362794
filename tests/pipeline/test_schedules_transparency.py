"""Transparency of the interleaved and zero-bubble schedules and of activation recomputation.

They are flush schedules: on every example model (tests/helpers/transparency.py's grid: VGG-16,
ResNet-50, GNMT-like, GPT-2-style, small sizes) their losses, gradients, updated weights and
buffers equal single-process training with gradient accumulation over the same microbatches, for
several steps; interleaved pipelines put 2 or 3 chunks on each of 2 or 3 ranks, zero-bubble ones
defer the Linear layers' weight gradients to W, and recomputing stages run their forwards twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from torch import nn

import pdcompile
from pdcompile.passes.split import even_plan
from pdcompile.passes.trace import trace
from pdcompile.planner.interleave import interleaved_plan, v_plan
from tests.helpers.transparency import (
    MODELS,
    check,
    crossed_ties,
    crossed_ties_plan,
    skip_plan,
    skipnet,
    tied_bn,
    tied_plan,
)


def chunks(ranks: int, per_rank: int) -> Callable[[nn.Module], pdcompile.Plan]:
    return lambda model: interleaved_plan(trace(model), ranks, per_rank)


def v_shaped(ranks: int) -> Callable[[nn.Module], pdcompile.Plan]:
    return lambda model: v_plan(trace(model), ranks)


def straight(stages: int, *, recompute: bool = False) -> Callable[[nn.Module], pdcompile.Plan]:
    def plan(model: nn.Module) -> pdcompile.Plan:
        made = even_plan(trace(model), stages)
        return replace(made, stages=tuple(replace(s, recompute=recompute)
                                          for s in made.stages))
    return plan


LAYOUTS: dict[str, tuple[str, Callable[[nn.Module], pdcompile.Plan]]] = {
    "interleaved-1f1b-2x2": ("interleaved-1f1b", chunks(2, 2)),
    "interleaved-1f1b-3x2": ("interleaved-1f1b", chunks(3, 2)),
    "interleaved-1f1b-2x3": ("interleaved-1f1b", chunks(2, 3)),
    "zb-h1-2": ("zb-h1", straight(2)),
    "zb-h1-4": ("zb-h1", straight(4)),
    "interleaved-zb-2x2": ("interleaved-zb", chunks(2, 2)),
    "1f1b-flush-3-recompute": ("1f1b-flush", straight(3, recompute=True)),
    "zb-h1-3-recompute": ("zb-h1", straight(3, recompute=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_example_models(model: str, layout: str) -> None:
    schedule, plan = LAYOUTS[layout]
    pipe = check(MODELS[model](), schedule=schedule, micro=4, plan=plan)
    assert pipe.schedule(4).name == schedule


# a V puts the first and the last stage on rank 0, and GPT-2's tied embedding with them
# (tests/pipeline/test_ties_within_rank.py checks every copy of it); every model on 2 and 3 ranks
V_LAYOUTS: dict[str, tuple[str, int, Callable[[nn.Module], pdcompile.Plan]]] = {
    "zb-v-2": ("zb-v", 4, v_shaped(2)),
    "zb-v-3": ("zb-v", 4, v_shaped(3)),
    "dualpipev-2": ("dualpipev", 4, v_shaped(2)),
    "dualpipev-3": ("dualpipev", 8, v_shaped(3)),
}


@pytest.mark.parametrize(("model", "layout"), [
    (model, layout) for model in MODELS for layout in V_LAYOUTS
    if not (model == "resnet50" and V_LAYOUTS[layout][1] == 8)])  # BatchNorm of 1 sample
def test_v_shaped_on_example_models(model: str, layout: str) -> None:
    schedule, micro, plan = V_LAYOUTS[layout]
    pipe = check(MODELS[model](), schedule=schedule, micro=micro, plan=plan)
    ranks = len(pipe.plan.stages) // 2
    assert [s.ranks[0] for s in pipe.plan.stages] == [*range(ranks), *reversed(range(ranks))]
    assert pipe.schedule(micro).name == schedule


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-1f1b"])
def test_skip_connection_and_tied_embedding(schedule: str) -> None:
    if schedule == "zb-h1":
        check(skipnet(), schedule=schedule, micro=4,
              plan=lambda m: replace(skip_plan(m), stages=tuple(
                  replace(s, replicas=1, ranks=(i,)) for i, s in enumerate(skip_plan(m).stages)),
                  workers=4))
        check(tied_bn(), schedule=schedule, micro=2, plan=tied_plan)
    else:  # 4 chunks on 2 ranks: the tie spans stages 0 and 3, on ranks 0 and 1
        pipe = check(tied_bn(), schedule=schedule, micro=2, plan=chunks(2, 2))
        assert pipe.parts.ties and pipe.parts.ties[0].stages == (0, 3)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "dualpipev"])
def test_stages_k_with_a_chunked_schedule_trains_like_one_process(schedule: str) -> None:
    """`compile(stages=2, schedule=...)` with chunks: two workers holding two chunks each (it
    was refused, saying the model did not fit the memory)."""
    pipe = check(skipnet(), schedule=schedule, micro=4, plan=None, stages=2)
    assert sorted({s.ranks for s in pipe.plan.stages}) == [(0,), (1,)]
    assert len(pipe.plan.stages) == 4


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb"])
def test_ties_over_the_same_ranks_reduce_in_one_order(schedule: str) -> None:
    """Found by random cuts of HF's RWKV (its time_mix parameters read in several chunks): two
    tie groups over the same two ranks were all-reduced in each rank's chunk order, rank 0 a's
    then b's, rank 1 b's then a's, so each rank summed one tie's gradient with the other's:
    silently wrong where the shapes agreed (here), a failed all-reduce where they did not
    ('stack expects each tensor to be equal size'). Every rank now reduces its ties in one
    order, that of the stages sharing them."""
    model, x, y = crossed_ties()
    pipe = check((model, (x,), y, nn.functional.mse_loss), schedule=schedule, micro=2,
                 plan=crossed_ties_plan(model))
    assert sorted(tie.stages for tie in pipe.parts.ties) == [(0, 3), (1, 2)]
