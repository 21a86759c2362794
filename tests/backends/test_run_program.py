"""RunProgram: what Pipeline hands a backend. The local driver runs it as Pipeline.train does, it
holds the pipeline's live rank states and configuration, and the one spec function reads a
table per microbatch."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn

from pdcompile.backends.distributed import run_distributed
from pdcompile.backends.distributed_checkpoint import identity
from pdcompile.backends.local import run_program
from pdcompile.backends.program import RunProgram, as_program
from pdcompile.errors import DistributedError, PipelineInputError
from pdcompile.runtime.message_specs import spec_function
from pdcompile.runtime.transport import Tag, TensorSpec
from tests.helpers.small_pipes import small_data as _data
from tests.helpers.small_pipes import small_model as _model
from tests.helpers.small_pipes import small_pipe as _pipe

mse = nn.functional.mse_loss


@pytest.mark.parametrize(("plan", "schedule"), [([1, 2, 1], "1f1b"), (3, "gpipe"),
                                                ([2, 1], "2bw")])
def test_local_driver_trains_like_pipeline_train(plan: object, schedule: str) -> None:
    """backends/local.run_program over `program()` reaches the losses and weights of
    Pipeline.train on a copy of the same pipeline."""
    model = _model()
    one = _pipe(copy.deepcopy(model), plan=plan, schedule=schedule, microbatches=2)
    two = _pipe(copy.deepcopy(model), plan=plan, schedule=schedule, microbatches=2)
    batches: list[Any] = _data(4)
    expected = two.train(batches)
    program = one.program()
    if schedule == "gpipe":  # flush: one run per minibatch
        runs = [program.prepare([item], first=i) for i, item in enumerate(batches)]
    else:
        runs = [program.prepare(batches)]
    got: list[float] = []
    for run in runs:
        result = run_program(program, run.data, run.microbatches, run.per_minibatch,
                             record=True)
        got.extend(run.minibatch_losses(result.losses))
        assert result.timeline is not None and result.timeline.meta["backend"] == "local"
        assert sorted(result.runtimes) == program.all_ranks
    assert got == pytest.approx(expected, rel=1e-6)
    for name, value in two.state_dict().items():
        torch.testing.assert_close(one.state_dict()[name], value)


def test_program_holds_the_pipelines_live_state_and_configuration() -> None:
    pipe = _pipe(_model(), plan=[1, 2, 1], schedule="1f1b", vertical_sync=False)
    program = pipe.program()
    assert as_program(pipe).stage_ranks == program.stage_ranks == pipe.stage_ranks
    assert as_program(program) is program
    for state in pipe.states():  # the same module and optimizer objects, not copies
        assert program.state(state.rank, state.stage) is state
    assert program.collective_groups() == pipe.collective_groups() == [(1, 2)]
    assert program.run_config(1) == pipe.run_config(1)
    assert [program.reads_data(r) for r in program.all_ranks] == [True, False, False, False]
    assert program.stages_of(2) == (1,)
    with pytest.raises(PipelineInputError, match="rank 0 runs stages \\[0\\], not stage 2"):
        program.state(0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.schedule_name = "gpipe"  # type: ignore[misc]
    assert identity(program, 1) == {"config": pipe.plan.config, "schedule": "1f1b",
                                    "stage": 1, "microbatches": pipe.microbatches}


def test_program_sees_a_replaced_optimizer() -> None:
    """States are read when the program is built: one built after replace_state uses the new
    optimizer, so a backend trains what the pipeline holds."""
    pipe = _pipe(_model(), plan=2, schedule="gpipe")
    state = pipe.state(1, 1)
    params = list(state.module.parameters())
    new = dataclasses.replace(state, optimizer=torch.optim.SGD(params, lr=0.5))
    pipe.replace_state(new)
    assert pipe.program().state(1, 1).optimizer is new.optimizer


def test_spec_function_reads_each_microbatchs_table() -> None:
    """One spec function for every backend: microbatch m's shapes from its own table (a short
    last minibatch), the weight version appended to activations under vertical sync."""
    pipe = _pipe(_model(), plan=2, schedule="gpipe", microbatches=2)
    (name,) = pipe.parts.data_inputs
    tables = [pipe.microbatch_specs({name: torch.randn(4, 6)}),
              pipe.microbatch_specs({name: torch.randn(3, 6)})]
    specs = spec_function(lambda m: tables[m], False)
    assert specs(Tag("act", 0, 1, 0)) == [TensorSpec((4, 8), torch.float32)]
    assert specs(Tag("act", 0, 1, 1)) == [TensorSpec((3, 8), torch.float32)]
    assert specs(Tag("grad", 1, 0, 1)) == [TensorSpec((3, 8), torch.float32)]
    synced = spec_function(lambda m: tables[m], True)
    assert synced(Tag("act", 0, 1, 1)) == [TensorSpec((3, 8), torch.float32),
                                           TensorSpec((), torch.int64)]
    assert synced(Tag("grad", 1, 0, 1)) == [TensorSpec((3, 8), torch.float32)]
    assert pipe.spec_function((torch.randn(8, 6),))(Tag("act", 0, 1, 5)) == \
        [TensorSpec((4, 8), torch.float32)]


def test_run_distributed_takes_a_program_and_refuses_without_a_group() -> None:
    program = _pipe(_model(), plan=2, schedule="gpipe").program()
    assert isinstance(program, RunProgram)
    with pytest.raises(DistributedError, match="needs an initialised process group"):
        run_distributed(program, _data(1))
