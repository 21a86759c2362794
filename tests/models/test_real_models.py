"""Real models through the whole path (issue: "real models, hidden from nobody").

For every family of pdcompile.models.real_models (torchvision, timm, Hugging Face, torch.nn):
compile with the planner (local-2) and with stages=2; two `1f1b-flush` steps equal
single-process gradient accumulation over the same microbatches; the stages=2 pipeline is
exported and trained by `pdcompile run --nproc 2` with the same losses. Families whose library
is missing are skipped with the extra to install. `REAL_MODELS_REPORT=path` appends one JSON
line per family (front end, max differences, plan) for the README's table.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pdcompile
from pdcompile.meta import get_frontend
from pdcompile.models.real_models import FAMILIES, LIBRARY, loss_for
from tests.helpers.processes import printed_losses, run_cli

SGD = functools.partial(torch.optim.SGD, lr=0.05)
MICRO = 2
STEPS = 2
EXPECTED_FRONTEND = {"hf-bert": "export", "hf-gpt2": "export"}  # fx for the others


def _available(name: str) -> bool:
    library = LIBRARY[name]
    return library is None or importlib.util.find_spec(library) is not None


FAMILY_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(
        not _available(name), reason=f"{LIBRARY[name]} is not installed: pip install -e .[models]"))
    for name in FAMILIES]


def _args(inputs: Any) -> tuple[Any, ...]:
    return (inputs,) if isinstance(inputs, dict) else tuple(inputs)


def _microbatches(inputs: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    if isinstance(inputs, dict):
        return [((), {k: v.chunk(MICRO)[i] for k, v in inputs.items()}) for i in range(MICRO)]
    return [(tuple(v.chunk(MICRO)[i] for v in inputs), {}) for i in range(MICRO)]


def reference(model: torch.nn.Module, inputs: Any, target: torch.Tensor,
              loss_fn: Any) -> list[float]:
    """Single-process gradient accumulation over the same microbatches."""
    opt = SGD(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for (args, kwargs), part in zip(_microbatches(inputs), target.chunk(MICRO), strict=True):
            loss = loss_fn(model(*args, **kwargs), part)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        losses.append(total)
    return losses


def compare(pipe: pdcompile.pipeline.Pipeline, model: torch.nn.Module, inputs: Any,
            target: torch.Tensor, loss_fn: Any, *, skip: set[str]) -> tuple[float, float]:
    """Train both two steps; (max loss difference, max parameter/buffer difference)."""
    losses = [pipe.step(*_args(inputs), target=target) for _ in range(STEPS)]
    want = reference(model, inputs, target, loss_fn)
    loss_diff = max(abs(a - b) for a, b in zip(losses, want, strict=True))
    assert loss_diff <= 1e-5 * max(1.0, abs(want[0])), (losses, want)
    state, ref_state = pipe.state_dict(), model.state_dict()
    assert set(state) == set(ref_state)  # non-persistent buffers left out by both
    diffs = [0.0]
    for name, value in ref_state.items():
        if name in skip or not value.is_floating_point():
            continue
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
        diffs.append(float((state[name] - value).abs().max()))
    return loss_diff, max(diffs)


def replicated_buffers(pipe: pdcompile.pipeline.Pipeline) -> set[str]:
    """Buffers of replicated stages (BatchNorm statistics average over replicas)."""
    return {original for program, stage in zip(pipe.parts.stages, pipe.plan.stages, strict=True)
            if len(stage.ranks) > 1 for originals in program.buffer_names.values()
            for original in originals}


def _layer_spread(pipe: pdcompile.pipeline.Pipeline) -> list[list[str]]:
    """Per stage, the numbered blocks ("...layer.3", "...h.0") whose parameters it holds."""
    out = []
    for program in pipe.stage_programs:
        blocks = set()
        for names in program.param_names.values():
            for name in names:
                parts = name.split(".")
                for i, part in enumerate(parts[1:], 1):
                    if part.isdigit() and parts[i - 1] in ("layer", "h", "layers"):
                        blocks.add(".".join(parts[: i + 1]))
        out.append(sorted(blocks))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_family_through_the_whole_path(name: str, tmp_path: Path, local_env: None) -> None:
    model, inputs, target = FAMILIES[name]()
    loss_fn = loss_for(name)
    options: dict[str, Any] = dict(example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                                   optimizer=SGD, schedule="1f1b-flush", microbatches=MICRO)

    planned = pdcompile.compile(copy.deepcopy(model), "local-2", **options)
    frontend = get_frontend(planned.graph)
    assert frontend == EXPECTED_FRONTEND.get(name, "fx")
    plan_diffs = compare(planned, copy.deepcopy(model), inputs, target, loss_fn,
                         skip=replicated_buffers(planned))

    pipe = pdcompile.compile(copy.deepcopy(model), stages=2, **options)
    assert len(pipe.stage_modules) == 2
    spread = _layer_spread(pipe)
    if name.startswith(("hf-", "torch-transformer")):  # whole layers on both sides of the cut
        assert spread[0] and spread[1] and not set(spread[0]) & set(spread[1]), spread
    loss_diff, param_diff = compare(pipe, copy.deepcopy(model), inputs, target, loss_fn,
                                    skip=set())

    folder = tmp_path / "pipe"
    pipe.export(str(folder))
    want = pdcompile.load(str(folder)).train([(_args(inputs), target)] * STEPS)
    done = run_cli([str(folder), "--nproc", "2", "--steps", str(STEPS), "--threads", "1"],
                    timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    got = printed_losses(done.stdout)
    assert got == pytest.approx(want, rel=1e-6)

    report = os.environ.get("REAL_MODELS_REPORT")
    if report:
        with open(report, "a") as out:
            out.write(json.dumps({
                "family": name, "frontend": frontend, "planner_config": planned.plan.config,
                "planner_max_diff": list(plan_diffs), "stages2_loss_diff": loss_diff,
                "stages2_param_diff": param_diff, "layers_per_stage": spread,
                "run_losses": got, "load_losses": want}) + "\n")
