"""A parameter tied between two chunks of one rank trains like one process.

A V (ZB-V, DualPipeV) puts stages 0 and 2p - 1 on rank 0, so a language model whose output head
is tied to its embedding has both holders of the tie there; an interleaved cut can do the same.
This was refused ("shared by stages ..., two of which are chunks of one rank"); now the copies'
gradients are summed on the rank, all-reduced once with the other ranks holding the tie, and
every copy gets the total (runtime/rank_ties.py). Losses and every copy of every parameter, on
every chunk, after three updates equal gradient accumulation in one process, in float64.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.schedule.kinds import KINDS, kind
from tests.helpers.schedule_cuts import (
    cut_graph,
    fits,
    flush_reference,
    micro_options,
    placed_cut,
)
from tests.helpers.tied_models import (
    assert_every_copy,
    gpt2_case,
    interleaved_tie_plan,
    tied_lm_case,
    ties_within_a_rank,
    trains_like_one_process,
    v_shaped,
)
from tests.helpers.transparency import momentum

CHUNKED = tuple(name for name, row in KINDS.items() if row.interleaved)

LAYOUTS: dict[str, tuple[str, Callable[[nn.Module], pdcompile.Plan]]] = {
    "zb-v": ("zb-v", v_shaped),
    "dualpipev": ("dualpipev", v_shaped),
    "interleaved-1f1b": ("interleaved-1f1b", interleaved_tie_plan),
    "interleaved-zb": ("interleaved-zb", interleaved_tie_plan),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt2_tied_embedding_on_two_chunks_of_one_rank(layout: str) -> None:
    """The bundled GPT-2, 4 chunks on 2 ranks, wte and lm_head on one rank."""
    schedule, plan = LAYOUTS[layout]
    case = gpt2_case()
    pipe = trains_like_one_process(case, schedule=schedule, plan=plan(case[0]), micro=4)
    assert ties_within_a_rank(pipe) == ["wte.weight"]


def test_a_tie_on_two_chunks_of_one_rank_and_on_another_rank() -> None:
    """TiedLM's embedding read by stages 0, 2 and 3 of a V on 2 ranks: rank 0 sums its two
    copies, then one all-reduce with rank 1's copy."""
    case = tied_lm_case()
    pipe = trains_like_one_process(case, schedule="zb-v", plan=v_shaped(case[0]), micro=4)
    tie = next(t for t in pipe.parts.ties if t.name == "emb.weight")
    assert [pipe.plan.stages[s].ranks[0] for s in tie.stages] == [0, 1, 0]


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_gpt2_on_a_v_of_three_ranks(schedule: str) -> None:
    case = gpt2_case(batch=12)
    micro = 6 if kind(schedule).microbatches_per_rank else 4
    pipe = trains_like_one_process(case, schedule=schedule, plan=v_shaped(case[0], 3),
                                   micro=micro)
    assert ties_within_a_rank(pipe) == ["wte.weight"]


@pytest.mark.parametrize("layout", ["zb-v", "interleaved-1f1b"])
def test_an_export_of_a_tie_within_a_rank_trains_and_evaluates_on(layout: str,
                                                                   tmp_path: Path) -> None:
    """Exported after one update and loaded, two more updates give single-process training's
    three (each chunk's copy and its optimizer state travel with its stage), and the loaded
    pipeline's evaluation (its stage graphs: the last stage reads its own copy of the tie)
    is the trained model's in eval mode."""
    schedule, plan = LAYOUTS[layout]
    model, inputs, target, loss_fn = gpt2_case()
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=4,
                             plan=plan(model), example_target=target)
    first = pipe.step(*inputs, target=target)
    pipe.export(tmp_path / "export")
    loaded = pdcompile.load(tmp_path / "export")
    losses = [first] + [loaded.step(*inputs, target=target) for _ in range(2)]
    want, state = flush_reference(model, inputs, target, loss_fn, 4, 3, momentum)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    assert_every_copy(loaded, state, layout)
    trained = copy.deepcopy(model)
    trained.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(loaded.evaluate(*inputs), trained.eval()(*inputs))


BATCH = 12  # 1, 2, 3, 4 and 6 microbatches


@st.composite
def tied_cuts(draw: st.DrawFn) -> dict[str, Any]:
    case = tied_lm_case(draw(st.integers(0, 2**16)), batch=BATCH)
    schedule = draw(st.sampled_from(CHUNKED))
    plan = placed_cut(cut_graph(case[0], case[1]), random.Random(draw(st.integers(0, 2**32))),
                      schedule)
    if not fits(plan, schedule):
        reject()  # too few operations for the chunks
    options = micro_options(schedule, plan, BATCH)
    if not options:
        reject()
    return {"case": case, "schedule": schedule, "plan": plan,
            "micro": draw(st.sampled_from(options)), "clip": draw(st.sampled_from([None, 0.05]))}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tied_cuts())
def test_random_cuts_of_a_tied_model_under_every_chunked_schedule(drawn: dict[str, Any]
                                                                  ) -> None:
    """Any cut of TiedLM (its embedding read in three places) under interleaved 1F1B and zero
    bubble, ZB-V and DualPipeV on 2-3 ranks, recomputing stages included, with or without
    clipping by the global gradient norm: ties within one rank, across ranks, and both at once
    all train like one process."""
    trains_like_one_process(drawn["case"], schedule=drawn["schedule"], plan=drawn["plan"],
                            micro=drawn["micro"], clip=drawn["clip"])
