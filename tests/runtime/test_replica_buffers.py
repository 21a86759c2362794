"""Buffers of a replicated stage (BatchNorm running statistics) are synchronised at every update.

Each replica of a stage sees only its own microbatches (microbatch m goes to replica m mod r), so
without a sync its BatchNorm statistics drift from the other replicas'. `StageRuntime.step`
all-reduces them before the optimizer step: floating-point buffers become the mean over the
replicas, integer buffers (`num_batches_tracked`) count every replica's batches, as
single-process training counts them. Checked for both layouts of a two-stage conv + BatchNorm
model (first or second stage replicated) under every schedule, and against an independent
reference (one copy of the model per replica fed that replica's microbatches, then averaged).
Not single-process statistics: each replica's running average takes M / r momentum steps per
update where single-process training takes M, so the statistics trail it (exactly M / r steps'
worth for equal microbatches; tests/pipeline/test_transparency.py checks ResNet's stay close).
The distributed backend is compared with the local one in
tests/backends/test_distributed_equivalence.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from tests.helpers.transparency import TiedBN

MICRO, BATCH, STEPS = 4, 8, 3
LAYOUTS = ([1, 2], [2, 1])


class ConvBN(nn.Module):
    """conv1 + bn1 | conv2 + bn2 + head: one BatchNorm in each stage."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


def _model() -> ConvBN:
    torch.manual_seed(0)
    return ConvBN()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    # inputs far from zero mean and unit variance, so the statistics move visibly
    return [(2.0 + 3.0 * torch.randn(BATCH, 3, 6, 6, generator=gen),
             torch.randint(0, 5, (BATCH,), generator=gen)) for _ in range(count)]


def _compile(model: nn.Module, replicas: list[int], schedule: str) -> pdcompile.pipeline.Pipeline:
    plan = manual_plan(trace(model), {"conv2": 1}, replicas=replicas)
    x = _batches(1)[0][0]
    return pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                             schedule=schedule, microbatches=MICRO, plan=plan)


def _replicated_stage(pipe: pdcompile.pipeline.Pipeline) -> tuple[int, str]:
    """The replicated stage and the name (in the model) of its BatchNorm."""
    (stage,) = [s for s, st in enumerate(pipe.plan.stages) if len(st.ranks) > 1]
    return stage, f"bn{stage + 1}"


def _buffers(pipe: pdcompile.pipeline.Pipeline, rank: int) -> dict[str, torch.Tensor]:
    """A rank's buffers under the model's names."""
    state = pipe.ranks[rank]
    program = pipe.parts.stages[state.stage]
    buffers = dict(state.module.named_buffers())
    return {original: buffers[name] for name, originals in program.buffer_names.items()
            for original in originals}


def _train(pipe: pdcompile.pipeline.Pipeline, schedule: str) -> int:
    """Train a few minibatches; the number of microbatches every BatchNorm has seen in all."""
    if schedule == "1f1b":  # one microbatch per minibatch, a multiple of the replica count
        batches = [(x[:BATCH // MICRO], y[:BATCH // MICRO]) for x, y in _batches(2 * STEPS)]
        pipe.train(batches)
        return len(batches)
    batches = _batches(STEPS)
    pipe.train(batches)
    return STEPS * MICRO


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe", "1f1b", "2bw"])
@pytest.mark.parametrize("replicas", LAYOUTS, ids=str)
def test_replicas_hold_equal_buffers_with_the_single_process_count(
        replicas: list[int], schedule: str) -> None:
    pipe = _compile(_model(), replicas, schedule)
    seen = _train(pipe, schedule)
    stage, bn = _replicated_stage(pipe)
    first, *others = [_buffers(pipe, r) for r in pipe.plan.stages[stage].ranks]
    assert f"{bn}.running_mean" in first
    for other in others:
        assert other.keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(other[name], value), name
    for rank in pipe.ranks:  # every BatchNorm, replicated or not, counted every microbatch
        for name, value in _buffers(pipe, rank).items():
            if name.endswith("num_batches_tracked"):
                assert int(value) == seen, name
    assert not torch.equal(first[f"{bn}.running_mean"], torch.zeros(4))  # statistics did move


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
@pytest.mark.parametrize("replicas", LAYOUTS, ids=str)
def test_one_flush_step_averages_the_replicas_statistics(replicas: list[int],
                                                         schedule: str) -> None:
    model = _model()
    pipe = _compile(model, replicas, schedule)
    (x, y), = _batches(1)
    pipe.step(x, target=y)
    stage, bn = _replicated_stage(pipe)
    r = replicas[stage]
    # independent reference: replica j's own copy of the model runs microbatches m with
    # m % r == j (the weights before the update, as in the step's forwards), then the average
    copies = [copy.deepcopy(model) for _ in range(r)]
    for m, xs in enumerate(x.chunk(MICRO)):
        copies[m % r](xs)
    norms = [dict(c.named_modules())[bn] for c in copies]
    want_mean = torch.stack([n.running_mean for n in norms]).mean(0)
    want_var = torch.stack([n.running_var for n in norms]).mean(0)
    for rank in pipe.plan.stages[stage].ranks:
        got = _buffers(pipe, rank)
        torch.testing.assert_close(got[f"{bn}.running_mean"], want_mean)
        torch.testing.assert_close(got[f"{bn}.running_var"], want_var)
        assert int(got[f"{bn}.num_batches_tracked"]) == MICRO


@pytest.mark.parametrize("replicas", LAYOUTS, ids=str)
def test_the_statistics_advance_as_many_momentum_steps_as_one_replica_takes(
        replicas: list[int]) -> None:
    """The defined difference from single-process training: each replica's running average
    takes M / r momentum steps per update, single-process training M. With M equal microbatches
    the replicas' mean is exactly single-process training after M / r of them (the batch count
    is still M)."""
    model = _model()
    pipe = _compile(model, replicas, "1f1b-flush")
    x, y = _batches(1)[0]
    same = x[:BATCH // MICRO].repeat(MICRO, 1, 1, 1)
    pipe.step(same, target=y)
    stage, bn = _replicated_stage(pipe)
    single = copy.deepcopy(model)
    for _ in range(MICRO // replicas[stage]):
        single(same[:BATCH // MICRO])
    norm = dict(single.named_modules())[bn]
    got = _buffers(pipe, pipe.plan.stages[stage].ranks[0])
    torch.testing.assert_close(got[f"{bn}.running_mean"], norm.running_mean)
    torch.testing.assert_close(got[f"{bn}.running_var"], norm.running_var)
    assert int(got[f"{bn}.num_batches_tracked"]) == MICRO


@pytest.mark.parametrize("replicas", LAYOUTS, ids=str)
def test_a_call_outside_training_reaches_every_replica(replicas: list[int]) -> None:
    """Calling the pipeline runs replica 0 (in training mode it updates its statistics, as
    calling the model does); the next update gives every replica replica 0's values as the base."""
    model = _model()
    pipe = _compile(model, replicas, "gpipe")
    x, y = _batches(1)[0]
    with torch.no_grad():
        pipe(x)
        model(x)
    stage, bn = _replicated_stage(pipe)
    ranks = pipe.plan.stages[stage].ranks
    assert int(_buffers(pipe, ranks[0])[f"{bn}.num_batches_tracked"]) == 1
    assert int(_buffers(pipe, ranks[1])[f"{bn}.num_batches_tracked"]) == 0
    pipe.step(x, target=y)
    first, second = (_buffers(pipe, r) for r in ranks)
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    assert int(first[f"{bn}.num_batches_tracked"]) == 1 + MICRO
    # close to replicas that all started from the called model: not equal, since replica 1's
    # changes were measured from its own older statistics (a running average's change depends
    # on where it starts)
    copies = [copy.deepcopy(model) for _ in range(replicas[stage])]
    for m, xs in enumerate(x.chunk(MICRO)):
        copies[m % len(copies)](xs)
    norms = [dict(c.named_modules())[bn] for c in copies]
    torch.testing.assert_close(first[f"{bn}.running_mean"],
                               torch.stack([n.running_mean for n in norms]).mean(0),
                               rtol=0.05, atol=0.01)
    torch.testing.assert_close(first[f"{bn}.running_var"],
                               torch.stack([n.running_var for n in norms]).mean(0),
                               rtol=0.05, atol=0.01)


class WithConstant(ConvBN):
    """ConvBN whose output is at least a constant buffer (with -inf and a negative zero)."""

    offset: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor([-torch.inf, -0.0, 1 / 3, 0.1, 1e-8]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(super().forward(x), self.offset)


def test_three_replicas_leave_a_constant_buffer_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = WithConstant()
    pipe = _compile(model, [1, 3], "1f1b-flush")
    x, y = _batches(1)[0]
    pipe.train([(x, y)] * 2)  # 3 replicas, 4 microbatches: replica 0 gets two of them
    for rank in pipe.plan.stages[1].ranks:
        got = _buffers(pipe, rank)
        assert torch.equal(got["offset"], model.offset)
        assert torch.equal(got["offset"].signbit(), model.offset.signbit())
        assert int(got["bn2.num_batches_tracked"]) == 2 * MICRO


def test_an_unreplicated_pipeline_keeps_no_copies() -> None:
    pipe = _compile(_model(), [1, 1], "1f1b-flush")
    x, y = _batches(1)[0]
    pipe.step(x, target=y)
    assert all(not rt._sync_groups for rt in pipe.last_runtimes.values())


@pytest.mark.parametrize("replicas", [[1, 2, 1], [2, 2, 2]], ids=str)
def test_tied_gradients_and_buffers_in_one_step(replicas: list[int]) -> None:
    """A step that all-reduces tied gradients (stages 0 and 2) and the buffers of stage 1."""
    torch.manual_seed(0)
    model = TiedBN()
    plan = manual_plan(trace(model), {"proj": 1, "head": 2}, replicas=replicas)
    gen = torch.Generator().manual_seed(2)
    idx, y = torch.randint(0, 20, (8, 3), generator=gen), torch.randint(0, 20, (8,), generator=gen)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(idx,),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), schedule="gpipe",
                             microbatches=MICRO, plan=plan)
    for _ in range(STEPS):
        pipe.step(idx, target=y)
    first, second = (_buffers(pipe, r) for r in pipe.plan.stages[1].ranks)
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    assert int(first["bn.num_batches_tracked"]) == STEPS * MICRO
    (tie,) = pipe.parts.ties
    copies = [pipe.ranks[r].module.get_parameter(name)
              for s, name in tie.members for r in pipe.plan.stages[s].ranks]
    for copy_ in copies[1:]:
        assert torch.equal(copy_, copies[0])
