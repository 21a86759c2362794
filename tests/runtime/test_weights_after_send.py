"""Under schedules that do not split B and W, a stage that sends input gradients upstream
computes its Linear layers' weight gradients after that send (runtime/stage_runtime.py): the
previous stage waits for the message, not for them. The trained weights equal ordinary training
(tests/pipeline/test_schedules_transparency.py); here: that the gradients really come after the
send, that they are all there at the update, and that the recorded backward spans its sends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.passes.split import even_plan
from pdcompile.passes.trace import trace
from pdcompile.runtime.local_transport import LocalTransport
from pdcompile.schedule.ir import Kind


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 3))


def _pipeline(schedule: str, stages: int) -> Any:
    model = _mlp()
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 6),),
                             loss_fn=nn.functional.cross_entropy, schedule=schedule,
                             microbatches=None if schedule == "1f1b" else 4,
                             plan=even_plan(trace(model), stages))


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush", "gpipe"])
def test_weight_gradients_follow_the_input_gradient_send(schedule: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = _pipeline(schedule, 2)
    last = dict(pipe.stage_modules[1].named_parameters())
    at_send: list[tuple[int, dict[str, torch.Tensor | None]]] = []
    send = LocalTransport.send

    def spy(self: LocalTransport, tensors: Any, dst_rank: int, tag: Any) -> Any:
        if tag.kind == "grad":  # stage 1's gradients as its message to stage 0 leaves
            at_send.append((tag.microbatch, {n: None if p.grad is None else p.grad.clone()
                                             for n, p in last.items()}))
        return send(self, tensors, dst_rank, tag)

    monkeypatch.setattr(LocalTransport, "send", spy)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    pipe.step(x, target=y)
    micro = 1 if schedule == "1f1b" else 4
    assert len(at_send) == micro
    # plain training, microbatch by microbatch in the order of the backwards: each message
    # leaves with the gradients of the microbatches backpropagated before it, none of its own
    reference = _mlp()
    parts = list(zip(x.chunk(micro), y.chunk(micro), strict=True))
    for m, grads in at_send:
        xs, ys = parts[m]
        for name, grad in grads.items():
            before = reference.get_parameter(name).grad
            if before is None:
                assert grad is None, (m, name)
            else:
                assert grad is not None, (m, name)
                torch.testing.assert_close(grad, before, msg=f"microbatch {m}, {name}")
        (nn.functional.cross_entropy(reference(xs), ys) / micro).backward()


def test_the_recorded_backward_spans_its_sends_and_the_run_follows_the_schedule() -> None:
    pipe = _pipeline("1f1b-flush", 3).timed()
    gen = torch.Generator().manual_seed(1)
    pipe.step(torch.randn(8, 6, generator=gen), target=torch.randint(0, 3, (8,), generator=gen))
    timeline = pipe.last_timeline
    assert timeline is not None
    timeline.check_schedule(pipe.schedule())
    events = {(e.rank, e.action): e for e in timeline.events}
    for rank in (1, 2):  # the stages that send gradients upstream
        for m in range(4):
            b = events[rank, f"{rank}B{m}"]
            sends = [e for (r, a), e in events.items() if r == rank and a.startswith(
                f"{rank}{Kind.SEND_B.value}{m}")]
            assert sends and all(b.start <= s.start and s.end <= b.end for s in sends)
