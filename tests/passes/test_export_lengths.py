"""Variable-length batches through the torch.export front end: a pipeline compiled at one length
and batch size trains at others, equal to plain training; a minibatch the recorded graph cannot
run on is refused before any rank starts, naming the expected and the given shapes (also after
an export and load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.meta import get_frontend
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.schedule.kinds import kind
from tests.helpers import lengths
from tests.helpers.input_refusal import distributed_refusal
from tests.helpers.lengths import POSITIONS, SGD, VOCAB, TinyLM, plain_step, tokens


def _plain_copy(pipe: pdcompile.pipeline.Pipeline) -> tuple[TinyLM, torch.optim.Optimizer]:
    """A plain TinyLM holding the pipeline's current weights, and its optimizer."""
    model = TinyLM()
    model.load_state_dict(pipe.state_dict())
    return model, SGD(model.parameters())


def _assert_same_step(pipe: pdcompile.pipeline.Pipeline, ids: torch.Tensor, target: torch.Tensor,
                      micro: int) -> None:
    """One step of the pipeline equals one plain step from the same weights: loss, grads and
    the updated weights."""
    model, optimizer = _plain_copy(pipe)
    loss = pipe.step(ids, target=target)
    want = plain_step(model, optimizer, {"ids": ids}, target, lengths.next_token_loss, micro)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), tuple(ids.shape)
    params = pipe.named_parameters()
    for name, param in model.named_parameters():
        assert param.grad is not None and params[name].grad is not None, name
        torch.testing.assert_close(params[name].grad, param.grad, atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=name: f"grad of {n} at {tuple(ids.shape)}: {m}")
    state = pipe.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)


def test_a_model_only_export_captures_trains_at_any_length_and_batch_size() -> None:
    pipe = lengths.tiny_pipeline(micro=2)
    assert get_frontend(pipe.graph) == "export"
    with pytest.raises(pdcompile.errors.TraceError):  # fx cannot slice by a traced length
        pdcompile.compile(TinyLM(), example_inputs=(tokens(4, 8, 0)[0],), stages=[1, 1],
                          frontend="fx")
    for batch, length in [(4, 5), (4, 13), (6, 8), (3, 13), (7, 1), (4, 8)]:
        _assert_same_step(pipe, *tokens(batch, length, batch * 100 + length), micro=2)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(batch=st.integers(2, 9), length=st.integers(1, POSITIONS), seed=st.integers(0, 99))
    def drawn(batch: int, length: int, seed: int) -> None:
        _assert_same_step(pipe, *tokens(batch, length, seed), micro=2)

    drawn()


def test_a_stream_of_shapes_trains_like_plain_training_on_three_stages() -> None:
    pipe = lengths.tiny_pipeline(schedule="gpipe", micro=3, stages=[1, 1, 1])
    model, optimizer = _plain_copy(pipe)
    data = lengths.stream([(6, 5), (3, 13), (9, 8), (5, 20)])  # 5 samples: microbatches of 2, 2, 1
    losses = pipe.train(data)
    want = [plain_step(model, optimizer, {"ids": ids}, y, lengths.next_token_loss, 3)
            for ids, y in data]
    assert losses == pytest.approx(want, rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, atol=1e-6, rtol=1e-5)


def _refusal(pipe: pdcompile.pipeline.Pipeline, *inputs: Any, target: Any) -> str:
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(PipelineInputError) as info:
        pipe.step(*inputs, target=target)
    for name, value in pipe.state_dict().items():  # refused before any rank started
        torch.testing.assert_close(value, before[name])
    return str(info.value)


def test_an_input_the_recorded_graph_cannot_run_on_is_refused_naming_both_shapes() -> None:
    pipe = lengths.tiny_pipeline()
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("ids") == f"(any, 1..{POSITIONS}) int64"
    too_long, target = tokens(4, POSITIONS + 8, 0)
    assert _refusal(pipe, too_long, target=target) == (
        f"minibatch 0: input 'ids' is (4, {POSITIONS + 8}) int64 but the model, as "
        f"torch.export captured it, runs on (any, 1..{POSITIONS}) int64: dimension 1 must be 1 "
        f"to {POSITIONS} (the model's limit)")
    three = torch.randint(0, VOCAB, (4, 8, 2))
    assert _refusal(pipe, three, target=target).endswith(
        "input 'ids' is (4, 8, 2) int64 but the model, as torch.export captured it, runs on "
        f"(any, 1..{POSITIONS}) int64: give it 2 dimensions, not 3")
    floats = torch.rand(4, 8)
    assert _refusal(pipe, floats, target=target).endswith(
        "input 'ids' is (4, 8) float32 but the model, as torch.export captured it, runs on "
        f"(any, 1..{POSITIONS}) int64: convert it with .to(torch.int64)")
    _assert_same_step(pipe, *tokens(4, 13, 1), micro=2)  # and trains on after refusing


class Branching(TinyLM):
    """Depends on its length in Python: torch.export fixes the length at the example's."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * 2 if ids.shape[1] == 8 else out


class IntChecked(TinyLM):
    """Refuses a symbolic length: torch.export captures it only with the batch free."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids.shape[1], int):
            raise TypeError("the length must be a Python int")
        return super().forward(ids)


@pytest.mark.parametrize("cls", [Branching, IntChecked])
def test_a_length_the_model_depends_on_stays_fixed_and_others_are_refused(cls: type) -> None:
    torch.manual_seed(0)
    ids, target = tokens(4, 8, 0)
    pipe = pdcompile.compile(cls(), example_inputs=(ids,), loss_fn=lengths.next_token_loss,
                             optimizer=SGD, schedule="1f1b-flush", microbatches=2,
                             stages=[1, 1], cost="analytic")
    assert get_frontend(pipe.graph) == "export"
    assert pipe.input_shapes is not None and pipe.input_shapes.describe("ids") == "(any, 8) int64"
    plain = cls()
    plain.load_state_dict(pipe.state_dict())
    for batch in (6, 3):  # the batch stays free
        more, more_target = tokens(batch, 8, batch)
        loss = pipe.step(more, target=more_target)
        assert loss == pytest.approx(plain_step(plain, SGD(plain.parameters()), {"ids": more},
                                                more_target, lengths.next_token_loss, 2), rel=1e-5)
    short, short_target = tokens(4, 5, 0)  # would silently skip Branching's doubling
    assert _refusal(pipe, short, target=short_target) == (
        "minibatch 0: input 'ids' is (4, 5) int64 but the model, as torch.export captured it, "
        "runs on (any, 8) int64: the model's code depends on the size of dimension 1, so "
        "torch.export fixed it at 8; pass that size or compile the pipeline at the size to "
        "train on")


class Keyed(nn.Module):
    """fx traces it; inputs go by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * mask.unsqueeze(-1))


def test_inputs_given_by_name_are_named_with_their_shapes_when_refused() -> None:
    ids, target = tokens(4, 8, 0)
    pipe = pdcompile.compile(Keyed(), example_inputs={"ids": ids, "mask": torch.ones(4, 8)},
                             loss_fn=lengths.next_token_loss, optimizer=SGD, schedule="1f1b-flush",
                             microbatches=2, stages=[1, 1], cost="analytic")
    assert get_frontend(pipe.graph) == "fx" and pipe.input_shapes is None
    message = _refusal(pipe, {"ids": ids, "mask": torch.ones(4, 8, 3)}, target=target)
    assert message.startswith("minibatch 0: input 'mask' is (4, 8, 3) float32 but the pipeline "
                              "was compiled for (4, 8) float32, and the model cannot run on it "
                              "(RuntimeError: "), message
    short, short_target = tokens(4, 5, 1)  # the fx graph runs at any length
    pipe.step({"ids": short, "mask": torch.ones(4, 5)}, target=short_target)


def test_an_export_and_load_keeps_training_at_new_lengths(tmp_path: Path) -> None:
    pipe = lengths.tiny_pipeline()
    pipe.export(str(tmp_path / "tiny"))
    loaded = pdcompile.load(str(tmp_path / "tiny"))
    assert loaded.input_shapes == pipe.input_shapes
    assert InputShapes.from_json(pipe.input_shapes.to_json()) == pipe.input_shapes
    data = lengths.stream([(4, 5), (6, 13), (4, 8)])
    assert loaded.train(data) == pytest.approx(pipe.train(data), rel=1e-6)
    too_long, target = tokens(4, POSITIONS + 1, 0)
    assert _refusal(loaded, too_long, target=target) == _refusal(pipe, too_long, target=target)


# ---------------------------------------------------------------------------- slow: processes
# (batch size, length) of each minibatch of the distributed runs: none is the example's (4, 8)
SHAPES = [(4, 5), (6, 13), (3, 20), (4, 8), (5, 1)]
# (schedule, microbatches, whether the batch size and the length cross the cut as numbers)
SCHEDULES = [("1f1b-flush", 2, False), ("gpipe", 3, True), ("1f1b", None, False)]


def _held(pipe: pdcompile.pipeline.Pipeline, stage: int) -> set[str]:
    """The model's names of the parameters and buffers that `stage` holds."""
    program = pipe.parts.stages[stage]
    return {name for names in [*program.param_names.values(), *program.buffer_names.values()]
            for name in names}


def _distributed(worker: Any) -> list[Any]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    torch.set_num_threads(1)
    out: list[Any] = []
    for schedule, micro, sizes_cross in SCHEDULES:
        pipe = lengths.tiny_pipeline(schedule=schedule, micro=micro, sizes_cross=sizes_cross)
        assert bool(pipe.parts.stages[0].kinds) == sizes_cross  # ints among the messages
        data = lengths.stream(SHAPES) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, data, monitor=worker.monitor)
        state = pipe.state_dict()
        out.append((run.losses, run.samples,
                    {k: state[k].clone() for k in _held(pipe, worker.rank)}))
    pipe = lengths.tiny_pipeline()
    bad = [*lengths.stream(SHAPES[:1]), tokens(4, POSITIONS + 1, 9)]
    out.append(distributed_refusal(pipe, bad, worker))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_distributed_backend_trains_other_lengths_like_one_process(local_env: None) -> None:
    """Two gloo processes, one stage each: every minibatch of another length and batch size
    than the example's; the messages between the stages carry each microbatch's shapes."""
    from pdcompile.backends.launch import launch

    results = launch(_distributed, 2, timeout=360)
    data = lengths.stream(SHAPES)
    for rank, out in enumerate(results):
        for (schedule, micro, sizes_cross), (losses, samples, state) in zip(
                SCHEDULES, out[:-1], strict=True):
            local = lengths.tiny_pipeline(schedule=schedule, micro=micro, sizes_cross=sizes_cross)
            if kind(schedule).flush:  # equal to plain training, minibatch by minibatch
                model, optimizer = _plain_copy(local)
                plain = [plain_step(model, optimizer, {"ids": ids}, y,
                                    lengths.next_token_loss, micro or 1) for ids, y in data]
                assert losses == pytest.approx(plain, rel=1e-5), schedule
            want = local.train(data)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want),
                                       msg=lambda m, s=schedule: f"{s}: {m}")
            assert samples == sum(batch for batch, _ in SHAPES)
            local_state = local.state_dict()
            assert state and set(state) == _held(local, rank)
            for name, value in state.items():
                torch.testing.assert_close(value, local_state[name], atol=1e-6, rtol=1e-5)
        local_error = None
        try:
            lengths.tiny_pipeline().train([*data[:1], tokens(4, POSITIONS + 1, 9)])
        except PipelineInputError as err:
            local_error = str(err)
        assert local_error is not None and "dimension 1 must be 1 to 32" in local_error
        assert out[-1] == local_error  # the same refusal, on every rank


DATA_FILE = '''
import torch


def batches():
    """GPT-2 minibatches of other lengths and batch sizes than the example's (4, 8)."""
    out = []
    for seed, (batch, length) in enumerate({shapes}):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 100, (batch, length), generator=gen)
        out.append(({{"input_ids": ids}}, torch.roll(ids, -1, dims=1)))
    return out
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hugging_face_gpt2_exported_at_one_length_runs_at_others(tmp_path: Path,
                                                                 local_env: None) -> None:
    """A tiny GPT-2 (transformers' own class, through torch.export) compiled at length 8:
    trains at other lengths and batch sizes equal to plain training, and so does its export,
    loaded here and run by `pdcompile run --nproc 2` on data of those shapes."""
    pytest.importorskip("transformers")
    from pdcompile.models.real_models import gpt2, next_token_loss
    from pdcompile.util.module_file import exec_module_file
    from tests.helpers.processes import printed_losses, run_cli

    model, inputs, target = gpt2(batch=4, length=8, layers=2)
    options: dict[str, Any] = dict(example_inputs=inputs, example_target=target,
                                   loss_fn=next_token_loss, optimizer=SGD, cost="analytic",
                                   schedule="1f1b-flush", microbatches=2, stages=[1, 1])
    pipe = pdcompile.compile(model, **options)
    assert get_frontend(pipe.graph) == "export"
    folder = tmp_path / "gpt2"
    pipe.export(str(folder))
    data_file = tmp_path / "gpt2_data.py"
    data_file.write_text(DATA_FILE.format(shapes=[(4, 5), (6, 13), (2, 30), (4, 8)]))
    module = exec_module_file(data_file, "gpt2_data")
    assert module is not None
    data = module.batches()

    plain, _, _ = gpt2(batch=4, length=8, layers=2)
    plain.load_state_dict(pipe.state_dict())
    optimizer = SGD(plain.parameters())
    want = [plain_step(plain, optimizer, named, y, next_token_loss, 2) for named, y in data]
    assert pipe.train(data) == pytest.approx(want, rel=1e-5)
    params = pipe.named_parameters()
    for name, param in plain.named_parameters():  # the last step's gradients
        torch.testing.assert_close(params[name].grad, param.grad, atol=1e-6, rtol=1e-4)

    loaded = pdcompile.load(str(folder))
    assert loaded.train(data) == pytest.approx(want, rel=1e-5)
    done = run_cli([str(folder), "--nproc", "2", "--data", f"{data_file}:batches",
                    "--threads", "1"], timeout=500)
    assert done.returncode == 0, done.stdout[-3000:]
    assert printed_losses(done.stdout) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_bert_trains_at_other_lengths_within_its_positions() -> None:
    """BERT's two inputs share their length, which its 64 positions bound: other lengths and
    batch sizes train equal to plain training; a longer or mismatched input is refused."""
    pytest.importorskip("transformers")
    from pdcompile.models.real_models import bert, classification_loss

    model, inputs, target = bert(batch=4, length=8, layers=2)
    pipe = pdcompile.compile(model, example_inputs=inputs, loss_fn=classification_loss,
                             optimizer=SGD, cost="analytic", schedule="1f1b-flush",
                             microbatches=2, stages=[1, 1])
    assert get_frontend(pipe.graph) == "export"
    plain, _, _ = bert(batch=4, length=8, layers=2)
    plain.load_state_dict(pipe.state_dict())
    optimizer = SGD(plain.parameters())
    for batch, length in [(4, 5), (6, 13), (3, 64)]:
        named = bert(batch=batch, length=length, layers=2)[1]
        y = torch.randint(0, 3, (batch,))
        loss = pipe.step(named, target=y)
        want = plain_step(plain, optimizer, named, y, classification_loss, 2)
        assert loss == pytest.approx(want, rel=1e-5), (batch, length)
    mask = torch.ones(4, 65, dtype=torch.long)
    assert _refusal(pipe, {"input_ids": torch.zeros(4, 65, dtype=torch.long),
                           "attention_mask": mask}, target=torch.zeros(4, dtype=torch.long)) == (
        "minibatch 0: input 'input_ids' is (4, 65) int64 but the model, as torch.export "
        "captured it, runs on (any, n2=1..64) int64: dimension 1 must be 1 to 64 (the model's "
        "limit)")
    message = _refusal(pipe, {"input_ids": torch.zeros(4, 8, dtype=torch.long),
                              "attention_mask": mask[:, :9]},
                       target=torch.zeros(4, dtype=torch.long))
    assert message.endswith("input 'attention_mask' is (4, 9) int64 but the model, as "
                            "torch.export captured it, runs on (any, n2=1..64) int64: dimension "
                            "1 must equal the size n2 of input 'input_ids', which is 8")
