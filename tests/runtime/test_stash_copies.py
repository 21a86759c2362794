"""Weight stashing copies weights only where an update can come while a minibatch is in flight.

(That the results still follow PipeDream's semantics is test_async_semantics'
test_1f1b_matches_pipedream_reference, whose pipelines' last stages now run without copies.)
"""

from __future__ import annotations

import pytest

from tests.helpers.blocks import batches, build, make_model


@pytest.mark.parametrize(("stages", "replicas"), [(2, None), (3, [1, 2, 1]), (3, [2, 1, 1])])
def test_only_stages_with_minibatches_in_flight_copy_their_weights(
        stages: int, replicas: list[int] | None) -> None:
    pipe = build(make_model(), stages, replicas, schedule="1f1b")
    pipe.train(batches(8))
    for rank, rt in pipe.last_runtimes.items():
        last = rt.stage == stages - 1
        assert rt.versions.copy is not last, f"rank {rank} (stage {rt.stage})"
        assert rt.versions.held == []


def test_vertical_sync_and_2bw_keep_copying() -> None:
    pipe = build(make_model(), 2, None, schedule="1f1b", vertical_sync=True)
    pipe.train(batches(4))
    assert all(rt.versions.copy for rt in pipe.last_runtimes.values())
    pipe = build(make_model(), 2, None, schedule="2bw", microbatches=2)
    pipe.train(batches(4))
    assert all(rt.versions.copy for rt in pipe.last_runtimes.values())
