"""A small model, its data and its pipeline, for the backends' tests."""

from __future__ import annotations

import torch
import torch.nn as nn

import pdcompile

mse = nn.functional.mse_loss


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def small_data(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]


def small_pipe(model: nn.Module, **options: object) -> pdcompile.pipeline.Pipeline:
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 6),), loss_fn=mse,
                             **options)  # type: ignore[arg-type]


def two_stage_pipe() -> pdcompile.pipeline.Pipeline:
    """Linear(6, 8), Tanh, Linear(8, 3) in two stages of 2 microbatches, costed analytically:
    the export tests' pipeline (quick to compile, nothing measured)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return pdcompile.compile(model, example_inputs=(torch.randn(4, 6),),
                             example_target=torch.randn(4, 3), loss_fn=mse,
                             stages=[1, 1], microbatches=2, cost="analytic")


def rank_weights(pipe: pdcompile.pipeline.Pipeline, rank: int) -> dict[str, torch.Tensor]:
    """The parameters `rank` holds after a run, by their names in the model."""
    out = {}
    for stage in pipe.stages_of(rank):
        state, program = pipe.state(rank, stage), pipe.parts.stages[stage]
        out.update({original: p.detach().clone()
                    for name, p in state.module.named_parameters()
                    for original in program.param_names.get(name, (name,))})
    return out


def assert_ranks_trained_alike(results: list[list[dict[str, object]]], index: int,
                               pipe: pdcompile.pipeline.Pipeline, want: list[float],
                               case: object) -> None:
    """Every rank's losses of run `index` equal `want` (the local backend's), and the ranks'
    weights together (`rank_weights`) equal the pipeline's after `want`'s training."""
    weights: dict[str, torch.Tensor] = {}
    for per_rank in results:
        run = per_rank[index]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want),
                                   msg=lambda m: f"{case}: {m}")
        weights.update(run["weights"])  # type: ignore[arg-type]
    state = pipe.named_parameters()
    assert sorted(weights) == sorted(state), case
    for name, value in state.items():
        torch.testing.assert_close(weights[name], value.detach(),
                                   msg=lambda m, n=name: f"{case} {n}: {m}")
