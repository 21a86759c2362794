"""What a rank of a distributed run says when a minibatch does not fit the pipeline: the tests
of other shapes end their worker with one bad stream and compare the refusal across ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdcompile.backends.launch import Worker
from pdcompile.errors import PipelineInputError


def distributed_refusal(pipe: Any, bad: Iterable[Any], worker: Worker) -> str:
    """The message of the `PipelineInputError` that `run_distributed` raises on this rank when
    the reading rank is handed `bad`; fails if the run takes it."""
    from pdcompile.backends.distributed import reads_data, run_distributed

    try:
        run_distributed(pipe, bad if reads_data(pipe, worker.rank) else None,
                        monitor=worker.monitor)
    except PipelineInputError as err:
        return str(err)
    raise AssertionError(f"rank {worker.rank} trained on a minibatch that does not fit")
