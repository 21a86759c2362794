"""PipeDream profiles (graph.txt) nobody here wrote: bytes that are not text, lists nested
past any reader's depth, infinite figures, and random damage to a good file. Each gives a
CostGraph of finite non-negative figures or one ProfileError naming the file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.errors import ProfileError
from pdcompile.profiles import load_pipedream

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
