"""Damage drawn by hypothesis for a file pdcompile wrote: bytes flipped, the file cut short, or
bytes added at its end (the three ways a disk, a copy or a hand edit changes one), and, in a
JSON file, a number replaced by another JSON value (a hand edit: Infinity, NaN, 1e999, ...)."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import strategies as st


_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_VALUES = [b"Infinity", b"-Infinity", b"NaN", b"1e999", b"-1", b"0", b"1.5", b"true", b"null",
           b'"1"', b"[]", b"{}"]


def damage(data: st.DataObject, files: list[Path]) -> str:
    """Damage one of `files` (drawn) in place; what was done, for the failure report."""
    file = data.draw(st.sampled_from(sorted(files)), label="file")
    raw = bytearray(file.read_bytes())
    kinds = ["flip", "truncate", "extend"]
    numbers = list(_NUMBER.finditer(bytes(raw))) if file.suffix == ".json" else []
    kind = data.draw(st.sampled_from(kinds + ["number"] * bool(numbers)), label="kind")
    if kind == "number":
        found = data.draw(st.sampled_from(numbers), label="number")
        value = data.draw(st.sampled_from(_VALUES) | st.integers(-2**70, 2**70).map(
            lambda n: str(n).encode()), label="value")
        raw[found.start():found.end()] = value
    elif kind == "flip" and raw:
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="offset")
            raw[at] ^= data.draw(st.integers(1, 255), label="mask")
    elif kind == "truncate":
        raw = raw[:data.draw(st.integers(0, max(len(raw) - 1, 0)), label="length")]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64) | st.just(b" ")
                         | st.just(b"\n"), label="tail")
    file.write_bytes(bytes(raw))
    return f"{kind} {file.name}"


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """Fail (TimeoutError) where the body runs longer than `seconds`: a read that hangs on a
    damaged file is a failure, not a wait (main thread, POSIX only)."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: a damaged file hangs the reader")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
