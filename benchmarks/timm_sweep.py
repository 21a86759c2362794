"""timm architectures nobody here chose, compiled by the planner and trained against one process.

One architecture per timm family (the name up to its first digit or underscore), drawn at random
from the family's small variants (tiny, small, nano, ...; any where it has none), each in a
process of its own with a time limit: created untrained in float64 at its default input size,
dropout and stochastic depth at 0, compiled by `pdcompile.compile` into a random 2-4 planned
stages (1F1B-flush, 2 microbatches, the analytic cost pass), two updates of SGD with momentum on
4 images, and compared with one process accumulating the same 2 microbatches: the losses and
every weight and buffer. Architectures over 40 M parameters are left out (float64 and two
copies of the model; a 600 M one ran this 24 GiB machine out of memory), and so are models that
train differently from themselves in one process (random operations the flags above miss).

    python benchmarks/timm_sweep.py --seed 23 --count 60 [--out /tmp/timm.jsonl]

Each line printed (and appended to --out) is one architecture as JSON; the end prints a
summary table. Outcomes: equal (losses to 1e-9 relative, weights and buffers to 1e-7 of each
tensor's largest value, or 1e-13 absolute where a tensor is near zero), refused (a
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
STEPS, MICRO, BATCH = 2, 2, 4


def _families() -> dict[str, list[str]]:
    import timm

    found: dict[str, list[str]] = {}
    for name in timm.list_models():
        found.setdefault(re.split(r"[_\d]", name)[0], []).append(name)
    return found


def _reference(model: Any, x: Any, target: Any, loss_fn: Any, optimizer: Any
               ) -> tuple[list[float], dict[str, Any]]:
    """STEPS updates of one process accumulating MICRO microbatches (each loss / MICRO)."""
    import copy

    import torch

    model = copy.deepcopy(model)
    opt = optimizer(list(model.parameters()))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for part, part_target in zip(torch.tensor_split(x, MICRO),
                                     torch.tensor_split(target, MICRO), strict=True):
            loss = loss_fn(model(part), part_target)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
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


def one(name: str, stages: int) -> dict[str, Any]:
    """The outcome of one architecture (module docstring), as a JSON-ready dict."""
    import copy

    import timm
    import torch

    import pdcompile
    from pdcompile.errors import PdcompileError
    from pdcompile.models.real_models import classification_loss

    torch.set_num_threads(1)
    out: dict[str, Any] = {"model": name, "stages": stages}
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
    x = torch.randn(BATCH, *size, dtype=torch.float64)
    target = torch.randint(0, 10, (BATCH,))

    def momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    want, state = _reference(model, x, target, classification_loss, momentum)
    again, _ = _reference(model, x, target, classification_loss, momentum)
    if again != want:
        return {**out, "result": "left out", "why": f"one process twice: {want} / {again}"}
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                                 loss_fn=classification_loss, optimizer=momentum,
                                 stages=stages, schedule="1f1b-flush", microbatches=MICRO,
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
            error = 0.0 if gap <= 1e-13 else gap / max(value.abs().max().item(), 1e-30)
        else:
            error = 0.0 if torch.equal(got[key], value) else float("inf")
        if error > worst:
            worst, worst_key = error, key
    keys = sorted(set(state) ^ set(got))
    equal = loss_error < 1e-9 and worst < 1e-7 and not keys
    return {**out, "result": "equal" if equal else "DIFFERS", "loss_error": loss_error,
            "weight_error": worst, "worst_key": worst_key, "keys_differ": keys[:5]}


def _run_one(name: str, stages: int, limit: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", name, "--stages", str(stages)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"model": name, "stages": stages, "result": "TIMEOUT", "seconds": limit}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"model": name, "stages": stages, "result": "CRASH",
            "error": f"exit {done.returncode}: {done.stderr[-600:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--count", type=int, default=60, help="families drawn")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds per architecture")
    parser.add_argument("--out", type=Path, help="append each outcome here as a JSON line")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import time
        import traceback

        start = time.time()
        try:
            found = one(args.one, args.stages)
        except Exception as err:  # noqa: BLE001 (any failure is the finding)
            found = {"model": args.one, "stages": args.stages, "result": "CRASH",
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
    for family in order[:args.count]:
        members = sorted(families[family])
        name = rng.choice([m for m in members if SMALL.search(m)] or members)
        found = {"family": family, **_run_one(name, rng.choice([2, 2, 3, 4]), args.limit)}
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
