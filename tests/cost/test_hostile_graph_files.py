"""CostGraph files (`--costgraph`) and timelines (`simulate --measured`) nobody here wrote:
any JSON document, JSON nested past the parser's depth, bytes that are not text. Each reads
or raises its own error (CostGraphError, TimelineError) naming the file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.cost import costgraph
from pdcompile.errors import CostGraphError
from pdcompile.timeline import MAX_TIMELINE_BYTES, Timeline, TimelineError
from tests.helpers.byte_damage import bounded
from tests.helpers.paths import ROOT

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


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _over(limit: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with path.open("wb") as handle:  # sparse: no disk used
            handle.truncate(limit + 1)
    return make


def _load_costgraph(file: Path) -> None:
    costgraph.load(file)


def _load_timeline(file: Path) -> None:
    Timeline.load(file)


_READERS = [(_load_costgraph, CostGraphError, "CostGraph", costgraph.MAX_COSTGRAPH_BYTES,
             "write one with `pdcompile inspect MODEL --save FILE.json`"),
            (_load_timeline, TimelineError, "timeline", MAX_TIMELINE_BYTES,
             "give the timeline.json a run recorded")]


@pytest.mark.parametrize(("read", "error", "role", "limit", "fix"), _READERS,
                         ids=["costgraph", "timeline"])
@pytest.mark.parametrize("kind", ["fifo", "over-the-limit", "folder"])
def test_a_file_that_is_no_plain_file_of_its_size_is_refused_unread(
        tmp_path: Path, read: Callable[[Path], None], error: type[Exception], role: str,
        limit: int, fix: str, kind: str) -> None:
    """A FIFO, a file one byte over the limit or a folder named as a CostGraph (--costgraph)
    or a timeline (simulate --measured): the reader's own error naming it, what it is and the
    fix, in one line, at once. Before, the FIFO waited for a writer forever, a sparse file of a
    gigabyte was read whole (2.2 GB of memory, then "Expecting value: line 1 column 1"); a folder
    now reads as the others do."""
    file = tmp_path / "file.json"
    what = {"fifo": "is not a plain file but a FIFO",
            "over-the-limit": f"holds {limit + 1:,} bytes, more than ",
            "folder": "is a folder, not a plain file"}[kind]
    if kind == "folder":
        file.mkdir()
    else:
        (_fifo if kind == "fifo" else _over(limit))(file)
    with bounded(5), pytest.raises(error) as info:
        read(file)
    message = str(info.value)
    assert message.startswith(f"{role} {file} {what}"), message
    assert "\n" not in message and fix in message, message
    assert kind != "over-the-limit" or f" ({limit:,}); " in message, message


def test_the_costgraph_limit_holds_a_hundred_times_the_largest_one_here() -> None:
    """The limit's figure: GPT-2 XL's CostGraph (2,074 nodes), the largest the repository
    holds, 100 times over."""
    gpt2 = ROOT / "benchmarks" / "results" / ".cache" / "gpt2-xl-h100.json"
    assert 100 * gpt2.stat().st_size < costgraph.MAX_COSTGRAPH_BYTES
