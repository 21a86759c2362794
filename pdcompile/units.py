"""Reading and printing quantities with explicit units (bytes, bytes/s, seconds, FLOP/s)."""

from __future__ import annotations

import math
import re

_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z/]*)\s*$")

_BYTES = {
    "": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40,
}
_BANDWIDTH = {
    "": 1.0, "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_FLOPS = {"": 1.0, "flops": 1.0, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}

_TABLES = {"bytes": _BYTES, "bandwidth": _BANDWIDTH, "seconds": _SECONDS, "flops": _FLOPS}
_EXAMPLES = {"bytes": "16GiB", "bandwidth": "10Gbps or 1.25e9", "seconds": "10us",
             "flops": "15.7TFLOPS"}


def parse_quantity(text: str | float | int, kind: str) -> float:
    """Parse `text` ("10Gbps", "16GiB", 1e9) into base units (bytes, bytes/s, seconds, FLOP/s).

    Units are case-insensitive except that for bandwidth "Gbps" (bits) differs from "GB/s"
    (bytes): a lower-case "b" before "ps" means bits, as network people write it.
    Raises ValueError naming the text and a valid example.
    """
    if isinstance(text, (int, float)):
        return float(text)
    match = _QUANTITY.match(text)
    table = _TABLES[kind]
    if not match:
        raise ValueError(f"cannot read {text!r} as {kind} (write e.g. {_EXAMPLES[kind]})")
    value, unit = float(match.group(1)), match.group(2)
    key = unit.lower()
    if kind == "bandwidth" and key.endswith("bps") and unit[-3] == "B":
        key = key[:-3] + "b/s"  # "GBps" means bytes per second
    if key not in table:
        allowed = ", ".join(k for k in table if k)
        raise ValueError(f"unknown {kind} unit {unit!r} in {text!r} (use one of: {allowed})")
    result = value * table[key]
    if not math.isfinite(result):  # "1e400": too large for a float, read as infinity
        raise ValueError(f"{text!r} is too large (it reads as infinity); write a finite {kind}, "
                         f"e.g. {_EXAMPLES[kind]}")
    return result


def format_bytes(value: float) -> str:
    """Bytes in binary units: 1.5 GiB."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def format_bandwidth(value: float) -> str:
    """Bytes per second in decimal units: 1.25 GB/s."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} B/s"


def format_seconds(value: float) -> str:
    """Seconds at a readable scale: 12.3 ms."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value / 1e-9:.4g} ns"
