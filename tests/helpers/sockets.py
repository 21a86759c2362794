"""The TCP sockets processes listen on, read from /proc (Linux): what a run exposes."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket (IPv4 and IPv6) that these processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            found.add((_address(address, width), int(port, 16)))
    return found


def _address(hex_text: str, width: int) -> str:
    raw = bytes.fromhex(hex_text)
    # /proc/net writes each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
    return str(ipaddress.ip_address(words))


def children(pid: int) -> list[int]:
    """`pid` and all its descendants, now."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                text = Path(f"/proc/{current}/task/{task}/children").read_text()
            except OSError:
                continue
            todo += [int(c) for c in text.split()]
    return out
