"""timm architectures nobody here chose, compiled by the planner and trained against one process.

One architecture per timm family (the name up to its first digit or underscore), drawn at random
from the family's small variants (tiny, small, nano, ...; any where it has none), each in a
process of its own with a time limit: created untrained in float64 at its default input size,
dropout and stochastic depth at 0, compiled by `pdcompile.compile` into a random 2-4 planned
stages (1F1B-flush, 2 microbatches, the analytic cost pass), two updates of SGD with momentum on
4 images, and compared with one process accumulating the same 2 microbatches: the losses and
every weight and buffer. With `--schedules` each architecture also draws its schedule from the
flush schedules (those whose updates equal one process's: 1F1B-flush, GPipe, interleaved 1F1B,
ZB-H1, interleaved ZB, ZB-V, DualPipeV; not the asynchronous 1F1B and 2BW) and a microbatch
count that schedule's order runs with on K workers (2 or 4 for 1F1B-flush and GPipe; 2, K or
2K up to 4 for the other chunked orders; 2K for DualPipeV), 2 images a microbatch; `stages=K`
gives an interleaved or V-shaped schedule K workers holding two chunks each. Architectures over
40 M parameters are left out (float64 and two copies of the model; a 600 M one ran this 24 GiB
machine out of memory), and so are models that train differently from themselves in one
process (random operations the flags above miss).

    python benchmarks/timm_sweep.py --seed 23 --count 60 [--out /tmp/timm.jsonl]
    python benchmarks/timm_sweep.py --seed 23 --count 161 --start 79   # the draws after 79
    python benchmarks/timm_sweep.py --seed 24 --count 40 --schedules   # schedules drawn too

    python benchmarks/timm_sweep.py --one xcit_tiny_12_p8_384 --stages 2 \
        [--schedule zb-v --micro 4]   # one architecture, in this process, no time limit

`--start N` draws the first N families as before (the same seeds give the same draws) but runs
only those after them, to go on from where a run stopped; `--schedules` changes the draws after
each architecture's stage count, so its runs are comparable only with runs that also use it.
`--limit` is wall-clock time: on a loaded machine the slowest (float64 maxvit_tiny_tf_512: about
345 s of one core's CPU, and over 15 GiB; xcit_tiny_12_p8_384: 131 s) time out, so run a
TIMEOUT again with `--one`, which has none.

Each line printed (and appended to --out) is one architecture as JSON; the end prints a
summary table. Outcomes: equal (losses to 1e-9 relative, weights and buffers to 1e-7 of each
tensor's largest value, or 1e-10 absolute where a tensor is near zero: a bias before a
BatchNorm has a gradient of zero but for rounding, so its values are rounding noise of 1e-16 to
1e-13 that any other order of summing the microbatches changes, as GPipe's reversed backwards
do: rexnet_150's SE biases, 1e-13 apart, read as DIFFERS under 1e-13), refused (a
PdcompileError: the one-line message is kept), DIFFERS, CRASH (any other exception), TIMEOUT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMALL = re.compile(r"(tiny|small|nano|pico|atto|femto|_050|_035|_075|xxs|xs|_s\b|b0|_002|18|"
                   r"light|lite|mini|micro|_t\b)")
MOST_PARAMETERS = 40e6
STEPS, MICRO, PER_MICRO = 2, 2, 2  # updates, microbatches, images a microbatch
NOISE = 1e-10  # a gap this small is rounding, whatever the tensor's scale (module docstring)


def _families() -> dict[str, list[str]]:
    import timm

    found: dict[str, list[str]] = {}
    for name in timm.list_models():
        found.setdefault(re.split(r"[_\d]", name)[0], []).append(name)
    return found


def flush_schedules() -> list[str]:
    """The schedules whose updates equal one process accumulating the microbatches."""
    from pdcompile.schedule.kinds import KINDS

    return [name for name, row in KINDS.items() if row.flush]


def microbatch_options(schedule: str, workers: int) -> list[int]:
    """Microbatch counts `schedule`'s order runs with on `workers` workers, at most 4 where
    the order allows (float64 images are slow): DualPipeV 2 per worker; the chunked orders
    rounds of `workers` microbatches or fewer than `workers`; the 1F1B orders any count."""
    from pdcompile.schedule.kinds import kind

    row = kind(schedule)
    if row.microbatches_per_rank:
        return [row.microbatches_per_rank * workers]
    if row.chunked:
        return sorted({m for m in (2, workers, 2 * workers)
                       if m <= 4 and (m < workers or m % workers == 0)})
    return [2, 4]


def _reference(model: Any, x: Any, target: Any, loss_fn: Any, optimizer: Any, micro: int
               ) -> tuple[list[float], dict[str, Any]]:
    """STEPS updates of one process accumulating `micro` microbatches (each loss / micro)."""
    import copy

    import torch

    model = copy.deepcopy(model)
    opt = optimizer(list(model.parameters()))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for part, part_target in zip(torch.tensor_split(x, micro),
                                     torch.tensor_split(target, micro), strict=True):
            loss = loss_fn(model(part), part_target)
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def _created(name: str) -> Any:
    """The untrained model with every dropout and drop-path rate at 0 that it exposes."""
    import timm
    import torch

    for extra in ({"drop_rate": 0.0, "drop_path_rate": 0.0}, {"drop_rate": 0.0}, {}):
        try:
            model = timm.create_model(name, pretrained=False, num_classes=10, **extra)
            break
        except TypeError:
            continue
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("drop_rate", "drop_path_rate", "attn_drop", "proj_drop_rate"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)  # read by functional dropout in forward
    return model.double().train()


def one(name: str, stages: int, schedule: str = "1f1b-flush", micro: int = MICRO
        ) -> dict[str, Any]:
    """The outcome of one architecture (module docstring), as a JSON-ready dict."""
    import copy

    import timm
    import torch

    import pdcompile
    from pdcompile.errors import PdcompileError
    from pdcompile.models.real_models import classification_loss

    torch.set_num_threads(1)
    out: dict[str, Any] = {"model": name, "stages": stages, "schedule": schedule,
                           "microbatches": micro}
    try:
        with torch.device("meta"):  # counted without memory
            count = sum(p.numel() for p in timm.create_model(name, num_classes=10).parameters())
    except Exception:  # noqa: BLE001 (a model that cannot be built on meta: counted below)
        count = 0
    out["params_m"] = round(count / 1e6, 2)
    if count > MOST_PARAMETERS:
        return {**out, "result": "left out", "why": f"{count / 1e6:.0f} M parameters"}
    torch.manual_seed(0)
    model = _created(name)
    count = sum(p.numel() for p in model.parameters())
    out["params_m"] = round(count / 1e6, 2)
    size = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    out["input"] = list(size)
    x = torch.randn(PER_MICRO * micro, *size, dtype=torch.float64)
    target = torch.randint(0, 10, (PER_MICRO * micro,))

    def momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    want, state = _reference(model, x, target, classification_loss, momentum, micro)
    again, _ = _reference(model, x, target, classification_loss, momentum, micro)
    if again != want:
        return {**out, "result": "left out", "why": f"one process twice: {want} / {again}"}
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                                 loss_fn=classification_loss, optimizer=momentum,
                                 stages=stages, schedule=schedule, microbatches=micro,
                                 cost="analytic")
    except PdcompileError as err:
        return {**out, "result": "refused", "error": str(err)[:600]}
    out["config"] = [len(s.nodes) for s in pipe.plan.stages]
    losses = [pipe.step(x, target=target) for _ in range(STEPS)]
    got = pipe.state_dict()
    loss_error = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, want, strict=True))
    worst, worst_key = 0.0, None
    for key, value in state.items():
        if key not in got:
            continue
        if value.is_floating_point():
            gap = (got[key] - value).abs().max().item()
            error = 0.0 if gap <= NOISE else gap / max(value.abs().max().item(), 1e-30)
        else:
            error = 0.0 if torch.equal(got[key], value) else float("inf")
        if error > worst:
            worst, worst_key = error, key
    keys = sorted(set(state) ^ set(got))
    equal = loss_error < 1e-9 and worst < 1e-7 and not keys
    return {**out, "result": "equal" if equal else "DIFFERS", "loss_error": loss_error,
            "weight_error": worst, "worst_key": worst_key, "keys_differ": keys[:5]}


def _run_one(name: str, stages: int, schedule: str, micro: int, limit: float
             ) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", name, "--stages", str(stages),
               "--schedule", schedule, "--micro", str(micro)]
    where = {"model": name, "stages": stages, "schedule": schedule, "microbatches": micro}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {**where, "result": "TIMEOUT", "seconds": limit}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {**where, "result": "CRASH", "error": f"exit {done.returncode}: {done.stderr[-600:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--count", type=int, default=60, help="families drawn")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds per architecture")
    parser.add_argument("--out", type=Path, help="append each outcome here as a JSON line")
    parser.add_argument("--start", type=int, default=0,
                        help="draw the first N families as usual but run only those after them")
    parser.add_argument("--schedules", action="store_true",
                        help="draw each architecture's schedule among the flush schedules")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b-flush", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=MICRO, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import time
        import traceback

        start = time.time()
        try:
            found = one(args.one, args.stages, args.schedule, args.micro)
        except Exception as err:  # noqa: BLE001 (any failure is the finding)
            found = {"model": args.one, "stages": args.stages, "schedule": args.schedule,
                     "microbatches": args.micro, "result": "CRASH",
                     "error": f"{type(err).__name__}: {str(err)[:500]}",
                     "where": traceback.format_exc()[-1500:]}
        found["seconds"] = round(time.time() - start, 1)
        print(json.dumps(found), flush=True)
        return
    rng = random.Random(args.seed)
    families = _families()
    order = sorted(families)
    rng.shuffle(order)
    outcomes = []
    schedules = flush_schedules()
    for index, family in enumerate(order[:args.count]):
        members = sorted(families[family])
        name = rng.choice([m for m in members if SMALL.search(m)] or members)
        stages, schedule, micro = rng.choice([2, 2, 3, 4]), "1f1b-flush", MICRO
        if args.schedules:
            schedule = rng.choice(schedules)
            micro = rng.choice(microbatch_options(schedule, stages))
        if index < args.start:
            continue
        found = {"family": family, **_run_one(name, stages, schedule, micro, args.limit)}
        outcomes.append(found)
        print(json.dumps(found), flush=True)
        if args.out:
            with args.out.open("a") as file:
                file.write(json.dumps(found) + "\n")
    print("\n| outcome | architectures |\n|---|---|")
    for result in sorted({o["result"] for o in outcomes}):
        names = [o["model"] for o in outcomes if o["result"] == result]
        print(f"| {result} | {len(names)}: {', '.join(names)} |")


if __name__ == "__main__":
    main()
