"""torchrun as `pdcompile run` starts it: the same agent, with its failure report as data.

    python -m pdcompile.backends.torchrun_agent TORCHRUN_ARGS...

runs `torch.distributed.run` with exactly those arguments. The only differences: when workers
fail, the agent's report (a Python traceback and a table) becomes one JSON line in the file
named by REPORT_ENV, from which the launcher writes its one-line error; the agent's own log
lines (process start and stop notices, its failure log) are left out; and on the node that hosts
the rendezvous (static rendezvous: node rank 0; c10d: the machine --rdzv-endpoint names) the
store listens on the address given only (127.0.0.1 for a run on this machine), not on every
address as torchrun's own would (backends/listen.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pdcompile.errors import PdcompileError

REPORT_ENV = "PDCOMPILE_TORCHRUN_REPORT"


def main(argv: list[str] | None = None) -> int:
    """Run the agent; 0 when every worker succeeded, 1 (report written) otherwise."""
    os.environ.setdefault("LOGLEVEL", "ERROR")  # read by torch.distributed.elastic's loggers
    # (by those made from now on; the ones torch made when it was imported are set below)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):  # created when torch was imported
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failures: our one line
    args = parse_args(sys.argv[1:] if argv is None else argv)
    kept: list[tuple[Any, Any]] = []  # stores and their sockets, alive while we run
    try:
        hosted = _host_store(args)
        if hosted is not None:
            kept.append(hosted)
    except PdcompileError as err:
        return _report([], error=str(err))
    if args.rdzv_backend == "c10d":
        args.rdzv_backend = _register_bound_c10d(kept)
    try:
        run(args)
    except SignalException as err:  # the agent stopped its workers first
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        failures = [{"rank": int(rank), "exitcode": f.exitcode, "pid": f.pid,
                     "signal": f.signal_name() if f.exitcode < 0 else None,
                     "time": f.timestamp}
                    for rank, f in sorted(err.failures.items())]
        return _report(failures)
    return 0


def _report(failures: list[dict[str, Any]], *, error: str | None = None) -> int:
    """Write the failure report (REPORT_ENV) or print it; the agent's exit status, 1."""
    report = os.environ.get(REPORT_ENV)
    data: Any = failures if error is None else {"error": error}
    if report:
        Path(report).write_text(json.dumps(data))
    else:
        print(f"torchrun: workers failed: {json.dumps(data)}", file=sys.stderr)
    return 1


def _host_store(args: Any) -> tuple[Any, Any] | None:
    """On the node that hosts the rendezvous, its store, on a socket bound to exactly the
    address the user named (--master-addr for a static rendezvous, the host of --rdzv-endpoint
    for c10d); torchrun's own TCPStore (multi-tenant, same port) then shares it."""
    from pdcompile.backends.listen import open_store

    timeout = float(getattr(args, "rdzv_timeout", 900) or 900)
    backend = getattr(args, "rdzv_backend", "static")
    if getattr(args, "standalone", False):
        return None
    if backend == "c10d" and args.rdzv_endpoint:
        host, port = _c10d_host(args)
        return None if host is None else open_store(host, port, multi_tenant=True,
                                                    timeout=timeout)
    if backend != "static" or args.rdzv_endpoint or args.master_port is None \
            or (args.node_rank or 0) != 0:
        return None
    return open_store(args.master_addr, int(args.master_port), multi_tenant=True,
                      timeout=timeout)


BOUND_C10D = "pdcompile-c10d"


def _register_bound_c10d(kept: list[tuple[Any, Any]]) -> str:
    """Register torch's c10d rendezvous under BOUND_C10D with one change, and return the name.

    After the rendezvous, torch's c10d handler hosts a second store on the first node, for the
    workers to bootstrap from, on a free port of every address (its `_create_tcp_store_server`);
    this one binds that store to exactly the node's address (--local-addr, else its host name)."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from pdcompile.backends.listen import open_store

    def bootstrap_store(addr: str, port: int) -> Any:
        store, sock = open_store(addr, port, multi_tenant=True)
        kept.append((store, sock))
        return store

    def create(params: Any) -> Any:
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        handler._create_tcp_store_server = bootstrap_store  # this handler only
        handler._backend_name = BOUND_C10D  # torch checks it against the name registered
        return handler

    rendezvous_handler_registry.register(BOUND_C10D, create)
    return BOUND_C10D


def _c10d_host(args: Any) -> tuple[str | None, int]:
    """(host, port) of a c10d rendezvous endpoint when this machine hosts its store (decided as
    torch's c10d backend decides: `is_host` in --rdzv-conf, else the host names this machine),
    (None, port) when another machine does."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)
    conf = dict(item.split("=", 1) for item in (getattr(args, "rdzv_conf", "") or "").split(",")
                if "=" in item)
    is_host = conf.get("is_host")
    hosts = (is_host.strip().lower() in ("1", "true", "yes", "on") if is_host is not None
             else _matches_machine_hostname(host))
    return (host if hosts else None), port


if __name__ == "__main__":
    sys.exit(main())
