"""Generated rank loops over torch.distributed reproduce ordinary training (flush schedules).

1F1B-flush and GPipe accumulate the gradients of a minibatch's microbatches and update once, so
their losses and final weights must equal plain single-process training with the same seeds, to
float rounding, whatever the number of processes and replicas. With BatchNorm on a replicated
stage, the buffers (synchronised over the replicas at every update) equal the local backend's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.fx import Node

from pdcompile.backends.launch import Worker, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WIDTH, MB, MICRO, STEPS, LR = 16, 8, 4, 2, 0.1


def _model(bn: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    if bn:  # Linear 0, BatchNorm 1, ReLU 2, Linear 3, BatchNorm 4, ReLU 5, Linear 6
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(),
                             nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(),
                             nn.Linear(WIDTH, 3))
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


def _stage_of(cuts: tuple[int, ...]) -> Callable[[Node], int]:
    def stage_of(node: Node) -> int:
        if node.op != "call_module":
            return 0
        return sum(int(str(node.target)) >= cut for cut in cuts)
    return stage_of


def _worker(worker: Worker, schedule: str, cuts: tuple[int, ...], replicas: tuple[int, ...],
            bn: bool = False
            ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from pdcompile.backends.distributed import DistributedTransport, drive, expect_schedule
    from pdcompile.passes.codegen import generate_rank, load_rank
    from pdcompile.passes.split import manual_plan, split
    from pdcompile.passes.trace import trace
    from pdcompile.runtime.stage_runtime import RunConfig, StageRuntime
    from pdcompile.runtime.transport import Tag, TensorSpec
    from pdcompile.schedule.generators import generate
    from pdcompile.schedule.lower import lower

    model = _model(bn)
    gm = trace(model)
    plan = manual_plan(gm, _stage_of(cuts), replicas=replicas)
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
    buffers = {model_name: b.detach().clone()
               for name, b in program.module.named_buffers()
               for model_name in program.buffer_names.get(name, (name,))}
    return losses, weights, buffers


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
    for _, w, _ in outcomes:
        for key, value in w.items():
            if key in weights:  # replicas of one stage must hold identical weights
                torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
            weights[key] = value
    assert sorted(weights) == sorted(ref_params)
    for name, want in ref_params.items():
        torch.testing.assert_close(weights[name], want)


def test_replicated_batchnorm_buffers_match_the_local_backend() -> None:
    """Stage 1 (Linear, BatchNorm, ReLU, Linear) on two replicas: after two updates the
    replicas' buffers are identical and equal the local backend's (which tests/
    test_replica_buffers.py checks against a reference), and so do losses and weights."""
    import pdcompile
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace

    cuts, replicas = (3,), (1, 2)
    outcomes = launch(_worker, sum(replicas), args=("1f1b-flush", cuts, replicas, True),
                      timeout=150)
    model = _model(bn=True)
    pipe = pdcompile.compile(
        _model(bn=True), example_inputs=(_data()[0][0],), loss_fn=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=LR), schedule="1f1b-flush",
        microbatches=MICRO, plan=manual_plan(trace(model), _stage_of(cuts), replicas=replicas))
    local_losses = pipe.train(_data())
    torch.testing.assert_close(
        torch.tensor([sum(v) / MICRO for v in zip(*(outcomes[r][0] for r in (1, 2)),
                                                  strict=True)]),
        torch.tensor(local_losses))
    for rank, (_, weights, buffers) in enumerate(outcomes):
        state = pipe.ranks[rank]
        program = pipe.parts.stages[state.stage]
        local = {original: b for name, b in state.module.named_buffers()
                 for original in program.buffer_names.get(name, (name,))}
        assert sorted(buffers) == sorted(local) and buffers
        for name, value in buffers.items():
            torch.testing.assert_close(value, local[name], msg=lambda m, n=name: f"{n}: {m}")
        params = pipe.named_parameters()
        for name, value in weights.items():
            torch.testing.assert_close(value, params[name].detach())
    for name, value in outcomes[1][2].items():  # the two replicas of stage 1
        assert torch.equal(outcomes[2][2][name], value), name
    assert int(outcomes[1][2]["4.num_batches_tracked"]) == STEPS * MICRO
    assert not torch.equal(outcomes[1][2]["4.running_mean"], torch.zeros(WIDTH))
