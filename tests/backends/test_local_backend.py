"""The local backend: deterministic interleaving, mailboxes, deadlock reports, measured
timelines, and the Pipeline surface around it (planner, optimizers, LR schedulers, errors)."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.backends.local import run_local
from pdcompile.errors import PipelineInputError, PlanError, ScheduleError
from pdcompile.runtime.local_transport import LocalTransport, Mailboxes
from pdcompile.runtime.transport import Tag
from pdcompile.schedule.ir import parse_action

mse = nn.functional.mse_loss


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]


class Counter:
    def __init__(self) -> None:
        self.completed = 0


def test_deadlock_is_reported_not_hung() -> None:
    boxes = Mailboxes()
    transports = {r: LocalTransport(r, boxes) for r in (0, 1)}

    def program(rt: Counter, rank: int) -> Generator[Any, None, None]:
        pending = transports[rank].recv([], 1 - rank, Tag("act", 1 - rank, rank, 0))
        while not pending.ready():
            yield pending

    counters = {0: Counter(), 1: Counter()}
    with pytest.raises(ScheduleError, match="deadlock.*rank 0.*rank 1"):
        run_local({r: (lambda rt, r=r: program(rt, r)) for r in (0, 1)}, counters)


def test_mailboxes_and_all_reduce() -> None:
    boxes = Mailboxes()
    a, b, c = (LocalTransport(r, boxes) for r in (0, 1, 2))
    tag = Tag("act", 0, 1, 3)
    sent = torch.ones(2)
    a.send([sent], 1, tag)
    sent.add_(1)  # the message is a copy
    got = b.recv([], 0, tag)
    assert got.ready() and torch.equal(got.wait()[0], torch.ones(2))
    x, y, z = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])
    first = a.all_reduce([x], [0, 1, 2])
    second = b.all_reduce([y], [0, 1, 2])
    assert not first.ready()
    c.all_reduce([z], [2, 1, 0])
    assert first.ready() and second.ready()
    assert x.item() == y.item() == z.item() == 7.0
    assert boxes.pending() == []


def test_measured_timeline_covers_every_action() -> None:
    pipe = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse, plan=3,
                             schedule="1f1b").timed()
    pipe.train(data(6))
    timeline = pipe.last_timeline
    assert timeline is not None and timeline.source == "measured"
    schedule = pipe.schedule(6)
    for rank, events in timeline.by_rank().items():
        assert [e.action for e in events] == [str(a) for a in schedule.actions[rank]]
        assert all(e.end >= e.start for e in events)
        assert all(parse_action(e.action).stage == schedule.stage_of_rank(rank) for e in events)


def test_interleaving_is_deterministic() -> None:
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        pipe = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse,
                                 plan=[1, 2], schedule="1f1b")
        runs.append((pipe.train(data(4)), pipe.state_dict()))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[0][1].items():
        assert torch.equal(value, runs[1][1][name])


def reference_steps(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                    micro: int, make_opt: Any, make_sched: Any = None) -> list[float]:
    opt = make_opt(list(model.parameters()))
    sched = make_sched(opt) if make_sched else None
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = mse(model(xc), yc)
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return losses


def test_lr_scheduler_and_adam_keep_working() -> None:
    model = mlp()

    def adam(p: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=0.05)

    def halve(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(torch.randn(8, 6),),
                             loss_fn=mse, plan=[1, 2, 1], schedule="1f1b-flush", microbatches=4,
                             optimizer=adam)
    schedulers = pipe.lr_scheduler(halve)
    batches = data(3)
    losses = []
    for x, y in batches:
        losses.append(pipe.step(x, target=y))
        schedulers.step()
    assert len(pipe.optimizers) == 4
    assert all(o.param_groups[0]["lr"] == pytest.approx(0.05 / 8) for o in pipe.optimizers)
    expected = reference_steps(model, batches, 4, adam, halve)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value)


def test_compile_with_the_planner() -> None:
    model = mlp()
    pipe = pdcompile.compile(copy.deepcopy(model), "local-2", example_inputs=(torch.randn(8, 6),),
                             loss_fn=mse, schedule="gpipe", microbatches=2, cost="analytic",
                             planner="dp")
    assert pipe.plan.workers <= 2 and pipe.plan.planner != "manual"
    assert all("pd.stage" in n.meta for n in pipe.graph.graph.nodes)
    batches = data(2)
    losses = pipe.train(batches)
    expected = reference_steps(model, batches, 2, lambda p: torch.optim.SGD(p, lr=0.01))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    assert "schedule gpipe" in pipe.summary()


def test_data_parallel_plan_equals_accumulation() -> None:
    model = mlp()
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(torch.randn(8, 6),),
                             loss_fn=mse, plan=[2], schedule="1f1b-flush", microbatches=4)
    batches = data(2)
    losses = pipe.train(batches)
    expected = reference_steps(model, batches, 4, lambda p: torch.optim.SGD(p, lr=0.01))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))


def test_user_errors_name_the_fix() -> None:
    pipe = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse, plan=2,
                             schedule="1f1b-flush", microbatches=3)
    # 8 samples in 3 microbatches (3, 3, 2) train; 2 samples cannot make 3
    assert pipe.step(torch.randn(8, 6), target=torch.randn(8, 3)) > 0
    with pytest.raises(PipelineInputError, match="batch size 2, too small to cut into 3 "
                                                 "microbatches"):
        pipe.step(torch.randn(2, 6), target=torch.randn(2, 3))
    # an empty minibatch: no advice to compile with fewer microbatches (once '1f1b' was told
    # to give "at least 1 samples, or compile with fewer microbatches")
    for schedule, micro in (("1f1b-flush", 3), ("1f1b", None)):
        empty = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse,
                                  plan=2, schedule=schedule, microbatches=micro)
        with pytest.raises(PipelineInputError, match=r"^minibatch 0: (input 'input_1'|the "
                           r"target) is empty \(batch size 0\); give it at least [13] "
                           r"samples?, or leave the empty minibatch out of the stream$"):
            empty.step(torch.randn(0, 6), target=torch.randn(0, 3))
    with pytest.raises(PipelineInputError, match=r"has 2 inputs but the pipeline takes 1 "
                                                 r"\(input_1\)"):
        pipe.step(torch.randn(9, 6), torch.randn(9, 6), target=torch.randn(9, 3))
    # '1f1b' over replicas (2-1): 3 minibatches train, the last in 2 pieces to end the round
    rr = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse,
                           plan=[2, 1], schedule="1f1b")
    assert len(rr.train(data(3))) == 3
    no_loss = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), plan=2,
                                schedule="gpipe", microbatches=2)
    with pytest.raises(PipelineInputError, match="loss_fn"):
        no_loss.step(torch.randn(8, 6), target=torch.randn(8, 3))
    with pytest.raises(PipelineInputError, match="vertical_sync"):
        pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse, plan=[2, 1],
                          vertical_sync=True)


@pytest.mark.parametrize(("plan", "options"), [([1, 2, 1], {"schedule": "1f1b"}),
                                               (3, {"schedule": "1f1b", "vertical_sync": True}),
                                               ([2, 1], {"schedule": "2bw", "microbatches": 2})])
def test_message_specs_match_what_is_sent(plan: Any, options: dict[str, Any]) -> None:
    """What a distributed backend needs: the shapes of every message ahead, and the pieces
    (prepare, run_config, runtime, rank_function) to run a rank itself."""
    pipe = pdcompile.compile(mlp(), example_inputs=(torch.randn(8, 6),), loss_fn=mse, plan=plan,
                             **options)
    batches = data(4)
    run = pipe.prepare(batches)
    specs = pipe.spec_function(batches[0][0])
    received: list[tuple[Any, Any]] = []

    class Checking(LocalTransport):
        def recv(self, specs_: Any, src_rank: int, tag: Tag) -> Any:
            pending = super().recv(specs_, src_rank, tag)
            received.append((specs_, pending))
            return pending

    boxes = Mailboxes()
    runtimes = {r: pipe.runtime(r, config=pipe.run_config(run.per_minibatch),
                                transport=Checking(r, boxes), data=run.data, specs=specs)
                for r in pipe.ranks}
    run_local({r: pipe.rank_function(r, run.microbatches, run.per_minibatch)
               for r in pipe.ranks}, runtimes)
    assert received
    for expected, pending in received:
        got = pending.wait()
        assert [(tuple(t.shape), t.dtype) for t in got] == [(s.shape, s.dtype) for s in expected]
    for group in pipe.collective_groups():
        assert len(group) > 1


def test_stage_without_parameters() -> None:
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace

    model = mlp()
    order = {"_0": 0, "_1": 1, "_2": 2}
    plan = manual_plan(trace(model), lambda n: order.get(n.name, 0 if n.op == "placeholder"
                                                             else 2))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(torch.randn(8, 6),),
                             loss_fn=mse, plan=plan, schedule="1f1b-flush", microbatches=2)
    assert list(pipe.stage_modules[1].parameters()) == []
    batches = data(2)
    expected = reference_steps(model, batches, 2, lambda p: torch.optim.SGD(p, lr=0.01))
    torch.testing.assert_close(torch.tensor(pipe.train(batches)), torch.tensor(expected))


@pytest.mark.slow
@pytest.mark.parametrize("plan", [3, [2, 1, 2]], ids=["3-stages", "replicated-ends"])
def test_1f1b_keeps_tied_embeddings_equal(plan: Any) -> None:
    """GPT-2's token embedding is tied to its output head across stages 0 and 2; under async
    1f1b every copy (on every replica) gets the same updates and stays equal. (Tied stages with
    different replica counts are refused: they would update at different rates.)"""
    from pdcompile.models import gpt2

    model, inputs = gpt2.factory(size="tiny", layers=2, d=16, heads=2, vocab_size=50, seq_len=6,
                                 batch_size=4, dropout=0.0)
    pipe = pdcompile.compile(model, example_inputs=inputs, loss_fn=gpt2.loss_fn, plan=plan,
                             schedule="1f1b",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    (tie,) = pipe.parts.ties
    assert tie.stages == (0, 2)
    copies = [pipe.ranks[rank].module.get_parameter(name)
              for stage, name in tie.members for rank in pipe.plan.stages[stage].ranks]
    assert len(copies) == (4 if isinstance(plan, list) else 2)
    assert len({id(c) for c in copies}) == len(copies)
    before = copies[0].detach().clone()
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 50, (4, 6), generator=g) for _ in range(12)]
    stream = [((x,), gpt2.make_target((x,), vocab_size=50)) for x in tokens]
    losses = pipe.train(stream[:6]) + pipe.train(stream[6:])
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.allclose(copies[0], before)
    for other in copies[1:]:
        torch.testing.assert_close(other, copies[0], rtol=0, atol=0)
    if isinstance(plan, list):
        with pytest.raises(PlanError, match="different replica counts"):
            pdcompile.compile(model, example_inputs=inputs, loss_fn=gpt2.loss_fn, plan=[2, 1, 1],
                              schedule="1f1b")
