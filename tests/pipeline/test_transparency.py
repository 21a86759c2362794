"""Transparency: flush pipelines train exactly like ordinary gradient accumulation.

For every example model (VGG-16, ResNet-50, GNMT-like, GPT-2-style; small sizes) with 2, 3 and 4
stages and with a replicated stage, under `1f1b-flush` and `gpipe` (the full grid), and for
models with skip connections across stages, tied embeddings and BatchNorm, pipelines give the
same losses, gradients, updated weights and buffers as single-process training with gradient
accumulation over the same microbatches, for several steps. Exception: BatchNorm running
statistics on a replicated stage are the mean of the replicas' statistics (synchronised at every
update), close to but not equal to single-process statistics, which see all microbatches in turn;
the grid leaves them out (tests/runtime/test_replica_buffers.py checks them; the test below checks
the count and that they stay close).

ResNet runs on 64x64 images: at 32x32 its last BatchNorm normalises 2 values per microbatch and
three steps of training amplify float summation order (gpipe's reversed backward order) beyond
any tolerance, even between two single-process references.
"""

from __future__ import annotations

import pytest
import torch

from pdcompile.models import alexnet
from tests.helpers.transparency import (
    MODELS,
    STEPS,
    check,
    gpt_case,
    replicated_buffers,
    resnet,
    skip_plan,
    skipnet,
    tied_bn,
    tied_plan,
)


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_skip_connection_jumps_stages(schedule: str) -> None:
    pipe = check(skipnet(), schedule=schedule, micro=4, plan=skip_plan)
    assert pipe.stage_programs[0].sends == {1: ("tanh",), 3: ("tanh",)}
    assert pipe.parts.edges == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert all("pd.stage" in n.meta for n in pipe.graph.graph.nodes)


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_tied_embedding_and_batchnorm(schedule: str) -> None:
    pipe = check(tied_bn(), schedule=schedule, micro=2, plan=tied_plan)
    (tie,) = pipe.parts.ties
    assert tie.stages == (0, 2)
    first = pipe.stage_modules[0].get_parameter(tie.members[0][1])
    last = pipe.stage_modules[2].get_parameter(tie.members[1][1])
    assert first is not last
    torch.testing.assert_close(first, last)
    assert any(name.startswith("bn") for name in dict(pipe.stage_modules[1].named_buffers()))


# every example model x stage layout x flush schedule; plans: stage count, or replicas per stage
LAYOUTS: dict[str, dict[str, int | list[int]]] = {
    "2": {name: 2 for name in MODELS},
    "3": {name: 3 for name in MODELS},
    "4": {name: 4 for name in MODELS},
    "replicated": {"vgg16": [2, 1], "resnet50": [1, 2], "gnmt": [2, 1, 1], "gpt2": [1, 2, 1]},
}
# whole models on 3 and 4 stages: slow lane; on 2 stages and replicated: fast lane too
LAYOUT_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] * (name in ("3", "4")))
                 for name in LAYOUTS]


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@pytest.mark.parametrize("model", list(MODELS))
def test_example_models(model: str, layout: str, schedule: str) -> None:
    plan = LAYOUTS[layout][model]
    pipe = check(MODELS[model](), schedule=schedule, micro=4, plan=plan,
                 replicated_stats=False)
    stages = plan if isinstance(plan, int) else len(plan)
    assert len(pipe.stage_modules) == stages
    if isinstance(plan, list):
        assert [len(s.ranks) for s in pipe.plan.stages] == plan


def test_batchnorm_statistics_of_a_replicated_stage() -> None:
    """Replicas end with equal statistics (synchronised at every update) and the single-process
    count of batches. Their running averages take 2 momentum steps per update (4 microbatches
    over 2 replicas) where single-process training takes 4, so they trail it: from where they
    started, they cover more than 60% of the way to single-process statistics (about 70%)."""
    case = resnet()
    start = {name: value.clone() for name, value in case[0].state_dict().items()}
    pipe = check(case, schedule="1f1b-flush", micro=4, plan=[1, 2], replicated_stats=False)
    left_out = replicated_buffers(pipe)
    assert any(name.endswith("running_mean") for name in left_out)
    ref_state = case[0].state_dict()  # check() trained the model itself as the reference
    replicas = [dict(pipe.ranks[r].module.named_buffers()) for r in pipe.plan.stages[1].ranks]
    for name, value in replicas[0].items():
        assert torch.equal(replicas[1][name], value), name
    state = pipe.state_dict()
    for name in left_out:
        if name.endswith("num_batches_tracked"):
            # check() called the pipeline and the model once before training, in training mode
            assert int(state[name]) == int(ref_state[name]) == 1 + STEPS * 4, name
        else:
            left = (state[name] - ref_state[name]).norm() / (start[name] - ref_state[name]).norm()
            assert left < 0.4, (name, float(left))


def test_gpt2_tied_embeddings_three_stages() -> None:
    pipe = check(gpt_case(), schedule="1f1b-flush", micro=2, plan=3)
    assert pipe.parts.ties and pipe.parts.ties[0].stages == (0, 2)


def test_gpt2_four_stages_integer_positions_cross_stages() -> None:
    case = gpt_case()
    pipe = check(case, schedule="gpipe", micro=2, plan=4)
    dtypes = {spec.dtype for specs in pipe.edge_specs(case[1]).values() for spec in specs}
    assert torch.int64 in dtypes and torch.float32 in dtypes  # positions travel with activations


def test_alexnet_planned_stages_without_parameters() -> None:
    model, inputs = alexnet.factory(batch_size=8, image_size=64, width=8)
    case = (model, inputs, alexnet.make_target(inputs), alexnet.loss_fn)
    pipe = check(case, schedule="gpipe", micro=2, plan=[1, 2, 1, 1])
    assert len(pipe.stage_modules) == 4
