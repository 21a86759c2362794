"""A replica that no microbatch of a minibatch reaches (fewer microbatches than replicas) adds
nothing to the minibatch's update. Its gradients were cleared only by its next backward, so it
all-reduced the gradients of the last update again and every replica applied them twice (found
by random cuts under every schedule: timm's vit_tiny, 1 microbatch on a stage of 2 replicas,
the third loss off by 0.097 with no error)."""

from __future__ import annotations

import pytest
import torch

from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.plan import Plan
from pdcompile.schedule.ir import Kind
from tests.helpers.transparency import check, skip_plan, skipnet


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize(("micro", "replicas"), [(1, [2]), (2, [3]), (1, [1, 2, 1, 2])])
def test_a_replica_without_microbatches_adds_nothing(schedule: str, micro: int,
                                                     replicas: list[int]) -> None:
    model, inputs, target, loss_fn = skipnet()
    model, inputs, target = model.double(), (inputs[0].double(),), target.double()

    def plan(m: torch.nn.Module) -> Plan:
        if len(replicas) == 1:
            return manual_plan(trace(m), lambda n: 0, replicas=replicas)
        made = skip_plan(m)
        return manual_plan(trace(m), {name: s for s, stage in enumerate(made.stages)
                                      for name in stage.nodes}, replicas=replicas)

    pipe = check((model, inputs, target, loss_fn), schedule=schedule, micro=micro, plan=plan)
    schedule_run = pipe.schedule(micro)
    idle = [rank for rank, actions in schedule_run.actions.items()
            if not any(a.kind is Kind.F for a in actions)]
    assert idle, "some replica takes no microbatch"
