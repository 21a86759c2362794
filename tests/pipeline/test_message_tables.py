"""A microbatch's message table is worked out once per input shape, not once per run.

The first reader of a distributed run asks `RunProgram.microbatch_specs` for the table of every
new shape of a run, which runs every stage forward on the microbatch (a whole minibatch under
asynchronous 1F1B); each `run_distributed` call starts new announcements, so the pipeline
keeps the tables.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.runtime.message_specs import message_table
from pdcompile.runtime.value_shapes import shape_key
from tests.helpers.small_pipes import small_model, small_pipe


def _counting(pipe: Any) -> list[int]:
    """Forwards of stage 0's module, counted."""
    calls: list[int] = []
    pipe.parts.stages[0].module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_each_shape_runs_the_stages_once_and_gets_its_own_table(sizes: list[int]) -> None:
    pipe = small_pipe(small_model(), plan=2, schedule="gpipe")
    (name,) = pipe.parts.data_inputs
    calls = _counting(pipe)
    for size in sizes:
        named = {name: torch.randn(size, 6)}
        table = pipe.program().microbatch_specs(named)  # as the announcements ask for it
        uncached = message_table(pipe.parts.stages, pipe._microbatch_values(named))
        assert table == uncached
    assert len(calls) == len(sizes) + len(set(sizes))  # once per shape, once per `uncached`


def test_a_table_handed_out_is_a_copy() -> None:
    pipe = small_pipe(small_model(), plan=2, schedule="gpipe")
    (name,) = pipe.parts.data_inputs
    first = pipe.microbatch_specs({name: torch.randn(4, 6)})
    for specs in first.values():
        specs.clear()
    first.clear()
    again = pipe.microbatch_specs({name: torch.randn(4, 6)})
    assert again and all(again.values())


def test_the_key_holds_numbers_by_value_and_refuses_other_objects() -> None:
    t = torch.zeros(2, 3)
    assert shape_key({"x": t, "n": 3}) != shape_key({"x": t, "n": 4})
    assert shape_key({"x": t, "n": 3}) == shape_key({"x": torch.ones(2, 3), "n": 3})
    assert shape_key({"x": t}) != shape_key({"x": t.double()})
    assert shape_key({"x": (t, [t])}) != shape_key({"x": [t, (t,)]})
    assert shape_key({"x": object()}) is None
    assert shape_key({"x": [t, object()]}) is None
    assert shape_key({"x": {1: t}}) is None  # keys other than names: not cached
