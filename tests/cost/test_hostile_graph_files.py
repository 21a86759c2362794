"""CostGraph files (`--costgraph`) and timelines (`simulate --measured`) nobody here wrote:
any JSON document, JSON nested past the parser's depth, bytes that are not text. Each reads
or raises its own error (CostGraphError, TimelineError) naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.cost import costgraph
from pdcompile.errors import CostGraphError
from pdcompile.timeline import Timeline, TimelineError

_KEYS = st.sampled_from(["format", "nodes", "edges", "id", "fwd", "bwd", "act", "params",
                         "events", "meta", "source", "name", "x"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2) | st.floats()
                     | st.sampled_from(["pdcompile.costgraph/1", "pdcompile.timeline/1", "a"]),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=12)
_BAD = [b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b"[1]", b'"x"', b"{",
        b'{"format": "pdcompile.timeline/1", "meta": [1]}']


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_JSON)
def test_any_document_reads_or_is_the_readers_error(tmp_path: Path, doc: object) -> None:
    file = tmp_path / "file.json"
    file.write_text(json.dumps(doc))
    _read_both(file)


@pytest.mark.parametrize("content", _BAD, ids=["binary", "nested", "list", "string",
                                               "truncated", "meta-not-object"])
def test_bad_files_are_the_readers_error(tmp_path: Path, content: bytes) -> None:
    file = tmp_path / "file.json"
    file.write_bytes(content)
    _read_both(file)


def _read_both(file: Path) -> None:
    try:
        costgraph.load(file)
    except CostGraphError as err:
        assert str(file) in str(err) and "\n" not in str(err)
    try:
        Timeline.load(file)
    except TimelineError as err:
        assert str(file) in str(err) and "\n" not in str(err)
