"""Fault records read from the store: a malformed or forged one cannot crash the monitor, and
`explain` always returns a failure to raise (it asserted before)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.backends.launch import FaultMonitor, PeerFailure, describe_cause


class DictStore:
    """The part of a TCPStore the monitor uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.data.get(key)
        if current is None or current == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]


records = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    st.builds(lambda rank, reason: json.dumps({"rank": rank, "reason": reason}).encode(),
              st.one_of(st.integers(-5, 10), st.text(max_size=5), st.none(),
                        st.floats(allow_nan=True)),
              st.one_of(st.text(max_size=20), st.integers(), st.none())),
)


@settings(max_examples=60, deadline=None)
@given(record=records, rank=st.integers(0, 2))
def test_any_record_in_the_store_leaves_a_failure_to_raise(record: bytes, rank: int) -> None:
    store = DictStore()
    monitor = FaultMonitor(store, rank, 3, fault_timeout=0.05, namespace="run")
    store.set("pdcompile/run/fault", record)
    peer = (rank + 1) % 3
    failure = monitor.explain(peer, RuntimeError("Connection closed by peer"), what="a receive")
    assert isinstance(failure, PeerFailure)
    assert 0 <= failure.dead_rank < 3 and failure.dead_rank != rank
    parsed: Any
    try:
        parsed = json.loads(record)
        trusted = type(parsed["rank"]) is int and 0 <= parsed["rank"] < 3 \
            and isinstance(parsed["reason"], str) and parsed["rank"] != rank
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        trusted = False
    if not trusted:  # malformed, out of range, or naming this very rank: the peer is blamed
        assert failure.dead_rank == peer and "Connection closed by peer" in str(failure)


def test_a_record_naming_this_rank_still_explains() -> None:
    """The assert of the probe: a record naming the rank that is explaining (forged, or its
    own) made `explain` crash; now the lost peer is named."""
    store = DictStore()
    monitor = FaultMonitor(store, 1, 2, fault_timeout=0.05, namespace="run")
    store.set("pdcompile/run/fault", json.dumps({"rank": 1, "reason": "forged"}))
    failure = monitor.explain(0, RuntimeError("Connection reset"), what="the barrier")
    assert failure.dead_rank == 0 and "lost the connection to rank 0" in str(failure)


def test_causes_read_as_one_phrase() -> None:
    assert describe_cause(1, "stopped responding for 8.0 s and was killed") == \
        "rank 1 stopped responding for 8.0 s and was killed"
    assert describe_cause(0, "rank 0 (stage 0) in the forward of microbatch 3 raised "
                             "ValueError: boom").startswith("rank 0 (stage 0)")
    assert describe_cause(2, "ValueError: x") == "rank 2 failed: ValueError: x"
