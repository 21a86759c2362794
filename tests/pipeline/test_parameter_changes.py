"""A layer that changes its weight in place in forward (`nn.Embedding(max_norm=...)`
renormalises the rows it looks up) trains as one process on a cut where one stage on one worker
holds the weight, and a cut that would give the weight another copy is refused naming the layer
(passes/parameter_changes.py). Before, a replica renormalised only its own microbatches' rows
and a tied head's copy never saw the change: the copies drifted apart silently."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.errors import PlanError
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.transparency import momentum

MICRO, STEPS = 2, 2


class Renormed(nn.Module):
    """Token embeddings renormalised to norm 1 in forward, optionally tied to the head."""

    def __init__(self, *, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, max_norm=1.0)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _example(*, tied: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Renormed(tied=tied).double()
    with torch.no_grad():
        model.embed.weight.mul_(3.0)  # rows longer than max_norm: the forward changes them
    ids = torch.randint(0, 20, (4, 5))
    return model, ids, torch.roll(ids, -1, dims=1)


def _compile(model: nn.Module, ids: torch.Tensor, stages: list[int]) -> pdcompile.Pipeline:
    """`stages`: replicas per stage (two stages always part the embedding from the head)."""
    return pdcompile.compile(copy.deepcopy(model), example_inputs=(ids,), loss_fn=_loss,
                             optimizer=momentum, stages=stages, schedule="1f1b-flush",
                             microbatches=MICRO, cost="analytic")


def test_an_untied_renormalised_embedding_in_its_own_stage_trains_like_one_process() -> None:
    model, ids, target = _example(tied=False)
    pipe = _compile(model, ids, [1, 1])
    losses = [pipe.step(ids, target=target) for _ in range(STEPS)]
    want, state = flush_reference(model, (ids,), target, _loss, MICRO, STEPS, momentum)
    assert losses == pytest.approx(want, rel=1e-9)
    for name, value in state.items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


@pytest.mark.parametrize(("tied", "stages", "why"), [
    (True, [1, 1], r"tied to stage\(s\) 1, whose copy would never see the change"),
    (False, [2, 1], r"stage's 2 replicas would each renormalise only the rows"),
    (False, [2], r"stage's 2 replicas would each renormalise only the rows"),
])
def test_a_cut_giving_a_renormalised_weight_another_copy_is_refused(
        tied: bool, stages: list[int], why: str) -> None:
    model, ids, _ = _example(tied=tied)
    with pytest.raises(PlanError, match=r"layer 'embed' \(stage 0, Embedding with max_norm\) "
                                         r"renormalises rows of its weight in place.*" + why):
        _compile(model, ids, stages)
