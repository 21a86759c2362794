"""The pipeline summary says where a tied parameter is all-reduced and what that costs.

The bundled GPT-2 (tied wte / lm_head) cut between its two blocks: the embedding's and the
head's stages sit on ranks 0 and 1, so every update all-reduces the tie's gradients between
them, which the summary names with its bytes, its ranks and its price on the plan's cluster
(cost/ties.py); in a V both readers sit on rank 0 and nothing is all-reduced.
"""

from __future__ import annotations

import copy

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from tests.helpers.tied_models import gpt2_case, v_shaped


def test_the_summary_prices_a_tie_split_across_ranks_and_not_one_on_one_rank() -> None:
    model, inputs, target, loss_fn = gpt2_case()
    gm = trace(model)
    order = [n.name for n in gm.graph.nodes]
    cut = order.index("h_1_ln_1")
    plan = manual_plan(gm, lambda n: int(order.index(n.name) >= cut))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             plan=plan, example_target=target, cluster="2@1e6",
                             cost="analytic", schedule="1f1b-flush", microbatches=4)
    # 50 x 16 float64 weights: 6,400 bytes, once each way between two ranks at 1e6 B/s
    assert "tied: wte.weight held by stages [0, 1] (gradients summed, 6.2 KiB all-reduced " \
           "over ranks [0, 1] at each update: 6.4 ms)" in pipe.summary()
    # a V holds both readers on rank 0: summed there, nothing all-reduced
    v = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                          plan=v_shaped(model), example_target=target, schedule="zb-v",
                          microbatches=4)
    assert "tied: wte.weight held by stages [0, 3] (gradients summed)" in v.summary()
