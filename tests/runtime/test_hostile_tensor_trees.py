"""Tensor-tree files (checkpoints, optimizer states, example minibatches) whose JSON skeleton
nobody here wrote: any JSON, tags with bodies of the wrong shape, names that are not dtypes,
nesting past any reader's depth. Each reads back as a value or raises one DamagedFileError
naming the file; nothing is unpickled or run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pdcompile.errors import DamagedFileError
from pdcompile.runtime.tensor_tree import decode, load_tree, read_tree, save_tree

_TAGS = ["$tensor", "$tensor_data", "$dtype", "$device", "$tuple", "$dict", "$set"]
_LEAVES = (st.none() | st.booleans() | st.integers(-3, 3) | st.floats()
           | st.sampled_from(["0", "1", "float32", "_dynamo", "cpu", "meta", "cuda:99", "x"]))
_TREES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(_TAGS) | st.text(max_size=3), inner, min_size=1,
                      max_size=2)
    | st.builds(lambda v: {"$tensor_data": {"dtype": "float32", "shape": v, "values": [1.0]}},
                inner), max_leaves=10)


def _write(path: Path, skeleton: str) -> None:
    save_file({"0": torch.arange(4.0), "1": torch.zeros(2, dtype=torch.int64)}, str(path),
              metadata={"pdcompile.tree": skeleton})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_TREES)
def test_any_skeleton_reads_or_is_one_damaged_file_error(tmp_path: Path, tree: object) -> None:
    file = tmp_path / "tree.safetensors"
    _write(file, json.dumps(tree))
    try:
        load_tree(file)
    except DamagedFileError as err:
        assert str(file) in str(err) and "\n" not in str(err)


@pytest.mark.parametrize("skeleton", ["[" * 100_000 + "]" * 100_000, "{\"a\": " * 50_000 + "1"
                                      + "}" * 50_000, "not json", "\"\\ud800\""])
def test_a_malformed_skeleton_is_one_damaged_file_error(tmp_path: Path, skeleton: str) -> None:
    file = tmp_path / "tree.safetensors"
    _write(file, skeleton)
    try:
        load_tree(file)
    except DamagedFileError as err:
        assert str(file) in str(err) and "\n" not in str(err)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 10_000),
                                                            st.integers(1, 255)), max_size=3),
       junk=st.binary(max_size=64))
def test_bytes_in_memory_read_as_their_file_does(tmp_path: Path, cut: int,
                                                 flips: list[tuple[int, int]],
                                                 junk: bytes) -> None:
    """`read_tree` (the one reader of checkpoints and exports, read once and checked) on a
    cut, altered or extended file: what safetensors' own reader gives for that file, the value
    or one DamagedFileError naming it."""
    file = save_tree(tmp_path / "tree.safetensors",
                     {"w": torch.arange(6.0), "step": 3, "nested": ({"a": torch.ones(2)},)})
    raw = bytearray(file.read_bytes())
    for position, bit in flips:
        raw[position % len(raw)] ^= bit
    data = bytes(raw[: cut % (len(raw) + 1)]) + junk
    file.write_bytes(data)
    expected = _safetensors_reads(file)
    try:
        found = read_tree(io.BytesIO(data), len(data), file, seen=lambda _: None)
    except DamagedFileError as err:
        assert str(file) in str(err) and "\n" not in str(err)
        found = DamagedFileError
    assert repr(found) == repr(expected)


def _safetensors_reads(file: Path) -> object:
    """The tree safetensors' own reader finds in `file` (DamagedFileError: none)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        return decode(json.loads(metadata["pdcompile.tree"]), tensors)
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError, OSError):
        return DamagedFileError
