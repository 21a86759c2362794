"""Generated rank loops over torch.distributed reproduce ordinary training (flush schedules).

1F1B-flush and GPipe accumulate the gradients of a minibatch's microbatches and update once, so
their losses and final weights must equal plain single-process training with the same seeds, to
float rounding, whatever the number of processes and replicas.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.backends.launch import Worker, launch

pytestmark = pytest.mark.timeout(180)

WIDTH, MB, MICRO, STEPS, LR = 16, 8, 4, 2, 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(MB, WIDTH, generator=gen), torch.randint(0, 3, (MB,), generator=gen))
            for _ in range(STEPS)]


class _Data:
    def __init__(self, name: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.name = name
        self.xs, self.ys = batch[0].chunk(MICRO), batch[1].chunk(MICRO)

    def inputs(self, microbatch: int) -> dict[str, torch.Tensor]:
        return {self.name: self.xs[microbatch]}

    def target(self, microbatch: int) -> torch.Tensor:
        return self.ys[microbatch]


def _worker(worker: Worker, schedule: str, cuts: tuple[int, ...],
            replicas: tuple[int, ...]) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.fx import Node

    from pdcompile.backends.distributed import DistributedTransport, drive, expect_schedule
    from pdcompile.passes.codegen import generate_rank, load_rank
    from pdcompile.passes.lower import lower
    from pdcompile.passes.schedule import generate
    from pdcompile.passes.split import manual_plan, split
    from pdcompile.passes.trace import trace
    from pdcompile.runtime.stage_runtime import RunConfig, StageRuntime
    from pdcompile.runtime.transport import Tag, TensorSpec

    model = _model()
    gm = trace(model)

    def stage_of(node: Node) -> int:
        if node.op != "call_module":
            return 0
        return sum(int(str(node.target)) >= cut for cut in cuts)

    plan = manual_plan(gm, stage_of, replicas=replicas)
    result = split(gm, plan, model=model)
    stage_ranks = tuple(tuple(s.ranks) for s in plan.stages)
    stage = next(i for i, ranks in enumerate(stage_ranks) if worker.rank in ranks)
    program = result.stages[stage]
    lowered = lower(generate(schedule, stage_ranks, MICRO), result.edges)
    run_rank = load_rank(generate_rank(lowered, worker.rank))
    optimizer = torch.optim.SGD(program.module.parameters(), lr=LR)
    transport = DistributedTransport(stage_ranks=stage_ranks, monitor=worker.monitor)

    def specs(tag: Tag) -> list[TensorSpec]:
        return [TensorSpec((MB // MICRO, WIDTH), torch.float32)]

    config = RunConfig(schedule, stage_ranks, microbatches_per_minibatch=MICRO)
    losses = []
    for batch in _data():
        runtime = StageRuntime(
            rank=worker.rank, io=program, module=program.module, optimizer=optimizer,
            config=config, transport=transport, data=_Data(result.data_inputs[0], batch),
            loss_fn=nn.functional.cross_entropy, output_refs=result.output_refs,
            output_spec=result.output_spec, specs=specs)
        expect_schedule(transport, lowered, worker.rank, specs)
        drive(run_rank(runtime), transport)
        runtime.finish()
        losses.append(sum(float(v) for v in runtime.losses.values()))
    weights = {model_name: p.detach().clone()
               for name, p in program.module.named_parameters()
               for model_name in program.param_names.get(name, (name,))}
    return losses, weights


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
            loss = nn.functional.cross_entropy(model(xs), ys)
            (loss / MICRO).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("schedule", "cuts", "replicas"), [
    ("1f1b-flush", (4,), (1, 1)),          # 2 processes
    ("gpipe", (2, 4), (1, 1, 1)),          # 3 processes
    ("1f1b-flush", (2, 4), (1, 2, 1)),     # 4 processes, stage 1 replicated
])
def test_flush_schedules_match_plain_training(schedule: str, cuts: tuple[int, ...],
                                              replicas: tuple[int, ...]) -> None:
    outcomes = launch(_worker, sum(replicas), args=(schedule, cuts, replicas), timeout=150)
    ref_losses, ref_params = _reference()
    # the last stage's ranks hold the losses (summed over their microbatches)
    last = [r for r in range(sum(replicas)) if r >= sum(replicas) - replicas[-1]]
    losses = [sum(vals) for vals in zip(*(outcomes[r][0] for r in last), strict=True)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    weights: dict[str, torch.Tensor] = {}
    for _, w in outcomes:
        for key, value in w.items():
            if key in weights:  # replicas of one stage must hold identical weights
                torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
            weights[key] = value
    assert sorted(weights) == sorted(ref_params)
    for name, want in ref_params.items():
        torch.testing.assert_close(weights[name], want)
