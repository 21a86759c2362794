"""The checks only a GPU can make, in one run (for a session lent one; CI has none).

    python benchmarks/gpu.py [--device cuda] [--md FILE] [--quick]

1. equal: every schedule's pipeline on the GPU (local backend, 2 workers, stages made by
   `compile(stages=2)`) against one process on the GPU with the same microbatching: the
   largest relative loss difference over 3 minibatches and the largest relative weight
   difference after them (TF32 off, so both sides compute in float32).
   Weights are compared after the first minibatch, losses over 3.
2. cost: the measured cost pass on the GPU (per node, forward and backward: the larger of the
   kernels' execution, timed by CUDA events with the GPU held busy while they are queued, and
   the CPU's queueing; cost/timers.py) against the whole model's forward + backward timed the
   same way in the same run, beside the same with CUDA events alone (the timer before), and the analytic
   cost pass on the `h100` device model against the same measurement, for VGG-16, ResNet-50
   (paper sizes, 224x224) and GPT-2 small.
3. overhead: samples/s of plain training against our pipeline's local backend (all stages in
   this process) at the same microbatching, for a launch-bound MLP and VGG-16 at batch 64: what
   the runtime's per-action Python costs where the compute is fast.
4. nccl: two processes with NCCL on this one GPU (a pipeline's two ranks): what NCCL says.

Each section catches its own failure and prints it, so one broken part leaves the others' rows.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCHEDULES = ("1f1b-flush", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipev")
MICRO = 4
LR = 0.05


def _mlp(device: str, width: int = 512, depth: int = 8, batch: int = 64
         ) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).to(device), (torch.randn(batch, width, device=device),)


def _vgg(device: str, batch: int = 32, size: int = 32, width: int = 8
         ) -> tuple[nn.Module, tuple[torch.Tensor]]:
    from pdcompile.models import vgg16

    torch.manual_seed(0)
    model, inputs = vgg16.factory(batch_size=batch, image_size=size, width=width, device=device)
    for module in model.modules():  # dropout draws differ between the two sides' orders
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, inputs


def _resnet(device: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    from pdcompile.models import resnet50

    torch.manual_seed(0)
    return resnet50.factory(batch_size=16, image_size=32, width=8, blocks=(1, 1, 1, 1),
                            device=device)


def _one_process(model: nn.Module, optimizer: torch.optim.Optimizer,
                 inputs: tuple[torch.Tensor, ...], target: torch.Tensor, steps: int
                 ) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for part in zip(*(t.chunk(MICRO) for t in inputs), target.chunk(MICRO), strict=True):
            loss = F.cross_entropy(model(*part[:-1]), part[-1])
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        optimizer.step()
        losses.append(total)
    return losses


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _failed_row(err: Exception, *cells: str, blanks: int) -> str:
    """A table row for a case that raised (its traceback printed): the cells, the error's first
    line, then `blanks` empty cells; one broken case leaves the others' rows."""
    traceback.print_exc()
    first = str(err).splitlines()[0][:160] if str(err) else ""
    return "| " + " | ".join(cells) + f" | FAILED: {type(err).__name__}: {first} |" + \
        " |" * blanks


def equal_section(device: str) -> list[str]:
    import pdcompile

    rows = ["| model | schedule | max loss rel. diff | max weight rel. diff | verdict |",
            "|---|---|---|---|---|"]
    cases = [(name, make, "analytic", SCHEDULES) for name, make in
             (("mlp", _mlp), ("vgg16-small", _vgg), ("resnet50-small", _resnet))]
    cases.append(("vgg16-small, measured costs", _vgg, "measured", ("1f1b-flush", "zb-v")))
    for name, make, cost, schedules in cases:
        for schedule in schedules:
            try:
                model, inputs = make(device)
                target = torch.randint(0, 10, (inputs[0].shape[0],), device=device)
                reference = copy.deepcopy(model)
                pipe = pdcompile.compile(
                    model, example_inputs=inputs, loss_fn=F.cross_entropy, stages=2,
                    optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                    schedule=schedule, microbatches=MICRO, cost=cost)
                # weights after the first update (later ones amplify the rounding of a
                # different summation order: GPipe's backwards run in reverse, and a one-process
                # loop summing in that order differs from the in-order one as much); losses of 3
                optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
                ours = [pipe.step(*inputs, target=target)]
                theirs = _one_process(reference, optimizer, inputs, target, 1)
                state = pipe.state_dict()
                weights = dict(reference.named_parameters())
                weight_diff = max(_relative(state[k].to(device), weights[k]) for k in weights)
                ours += [pipe.step(*inputs, target=target) for _ in range(2)]
                theirs += _one_process(reference, optimizer, inputs, target, 2)
                loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))
                devices = {t.device.type for t in state.values()}
                ok = loss_diff < 1e-4 and weight_diff < 1e-4 and devices == {"cuda"} \
                    if device == "cuda" else loss_diff < 1e-4 and weight_diff < 1e-4
                rows.append(f"| {name} | {schedule} | {loss_diff:.1e} | {weight_diff:.1e} | "
                            f"{'equal' if ok else 'DIFFERS'} (weights on {sorted(devices)}) |")
            except Exception as err:  # noqa: BLE001 - a row per failure, the rest still run
                rows.append(_failed_row(err, name, schedule, "-", "-", blanks=0))
            print(rows[-1], flush=True)
    return rows


def cost_section(device: str, quick: bool) -> list[str]:
    from pdcompile.cost.node_costs import annotate_costs, measure_model, total_cost
    from pdcompile.models import gpt2, resnet50, vgg16
    from pdcompile.passes.trace import trace

    cases: list[tuple[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]]] = [
        ("vgg16 b64 224", lambda: vgg16.factory(batch_size=8 if quick else 64,
                                                image_size=64 if quick else 224, width=1,
                                                num_classes=1000, device=device)),
        ("resnet50 b64 224", lambda: resnet50.factory(batch_size=8 if quick else 64,
                                                      image_size=64 if quick else 224, width=1,
                                                      num_classes=1000, device=device)),
        ("gpt2-small b8 s512", lambda: gpt2.factory(size="small", batch_size=2 if quick else 8,
                                                    seq_len=64 if quick else 512, dropout=0.0,
                                                    device=device)),
    ]
    from pdcompile.cost.timers import CudaEventTimer

    def events_alone() -> Any:  # the timer before cost/busy_wait.py: no hold, events only
        return CudaEventTimer(hold=lambda seconds: None) if device == "cuda" else None

    rows = ["| model | nodes | node sum fwd+bwd ms | whole fwd+bwd ms | sum / whole | "
            "before: sum / whole (events alone) | analytic h100 ms | analytic / measured | "
            "cost pass s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, make in cases:
        try:
            torch.manual_seed(0)
            model, inputs = make()
            gm = trace(model)
            start = time.perf_counter()
            total = total_cost(annotate_costs(gm, inputs, warmup=3, repeats=9))
            seconds = time.perf_counter() - start
            fwd, bwd = measure_model(model, inputs, warmup=3, repeats=19)
            old = total_cost(annotate_costs(trace(model), inputs, warmup=3, repeats=9,
                                            timer=events_alone()))
            old_fwd, old_bwd = measure_model(model, inputs, warmup=3, repeats=19,
                                             timer=events_alone())
            analytic = total_cost(annotate_costs(trace(model), inputs, source="analytic",
                                                 device="h100"))
            whole = fwd + bwd
            rows.append(f"| {name} | {len(gm.graph.nodes)} | {(total.fwd + total.bwd) * 1e3:.2f} | "
                        f"{whole * 1e3:.2f} | {(total.fwd + total.bwd) / whole:.2f} | "
                        f"{(old.fwd + old.bwd) / (old_fwd + old_bwd):.2f} | "
                        f"{(analytic.fwd + analytic.bwd) * 1e3:.2f} | "
                        f"{(analytic.fwd + analytic.bwd) / whole:.2f} | {seconds:.1f} |")
        except Exception as err:  # noqa: BLE001
            rows.append(_failed_row(err, name, blanks=7))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def diagnose_section(device: str, quick: bool) -> list[str]:
    """Where the cost pass and the whole model part on the GPU: forward and backward sums of
    the nodes and the whole model's, under the timer (max of held GPU time and CPU queueing),
    its two parts alone, CUDA events alone (the timer before), and the timer with cold caches."""
    from pdcompile.cost.node_costs import annotate_costs, measure_model, total_cost
    from pdcompile.cost.timers import CudaEventTimer
    from pdcompile.models import gpt2, resnet50
    from pdcompile.passes.trace import trace

    class Part(CudaEventTimer):
        """One part of the timer's reading: "gpu" (held events) or "host" (queueing)."""

        def __init__(self, part: str) -> None:
            super().__init__()
            self.part = part

        def time(self, fn: Callable[[], Any]) -> float:
            gpu, host = self.readings(fn)
            return host if self.part == "host" else gpu

    timers: dict[str, Callable[[], Any]] = {
        "max (now)": lambda: None, "gpu held": lambda: Part("gpu"),
        "host": lambda: Part("host"), "events alone": lambda: CudaEventTimer(hold=lambda s: None)}
    cases = [("resnet50 b64 224", lambda: resnet50.factory(
                 batch_size=8 if quick else 64, image_size=64 if quick else 224, width=1,
                 num_classes=1000, device=device)),
             ("gpt2-small b8 s512", lambda: gpt2.factory(
                 size="small", batch_size=2 if quick else 8, seq_len=64 if quick else 512,
                 dropout=0.0, device=device))]
    rows = ["| model | timer | caches | nodes fwd ms | nodes bwd ms | whole fwd ms | "
            "whole bwd ms | sum / whole |", "|---|---|---|---|---|---|---|---|"]
    for name, make in cases:
        torch.manual_seed(0)
        model, inputs = make()
        combos = [(t, "warm") for t in timers] + [("max (now)", "cold")]
        for label, caches in combos:
            try:
                nodes = total_cost(annotate_costs(trace(model), inputs, warmup=3, repeats=9,
                                                  timer=timers[label](), caches=caches))
                fwd, bwd = measure_model(model, inputs, warmup=3, repeats=19,
                                         timer=timers[label]())
                rows.append(f"| {name} | {label} | {caches} | {nodes.fwd * 1e3:.2f} | "
                            f"{nodes.bwd * 1e3:.2f} | {fwd * 1e3:.2f} | {bwd * 1e3:.2f} | "
                            f"{(nodes.fwd + nodes.bwd) / (fwd + bwd):.2f} |")
            except Exception as err:  # noqa: BLE001
                rows.append(_failed_row(err, name, label, caches, blanks=4))
            print(rows[-1], flush=True)
    return rows


def _rate(step: Callable[[], Any], samples: int, device: str, seconds: float = 3.0) -> float:
    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return samples * count / (time.perf_counter() - start)


def overhead_section(device: str, quick: bool) -> list[str]:
    import pdcompile

    rows = ["| model | schedule | plain samples/s | ours samples/s | ours / plain |",
            "|---|---|---|---|---|"]
    cases = [("mlp 8x512 b64", lambda: _mlp(device)),
             ("vgg16 b64 224" if not quick else "vgg16 b8 64",
              lambda: _vgg(device, batch=8 if quick else 64, size=64 if quick else 224,
                           width=1))]
    for name, make in cases:
        for schedule in ("1f1b-flush", "zb-h1"):
            try:
                model, inputs = make()
                target = torch.randint(0, 10, (inputs[0].shape[0],), device=device)
                reference = copy.deepcopy(model)
                optimizer = torch.optim.SGD(reference.parameters(), lr=LR)

                def plain() -> None:
                    optimizer.zero_grad()
                    for x, y in zip(inputs[0].chunk(MICRO), target.chunk(MICRO), strict=True):
                        (F.cross_entropy(reference(x), y) / MICRO).backward()
                    optimizer.step()

                pipe = pdcompile.compile(
                    model, example_inputs=inputs, loss_fn=F.cross_entropy, stages=2,
                    optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                    schedule=schedule, microbatches=MICRO, cost="analytic")
                samples = inputs[0].shape[0]
                rates = {"plain": [], "ours": []}
                for _ in range(3):  # alternate, so a drift hits both
                    rates["plain"].append(_rate(plain, samples, device, 1.0 if quick else 1.5))
                    rates["ours"].append(_rate(lambda: pipe.step(*inputs, target=target),
                                               samples, device, 1.0 if quick else 1.5))
                p, o = statistics.median(rates["plain"]), statistics.median(rates["ours"])
                rows.append(f"| {name} | {schedule} | {p:.0f} | {o:.0f} | {o / p:.2f} |")
            except Exception as err:  # noqa: BLE001
                rows.append(_failed_row(err, name, schedule, blanks=2))
            print(rows[-1], flush=True)
    return rows


def _nccl_rank(worker: Any, device: str) -> float:
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    tensor = torch.full((4,), float(worker.rank + 1), device=device)
    dist.all_reduce(tensor)
    if worker.rank == 0:
        dist.send(tensor, 1)
    else:
        dist.recv(tensor, 0)
    torch.cuda.synchronize()
    return float(tensor[0])


def nccl_section() -> list[str]:
    from pdcompile.backends.launch import launch

    try:
        values = launch(_nccl_rank, 2, args=("cuda:0",), backend="nccl", timeout=60.0)
        return [f"two NCCL ranks on one GPU: ran (values {values})"]
    except Exception as err:  # noqa: BLE001
        text = " ".join(str(err).split())[:400]
        return [f"two NCCL ranks on one GPU: {type(err).__name__}: {text}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--md", default="")
    parser.add_argument("--quick", action="store_true", help="small sizes (a check of the script)")
    parser.add_argument("--only", default="equal,cost,overhead,nccl")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    lines = [f"# GPU checks ({name})", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
             f"`python benchmarks/gpu.py`; TF32 off.", ""]
    sections = {"equal": lambda: equal_section(args.device),
                "cost": lambda: cost_section(args.device, args.quick),
                "overhead": lambda: overhead_section(args.device, args.quick),
                "diagnose": lambda: diagnose_section(args.device, args.quick),
                "nccl": nccl_section}
    for key in args.only.split(","):
        start = time.perf_counter()
        lines += [f"## {key}", "", *sections[key](), "",
                  f"({time.perf_counter() - start:.0f} s)", ""]
        print(f"-- {key} done in {time.perf_counter() - start:.0f} s", flush=True)
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
