"""The stream window: how a stream of minibatches is read into runs (runtime/stream_window.py).
A run never reads past what it may train, ends where checkpoints are due, holds whole rounds of
the replicas, and a resumed stream starts where the data can say it stopped."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcompile.errors import PipelineInputError
from pdcompile.runtime.stream_window import (
    data_bytes,
    resumed_stream,
    take_window,
    window_limit,
    window_rounds,
)


class Counted:
    """An endless stream that counts what was read from it."""

    def __init__(self) -> None:
        self.read = 0

    def __iter__(self) -> Iterator[int]:
        for i in itertools.count():
            self.read = i + 1
            yield i


@given(index=st.integers(0, 10_000), steps=st.none() | st.integers(0, 20_000),
       segment=st.none() | st.integers(1, 3000), multiple=st.integers(1, 6),
       window=st.integers(1, 2048))
def test_a_run_stays_in_its_window_and_ends_where_checkpoints_are_due(
        index: int, steps: int | None, segment: int | None, multiple: int, window: int) -> None:
    if segment is not None:
        segment *= multiple  # checkpoint intervals are whole rounds (checked by the backend)
        index = index // segment * segment  # runs start where the last one ended
    limit = window_limit(index, steps=steps, segment=segment, multiple=multiple, window=window)
    assert limit <= max(window, multiple)
    if steps is not None:
        assert index + limit <= max(steps, index)
    if segment is not None and limit:
        assert (index + limit) % segment == 0 or limit < segment - index % segment
        assert (index + limit) // segment - index // segment <= 1  # never past a checkpoint
    if steps is None or index + limit < steps:  # not cut by the end of the run
        assert limit % multiple == 0 and limit > 0


@given(limit=st.integers(0, 50))
def test_take_window_reads_no_more_than_the_run_takes(limit: int) -> None:
    counted = Counted()
    items = take_window(iter(counted), limit, convert=lambda item, index: (index, item))
    assert items == [(i, i) for i in range(limit)]
    assert counted.read == limit  # nothing read ahead of the run


def test_a_window_closes_early_at_its_bytes_in_whole_rounds() -> None:
    big = (torch.zeros(1000), torch.zeros(24))  # 4096 bytes a minibatch
    assert data_bytes(big) == 4096
    items = take_window(itertools.repeat(big), 100, convert=lambda item, index: item,
                        max_bytes=10_000, least=2, multiple=2)
    assert len(items) == 4  # 3 would hold 12288 bytes, but a round is 2
    items = take_window(itertools.repeat(big), 100, convert=lambda item, index: item,
                        max_bytes=10_000, least=8)
    assert len(items) == 8


def test_window_rounds() -> None:
    assert window_rounds("1f1b", [2, 3]) == (6, 12)  # whole minibatches round-robin
    assert window_rounds("2bw", [2, 1]) == (1, 8)
    assert window_rounds("1f1b-flush", [1, 1, 1]) == (1, 12)


class Stateful:
    """A data source that can say where it is (as torchdata's StatefulDataLoader)."""

    def __init__(self) -> None:
        self.at = 0
        self.iterated_from: list[int] = []

    def __iter__(self) -> Iterator[int]:
        self.iterated_from.append(self.at)
        while True:
            self.at += 1
            yield self.at - 1

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def test_a_resumed_stream_starts_where_the_data_says_without_reading_before() -> None:
    data = Stateful()
    stream = resumed_stream(data, 40, state={"at": 40})
    assert next(stream) == 40 and data.iterated_from == [40]


def test_a_resumed_sequence_is_indexed_not_read() -> None:
    touched: list[int] = []

    class Seq(list[int]):
        def __getitem__(self, i: Any) -> Any:
            touched.append(i)
            return super().__getitem__(i)

    stream = resumed_stream(Seq(range(10)), 7)
    assert list(stream) == [7, 8, 9] and touched == [7, 8, 9]
    with pytest.raises(PipelineInputError, match="holds 10 minibatches but the run resumes at "
                                                  "minibatch 12"):
        resumed_stream(Seq(range(10)), 12)


def test_other_streams_are_read_up_to_the_resume_point() -> None:
    counted = Counted()
    stream = resumed_stream(counted, 5)
    assert next(stream) == 5 and counted.read == 6
    with pytest.raises(PipelineInputError, match="ends after 3 minibatches but the run resumes "
                                                 "at minibatch 5"):
        resumed_stream(iter(range(3)), 5)
