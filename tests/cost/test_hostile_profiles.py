"""PipeDream profiles (graph.txt) nobody here wrote: bytes that are not text, lists nested
past any reader's depth, infinite figures, and random damage to a good file. Each gives a
CostGraph of finite non-negative figures or one ProfileError naming the file."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.errors import ProfileError
from pdcompile.profiles import MAX_PROFILE_BYTES, SHIPPED, load_pipedream, shipped_profiles
from tests.helpers.byte_damage import bounded

_LINE = ("node{n} -- Conv2d(3, 64) -- forward_compute_time={f}, backward_compute_time=2.0, "
         "activation_size={a}, parameter_size=7168.0")
_GOOD = "\n".join([_LINE.format(n=1, f="1.5", a="[1024.0; 2048.0]"),
                   _LINE.format(n=2, f="0.5", a="4096.0"), "\tnode1 -- node2", ""])


@pytest.mark.parametrize(("content", "match"), [
    (b"\xff\xfe\x00\x01", "is not text"),
    (_LINE.format(n=1, f="1", a="[" * 5000 + "1" + "]" * 5000).encode(), "is not a number"),
    (_LINE.format(n=1, f="inf", a="1").encode(), "finite non-negative"),
    (_LINE.format(n=1, f="1e400", a="1").encode(), "finite non-negative"),
    (_LINE.format(n=1, f="1", a="[1; inf]").encode(), "finite non-negative"),
], ids=["binary", "nested-lists", "inf", "overflow", "inf-in-list"])
def test_a_bad_profile_is_one_profile_error(tmp_path: Path, content: bytes, match: str) -> None:
    file = tmp_path / "graph.txt"
    file.write_bytes(content)
    with pytest.raises(ProfileError, match=match) as info:
        load_pipedream(file)
    assert str(file) in str(info.value) and len(str(info.value)) < 400


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_gives_a_usable_graph_or_a_profile_error(tmp_path: Path,
                                                               data: st.DataObject) -> None:
    raw = bytearray(_GOOD.encode())
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        new = data.draw(st.binary(max_size=3) | st.sampled_from(
            [b"[", b"]", b";", b"inf", b"nan", b"-", b"e9", b" -- ", b"\t", b"\n", b"="]),
            label="bytes")
        raw[at:at + data.draw(st.integers(0, 3), label="cut")] = new
    file = tmp_path / "graph.txt"
    file.write_bytes(bytes(raw))
    try:
        graph = load_pipedream(file)
    except ProfileError as err:
        assert str(file) in str(err)
        return
    for _, node in graph.nodes(data=True):
        for key in ("fwd", "bwd", "act", "params"):
            assert math.isfinite(node[key]) and node[key] >= 0, (key, node)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _over_the_limit(path: Path) -> None:
    with path.open("wb") as handle:  # sparse: no disk used
        handle.truncate(MAX_PROFILE_BYTES + 1)


@pytest.mark.parametrize(("make", "what"), [
    (_fifo, "is not a plain file but a FIFO"),
    (_over_the_limit, f"holds {MAX_PROFILE_BYTES + 1:,} bytes, more than 268 times the "
                      f"largest PipeDream profile shipped ({MAX_PROFILE_BYTES:,})"),
], ids=["fifo", "over-the-limit"])
def test_a_profile_that_is_no_plain_file_of_a_profiles_size_is_refused_unread(
        tmp_path: Path, make: Callable[[Path], None], what: str) -> None:
    """A FIFO named as graph.txt, or a file one byte over the limit: one ProfileError naming
    it, at once. Before, the FIFO waited for a writer forever, and a sparse file of a gigabyte
    was read whole (42 s and 10 GB of memory, then a message about its first line)."""
    file = tmp_path / "graph.txt"
    make(file)
    with bounded(5), pytest.raises(ProfileError) as info:
        load_pipedream(tmp_path)  # the folder holding it, as --profile takes one
    message = str(info.value)
    assert message.startswith(f"profile {file} {what}"), message
    assert "a shipped profile's name" in message and "\n" not in message


def test_the_largest_shipped_profile_is_far_under_the_limit() -> None:
    """The limit's figure: 100 times the largest profile that ships still reads."""
    largest = max((SHIPPED / name / "graph.txt").stat().st_size for name in shipped_profiles())
    assert 100 * largest < MAX_PROFILE_BYTES
