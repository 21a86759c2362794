"""The rendezvous store on a socket we bind: loopback for a run on this machine, the address the
user names for several machines, never every address.

torch's TCPStore server binds the wildcard address (IPv4 and IPv6) whatever host name it is
given, and has no authentication: any program that reaches it can read and write the run's keys.
`open_store` binds the listening socket itself, to exactly `addr`, and hands it to the store
(`master_listen_fd`). With `multi_tenant=True` the store is shared by every TCPStore of this
process on that port, which is how the torchrun agent's own rendezvous ends up on it
(backends/torchrun_agent.py). What stays exposed is documented in docs/how-it-works.md
("What a run exposes").
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
from typing import Any

from pdcompile.errors import DistributedError


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to `addr:port` (0: a free port) and listening; one line if not."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise DistributedError(f"cannot resolve the rendezvous address {addr!r} ({err}); pass "
                               "an address of this machine (--master-addr)") from None
    family, _, _, _, where = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(where)
        sock.listen(512)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise DistributedError(
                f"master port {port} on {addr} is already in use (another run or program holds "
                "it); pass a different --master-port, or none to pick a free port") from None
        raise DistributedError(f"cannot listen on {addr}:{port} for the rendezvous "
                               f"({err.strerror or err}); check --master-addr is an address of "
                               "this machine") from None
    sock.set_inheritable(False)
    return sock


def open_store(addr: str, port: int, *, timeout: float = 60.0, multi_tenant: bool = False,
               world_size: int | None = None) -> tuple[Any, socket.socket]:
    """A TCPStore server listening on `addr:port` only, and the socket it listens on (the
    caller's to close; the store listens on a duplicate of it, which it closes itself when it
    is destroyed: handed the socket's own descriptor, the store closed it under the caller,
    whose close then failed with EBADF, or closed whatever file had reused the number)."""
    import torch.distributed as dist

    sock = listen_socket(addr, port)
    bound = int(sock.getsockname()[1])
    handed = os.dup(sock.fileno())
    try:
        store = dist.TCPStore(addr, bound, world_size, True,
                              timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False, multi_tenant=multi_tenant,
                              master_listen_fd=handed, use_libuv=True)
    except Exception as err:  # DistNetworkError, RuntimeError
        with contextlib.suppress(OSError):  # where the store had not taken it yet
            os.close(handed)
        sock.close()
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DistributedError(f"cannot start the rendezvous store on {addr}:{bound} ({first})"
                               ) from None
    return store, sock


__all__ = ["listen_socket", "open_store"]
