"""The rendezvous store on a socket bound to exactly the address named (no process started)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from pdcompile.backends.listen import listen_socket, open_store
from pdcompile.backends.torchrun_agent import _host_store
from pdcompile.errors import DistributedError
from tests.helpers.sockets import listening


def test_the_store_listens_on_the_address_named_only() -> None:
    before = listening([os.getpid()])
    store, sock = open_store("127.0.0.1", 0)
    try:
        port = int(store.port)
        new = listening([os.getpid()]) - before
        assert new == {("127.0.0.1", port)}, new  # torch's own would be ("::", port)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        sock.close()


def test_a_port_in_use_or_an_address_not_ours_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError, match=f"master port {port} on 127.0.0.1 is "
                                                   "already in use"):
            listen_socket("127.0.0.1", port)
    with pytest.raises(DistributedError, match="check --master-addr is an address of this "
                                               "machine"):
        listen_socket("192.0.2.1", 0)  # TEST-NET-1: never an address of this machine


def test_only_the_node_hosting_a_static_rendezvous_binds_the_store() -> None:
    def args(**kw: object) -> SimpleNamespace:
        base = {"rdzv_backend": "static", "rdzv_endpoint": "", "standalone": False,
                "master_addr": "127.0.0.1", "master_port": None, "node_rank": 0}
        return SimpleNamespace(**{**base, **kw})

    assert _host_store(args(node_rank=1, master_port=29500)) is None
    assert _host_store(args(rdzv_backend="c10d", rdzv_endpoint="h:1", master_port=1)) is None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hosted = _host_store(args(master_port=port))
    assert hosted is not None
    try:
        assert ("127.0.0.1", port) in listening([os.getpid()])
    finally:
        hosted[1].close()


def test_the_store_and_the_caller_each_close_their_own_descriptor() -> None:
    """The store closes the descriptor it listens on when it is destroyed: handed the caller's
    own, it closed the caller's socket under it (a later close failed with EBADF in launch(),
    or closed a file that had reused the number). Now the socket outlives the store, closes
    cleanly, and stores opened and dropped leave no descriptor behind."""
    import gc

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    store, sock = open_store("127.0.0.1", 0)  # the first loads torch's own files
    del store
    gc.collect()
    sock.close()
    before = open_files()
    for _ in range(5):
        store, sock = open_store("127.0.0.1", 0)
        del store
        gc.collect()
        os.fstat(sock.fileno())  # still ours
        sock.close()  # raised OSError: [Errno 9] Bad file descriptor
    assert open_files() == before
